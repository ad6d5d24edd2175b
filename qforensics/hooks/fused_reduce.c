/* The stats op's one-pass CPU reduction (qf_group: one op call's tensors into a ring row), the
 * copy of kept channel spans (qf_spans), the logits' figures and the per-row non-finite flags.
 *
 * Built by hooks/fused.py with the system C compiler (no torch headers: it reads raw bf16, fp32
 * or integer memory and writes raw float32), loaded with ctypes, and called with the GIL
 * released (the op's C++ kernel, hooks/statsop_cpu.cpp, and hooks/opcall.c call qf_group by its
 * address).
 *
 * The core (DEFINE_CORE) reduces g stacked [R, C] tensors: sum, sum of squares, min, max, per-
 * channel ranges, per-row absmax. NaN propagates into every figure whose inputs hold one (as
 * torch's sum/amin/amax do): the hot loop only notes that a row holds a NaN, and a tensor that
 * does is swept again for its channels. An Inf gives Inf sums and extrema, and +Inf with -Inf a
 * NaN sum; qf_group leaves such a tensor to its caller's exact pass. Sums run in float32 vector
 * lanes over blocks of BLOCK values, blocks add up in double.
 *
 * Min and max are written as `v < m ? v : m`: the vector min/max instructions compute exactly
 * that, so the loops vectorize without -ffast-math (NaN handling is the flag above).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 2048

static inline float from_bf16(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float from_f32(float v) { return v; }
static inline float from_i64(int64_t v) { return (float)v; }
static inline float from_i32(int32_t v) { return (float)v; }

/* The figures every loop keeps: sum, sum of squares, min, max. Whether a NaN was seen is read
 * from the block's sum of squares afterwards: a sum of squares is NaN exactly when a value was
 * (an Inf squares to +Inf, and +Inf plus anything non-negative stays +Inf). */
#define STATS(expr)                                                                         \
    float v = (expr);                                                                       \
    s += v; q += v * v;                                                                     \
    mn = v < mn ? v : mn; mx = v > mx ? v : mx;

/* A row function's signature and its running figures (DEFINE_ROW, DEFINE_ROW_AVX512). */
#define ROW_BEGIN(NAME, T)                                                                  \
static __attribute__((unused)) void NAME(const T *row, int64_t C, float *cmin,             \
                 float *cmax, float *dst, double *S, double *Q, float *mnp, float *mxp,       \
                 int *nanp) {                                                               \
    float mn = INFINITY, mx = -INFINITY;                                                    \
    int nan = 0;                                                                            \
    double s_all = 0.0, q_all = 0.0;
#define ROW_END *S += s_all; *Q += q_all; *mnp = mn; *mxp = mx; *nanp = nan; }

/* Row figures: sum, sum of squares, min, max, whether a NaN was seen; with cmin/cmax (keep and
 * R > 1) the per-channel running min/max; with dst (R == 1 and keep) the values as float32. */
#define DEFINE_ROW(NAME, T, CONV)                                                           \
ROW_BEGIN(NAME, T)                                                                          \
    for (int64_t c0 = 0; c0 < C; c0 += BLOCK) {                                             \
        int64_t c1 = c0 + BLOCK < C ? c0 + BLOCK : C;                                       \
        float s = 0.f, q = 0.f;                                                             \
        if (cmin) {                                                                         \
            _Pragma("omp simd reduction(+:s,q) reduction(min:mn) reduction(max:mx)") \
            for (int64_t c = c0; c < c1; c++) {                                             \
                STATS(CONV(row[c]));                                                        \
                cmin[c] = v < cmin[c] ? v : cmin[c]; cmax[c] = v > cmax[c] ? v : cmax[c];   \
            }                                                                               \
        } else if (dst) {                                                                   \
            _Pragma("omp simd reduction(+:s,q) reduction(min:mn) reduction(max:mx)") \
            for (int64_t c = c0; c < c1; c++) {                                             \
                STATS(CONV(row[c]));                                                        \
                dst[c] = v;                                                                 \
            }                                                                               \
        } else {                                                                            \
            _Pragma("omp simd reduction(+:s,q) reduction(min:mn) reduction(max:mx)") \
            for (int64_t c = c0; c < c1; c++) {                                             \
                STATS(CONV(row[c]));                                                        \
            }                                                                               \
        }                                                                                   \
        s_all += s; q_all += q; nan |= q != q;                                              \
    }                                                                                       \
    ROW_END

/* The reduction of g stacked tensors of R rows x C channels, written through pointers (any
 * may be NULL): S, Q, MN, MX (g each: sum, sum of squares, min, max; NaN where the tensor holds
 * a NaN), CMIN and CMAX (g*C each: per-channel ranges when R > 1; when R == 1 the values, into
 * CMIN and, when given, CMAX too), TOK (g*R: per-row absmax, NaN for a row with a NaN). */
#define DEFINE_CORE(NAME, ROW, T, CONV)                                                     \
static void NAME(const T *x, int64_t g, int64_t R, int64_t C, int64_t P, float *S_,        \
                 float *Q_, float *MN, float *MX, float *CMIN, float *CMAX, float *TOK) {   \
    for (int64_t t = 0; t < g; t++) {                                                       \
        double S = 0.0, Q = 0.0;                                                            \
        float tmin = INFINITY, tmax = -INFINITY;                                            \
        int tnan = 0;                                                                       \
        float *cmin = CMIN ? CMIN + t * C : NULL;                                           \
        float *cmax = CMAX ? CMAX + t * C : NULL;                                           \
        const int chans = R > 1 && cmin && cmax;                                            \
        if (chans)                                                                          \
            for (int64_t c = 0; c < C; c++) { cmin[c] = INFINITY; cmax[c] = -INFINITY; }    \
        for (int64_t r = 0; r < R; r++) {                                                   \
            float mn, mx;                                                                   \
            int nan;                                                                        \
            ROW(x + (t * R + r) * P, C, chans ? cmin : NULL, chans ? cmax : NULL,           \
                R == 1 ? cmin : NULL, &S, &Q, &mn, &mx, &nan);                              \
            tnan |= nan;                                                                    \
            tmin = mn < tmin ? mn : tmin;                                                   \
            tmax = mx > tmax ? mx : tmax;                                                   \
            if (TOK) TOK[t * R + r] = nan ? NAN : (mx > -mn ? mx : -mn);                    \
        }                                                                                   \
        if (R == 1 && cmin && cmax) memcpy(cmax, cmin, (size_t)C * sizeof(float));          \
        if (S_) S_[t] = tnan ? NAN : (float)S;                                              \
        if (Q_) Q_[t] = tnan ? NAN : (float)Q;                                              \
        if (MN) MN[t] = tnan ? NAN : tmin;                                                  \
        if (MX) MX[t] = tnan ? NAN : tmax;                                                  \
        if (chans && tnan) { /* the channels that hold a NaN (failing steps only) */        \
            for (int64_t r = 0; r < R; r++) {                                               \
                const T *row = x + (t * R + r) * P;                                         \
                for (int64_t c = 0; c < C; c++) {                                           \
                    float v = CONV(row[c]);                                                 \
                    if (v != v) { cmin[c] = NAN; cmax[c] = NAN; }                           \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
    }                                                                                       \
}

DEFINE_ROW(row_bf16, uint16_t, from_bf16)
DEFINE_ROW(row_f32, float, from_f32)

#if defined(__AVX512F__)
#include <immintrin.h>
/* The same row figures with AVX-512 intrinsics: two 16-lane chains per figure, 32 values a
 * turn (the compiler keeps one chain, whose latency bounds the loop). _mm512_min_ps(v, m) is
 * `v < m ? v : m`, as in STATS. Sums differ from the plain loop's only in their rounding. */
static inline __m512 load16_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }

#define DEFINE_ROW_AVX512(NAME, T, CONV, LOAD)                                              \
ROW_BEGIN(NAME, T)                                                                          \
    for (int64_t c0 = 0; c0 < C; c0 += BLOCK) {                                             \
        int64_t c1 = c0 + BLOCK < C ? c0 + BLOCK : C, c = c0;                               \
        __m512 s0 = _mm512_setzero_ps(), s1 = s0, q0 = s0, q1 = s0;                         \
        __m512 n0 = _mm512_set1_ps(INFINITY), n1 = n0;                                      \
        __m512 x0 = _mm512_set1_ps(-INFINITY), x1 = x0;                                     \
        for (; c + 32 <= c1; c += 32) {                                                     \
            __m512 a = LOAD(row + c), b = LOAD(row + c + 16);                               \
            s0 = _mm512_add_ps(s0, a); s1 = _mm512_add_ps(s1, b);                           \
            q0 = _mm512_fmadd_ps(a, a, q0); q1 = _mm512_fmadd_ps(b, b, q1);                 \
            n0 = _mm512_min_ps(a, n0); n1 = _mm512_min_ps(b, n1);                           \
            x0 = _mm512_max_ps(a, x0); x1 = _mm512_max_ps(b, x1);                           \
            if (cmin) {                                                                     \
                _mm512_storeu_ps(cmin + c, _mm512_min_ps(a, _mm512_loadu_ps(cmin + c)));     \
                _mm512_storeu_ps(cmin + c + 16,                                             \
                                 _mm512_min_ps(b, _mm512_loadu_ps(cmin + c + 16)));         \
                _mm512_storeu_ps(cmax + c, _mm512_max_ps(a, _mm512_loadu_ps(cmax + c)));     \
                _mm512_storeu_ps(cmax + c + 16,                                             \
                                 _mm512_max_ps(b, _mm512_loadu_ps(cmax + c + 16)));         \
            } else if (dst) {                                                               \
                _mm512_storeu_ps(dst + c, a); _mm512_storeu_ps(dst + c + 16, b);            \
            }                                                                               \
        }                                                                                   \
        float s = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));                              \
        float q = _mm512_reduce_add_ps(_mm512_add_ps(q0, q1));                              \
        float bn = _mm512_reduce_min_ps(_mm512_min_ps(n0, n1));                             \
        float bx = _mm512_reduce_max_ps(_mm512_max_ps(x0, x1));                             \
        mn = bn < mn ? bn : mn; mx = bx > mx ? bx : mx;                                     \
        for (; c < c1; c++) { /* the block's last values (fewer than 32) */                 \
            STATS(CONV(row[c]));                                                            \
            if (cmin) { cmin[c] = v < cmin[c] ? v : cmin[c]; cmax[c] = v > cmax[c] ? v : cmax[c]; } \
            else if (dst) dst[c] = v;                                                       \
        }                                                                                   \
        s_all += s; q_all += q; nan |= q != q;                                              \
    }                                                                                       \
    ROW_END
DEFINE_ROW_AVX512(row_bf16_v, uint16_t, from_bf16, load16_bf16)
DEFINE_ROW_AVX512(row_f32_v, float, from_f32, load16_f32)
#define ROW_BF16 row_bf16_v
#define ROW_F32 row_f32_v
#else
#define ROW_BF16 row_bf16
#define ROW_F32 row_f32
#endif
DEFINE_CORE(core_bf16, ROW_BF16, uint16_t, from_bf16)
DEFINE_CORE(core_f32, ROW_F32, float, from_f32)
DEFINE_ROW(row_i64, int64_t, from_i64)
DEFINE_ROW(row_i32, int32_t, from_i32)
DEFINE_CORE(core_i64, row_i64, int64_t, from_i64)
DEFINE_CORE(core_i32, row_i32, int32_t, from_i32)

/* One call of the compiled-mode stats op (hooks/statscpu.py `stats_cpu`): its n tensors into
 * one ring row, in the row layout statsop.ENTRY_COLS defines, and their token maxima into one
 * slot of the token ring (toks: [T rows][tstride entries], token-major: row r of the entry in
 * column `col` at toks[r * tstride + col]). Tensor i is described by desc[GROUP_DESC * i ...] =
 * {col, dtype (0: float32, 1: bfloat16, 2: int64, 3: int32), R, C, off, cap, tok, src, width,
 * pitch (elements from one row to the next, >= C: a slice of a wider tensor's columns)} and its
 * address addr[i] (the description holds only what a call site repeats step after step; the
 * addresses change): with src >= 0 it holds the values of an earlier tensor of the call, whose
 * entry (width floats at ring offset src, its token maxima in column C) is copied to off (and
 * its first min(R, tok) token maxima to column col); else it is reduced in one pass into its
 * entry at off: sum, sum of squares, min, max, 0, 0, R, C, stamp, then its channel ranges when
 * 1 < C <= cap, and the maxima of its first min(R, tok) rows into its column when tok > 0
 * (tok <= T: the caller clamps; spill: scratch for R row maxima, spill_n floats). done[i] = 1
 * when the entry was written and its figures are finite; 0 otherwise (R == 0, a non-finite
 * value): the caller redoes it exactly. Returns how many are not done (0: the caller has
 * nothing to look at). */
#define GROUP_DESC 10
int qf_group(int64_t n, const int64_t *desc, const int64_t *addr, float *row, float *toks,
             int64_t tstride, float stamp, float *spill, int64_t spill_n, int8_t *done) {
    int left = 0;  /* tensors not done: the caller redoes them */
    for (int64_t i = 0; i < n; i++) {
        const int64_t *d = desc + GROUP_DESC * i;
        const int64_t col = d[0], R = d[2], C = d[3], off = d[4], cap = d[5], tok = d[6];
        const int64_t src = d[7];
        const int64_t k = tok > 0 ? (R < tok ? R : tok) : 0;
        done[i] = 0;
        if (src >= 0) {
            memmove(row + off, row + src, (size_t)d[8] * sizeof(float));
            for (int64_t r = 0; r < k; r++) toks[r * tstride + col] = toks[r * tstride + C];
            done[i] = 1;
            continue;
        }
        if (R <= 0 || C <= 0) { left++; continue; }
        float *e = row + off;
        const int keep = C > 1 && C <= cap;
        float *tk = NULL;
        if (k) {
            if (spill && spill_n >= R) tk = spill;
            else { left++; continue; }
        }
        float *cmin = keep ? e + 9 : NULL, *cmax = keep ? e + 9 + cap : NULL;
        const int64_t P = d[9];
        const void *x = (const void *)(intptr_t)addr[i];
        if (d[1] == 1)
            core_bf16((const uint16_t *)x, 1, R, C, P, e, e + 1, e + 2, e + 3, cmin, cmax, tk);
        else if (d[1] == 0)
            core_f32((const float *)x, 1, R, C, P, e, e + 1, e + 2, e + 3, cmin, cmax, tk);
        else if (d[1] == 2)
            core_i64((const int64_t *)x, 1, R, C, P, e, e + 1, e + 2, e + 3, cmin, cmax, tk);
        else if (d[1] == 3)
            core_i32((const int32_t *)x, 1, R, C, P, e, e + 1, e + 2, e + 3, cmin, cmax, tk);
        else {
            left++;
            continue;
        }
        if (!(isfinite(e[0]) && isfinite(e[1]) && isfinite(e[2]) && isfinite(e[3]))) {
            left++;
            continue;
        }
        for (int64_t r = 0; r < k; r++) toks[r * tstride + col] = spill[r];
        e[4] = 0.f; e[5] = 0.f; e[6] = (float)R; e[7] = (float)C; e[8] = stamp;
        done[i] = 1;
    }
    return left;
}

/* exp(x) for x <= 0 in float, in a form the compiler vectorizes (no float->int conversion):
 * t = x log2(e) = k + f with k = round(t) (read from the low bits of t + 1.5 * 2^23) and f in
 * [-0.5, 0.5]; 2^f by its Taylor series to degree 7 (relative error below 1e-7 there), 2^k
 * through the exponent bits. Below -87 (2^-126) it returns 0. */
static inline float exp_nonpos(float x) {
    float t = x * 1.44269504088896341f;
    t = t < -126.f ? -126.f : t;
    float y = t + 12582912.f;
    float f = (t - (y - 12582912.f)) * 0.69314718055994531f;
    float p = 1.f + f * (1.f + f * (0.5f + f * (1.f / 6 + f * (1.f / 24 + f * (1.f / 120
              + f * (1.f / 720 + f * (1.f / 5040)))))));
    uint32_t bits;
    memcpy(&bits, &y, sizeof bits);
    bits = (bits - 0x4B400000u + 127u) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x < -87.f ? 0.f : p * scale;
}

/* The logits figures of reduce.fast_logits for one row of n values, out[15]: min, max, mean,
 * variance (E[v^2] - mean^2), entropy of softmax(v), the 5 largest values (descending), their
 * indices (as floats; among equal values the lower index first, like argmax). A row holding a
 * NaN or an Inf gets NaN in out[0..4]: reduce.logits_row then takes its exact pass. */
#define DEFINE_LOGITS(NAME, ROW, T, CONV)                                                   \
int NAME(const T *src, int64_t n, float *out) {                                             \
    float mn = INFINITY, mx = -INFINITY;                                                    \
    int nan = 0;                                                                            \
    double S = 0.0, Q = 0.0;                                                                \
    ROW(src, n, NULL, NULL, NULL, &S, &Q, &mn, &mx, &nan);  /* sums, min, max, NaN */       \
    for (int i = 0; i < 5; i++) { out[5 + i] = NAN; out[10 + i] = -1.f; }                  \
    if (n <= 0 || nan || isinf(mn) || isinf(mx)) {                                          \
        for (int i = 0; i < 5; i++) out[i] = NAN;                                           \
        return 0;                                                                           \
    }                                                                                       \
    double mean = S / (double)n;                                                            \
    double z = 0.0, a = 0.0;                                                                \
    for (int64_t c0 = 0; c0 < n; c0 += BLOCK) {  /* softmax sums, relative to the max */    \
        int64_t c1 = c0 + BLOCK < n ? c0 + BLOCK : n;                                       \
        float zs = 0.f, as = 0.f;                                                           \
        _Pragma("omp simd reduction(+:zs,as)")                                              \
        for (int64_t c = c0; c < c1; c++) {                                                 \
            float d = CONV(src[c]) - mx;                                                    \
            float e = exp_nonpos(d);                                                        \
            zs += e; as += e * d;                                                           \
        }                                                                                   \
        z += zs; a += as;                                                                   \
    }                                                                                       \
    float top[5]; int64_t idx[5]; int k = 0;                                                \
    for (int64_t c = 0; c < n; c++) {                                                       \
        float x = CONV(src[c]);                                                             \
        if (k < 5 || x > top[k - 1]) {            /* insertion into the sorted five */      \
            int j = k < 5 ? k++ : 4;                                                        \
            while (j > 0 && x > top[j - 1]) { top[j] = top[j - 1]; idx[j] = idx[j - 1]; j--; } \
            top[j] = x; idx[j] = c;                                                         \
        }                                                                                   \
    }                                                                                       \
    out[0] = mn; out[1] = mx; out[2] = (float)mean;                                         \
    out[3] = (float)(Q / (double)n - mean * mean);                                          \
    out[4] = (float)(log(z) - a / z);                                                       \
    for (int i = 0; i < k; i++) { out[5 + i] = top[i]; out[10 + i] = (float)idx[i]; }       \
    return 0;                                                                               \
}

DEFINE_LOGITS(qf_logits_bf16, ROW_BF16, uint16_t, from_bf16)
DEFINE_LOGITS(qf_logits_f32, ROW_F32, float, from_f32)

/* reduce.nonfinite_rows: out[r] = 1 where row r of x (R rows of C values) holds a NaN or an
 * Inf (all exponent bits set), else 0. Integer tests on the bits, so the loop vectorizes. */
#define DEFINE_NONFINITE(NAME, T, EXP)                                                      \
int NAME(const T *x, int64_t R, int64_t C, float *out) {                                    \
    for (int64_t r = 0; r < R; r++) {                                                       \
        const T *row = x + r * C;                                                           \
        T bad = 0;                                                                          \
        _Pragma("omp simd reduction(|:bad)")                                                \
        for (int64_t c = 0; c < C; c++)                                                     \
            bad |= (T)((row[c] & EXP) == EXP);                                              \
        out[r] = bad ? 1.f : 0.f;                                                           \
    }                                                                                       \
    return 0;                                                                               \
}

DEFINE_NONFINITE(qf_nonfinite_bf16, uint16_t, (uint16_t)0x7F80u)
DEFINE_NONFINITE(qf_nonfinite_f32, uint32_t, 0x7F800000u)

/* A compiled step's channel ranges side by side (hooks/graphstats.py `_spans`): span i is
 * desc[2 i + 1] floats at the address desc[2 i], copied after the previous one into out.
 * Returns the floats written. One call instead of a slice and a list item per entry. */
int64_t qf_spans(int64_t n, const int64_t *desc, float *out) {
    int64_t at = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t w = desc[2 * i + 1];
        memcpy(out + at, (const float *)(intptr_t)desc[2 * i], (size_t)w * sizeof(float));
        at += w;
    }
    return at;
}
