// The stats op's CPU kernel behind the dispatcher: no Python in a call (hooks/statsnative.py
// builds and loads it; hooks/statscpu.py's Python kernel is what runs where it is not built).
//
// hooks/statsop.py defines the op and the record layout; the layout's numbers reach this file
// as -D flags from there (QF_N_SCAL, QF_STAMP_MOD, QF_ENTRY_BITS, QF_SNAP_*), so a change of
// layout rebuilds it. What a call does is what statscpu.stats_cpu does, in the same order:
// - every tensor of the group in one call of fused_reduce.c's qf_group (float32, bf16, int64,
//   int32 rows, contiguous or a 2-d slice of columns); a tensor that repeats an earlier one of
//   the call (the same memory, dtype, shape, strides and caps) has its entry copied;
// - what qf_group does not finish (a non-finite value, another dtype or layout, no rows) is
//   redone exactly here, over a float32 copy: sums, min and max over the finite values only,
//   channel ranges (+inf/-inf for a channel without a finite value), token maxima (NaN for a
//   row holding one), the non-finite and NaN counts;
// - the first-failure word keeps the least (step, entry, NaN) key; the snapshot keeps the
//   first failing candidate output's call once a run.
#include <torch/library.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

extern "C" {
#include "fused_reduce.c"
}

namespace {

constexpr int64_t kNoFirst = std::numeric_limits<int64_t>::max();

int64_t entry_width(int64_t cap) { return QF_N_SCAL + 2 * cap; }

int64_t pos_mod(int64_t a, int64_t m) { return ((a % m) + m) % m; }

int group_code(at::ScalarType t) {
    switch (t) {
        case at::kFloat: return 0;
        case at::kBFloat16: return 1;
        case at::kLong: return 2;
        case at::kInt: return 3;
        default: return -1;
    }
}

// x as [rows, channels] (channels: the last dim; a 0/1-d tensor is [n, 1]), float32, contiguous
at::Tensor as_rows_f32(const at::Tensor& x) {
    at::Tensor v = x.dim() >= 2 ? x.reshape({-1, x.size(-1)}) : x.reshape({-1, 1});
    return v.to(at::kFloat).contiguous();
}

bool same_values(const at::Tensor& a, const at::Tensor& b) {
    return a.data_ptr() == b.data_ptr() && a.scalar_type() == b.scalar_type() &&
           a.sizes() == b.sizes() && a.strides() == b.strides();
}

// The exact pass over float32 rows [R, C]: the entry at `e` written whole, the first
// min(R, tok) token maxima at t[0], t[ts], t[2 ts]...; returns (non-finite, NaN) counts.
std::pair<int64_t, int64_t> exact_rows(const float* a, int64_t R, int64_t C, float* e,
                                       int64_t cap, float* t, int64_t ts, int64_t tok,
                                       bool per_token, float stamp) {
    double s = 0.0, ss = 0.0;
    int64_t bad = 0, nan = 0;
    std::vector<float> lo(static_cast<size_t>(C), INFINITY), hi(static_cast<size_t>(C), -INFINITY);
    for (int64_t r = 0; r < R; r++) {
        const float* p = a + r * C;
        for (int64_t c = 0; c < C; c++) {
            const float v = p[c];
            if (std::isfinite(v)) {
                s += v;
                ss += static_cast<double>(v) * v;
                lo[c] = std::min(lo[c], v);
                hi[c] = std::max(hi[c], v);
            } else {
                bad++;
                nan += std::isnan(v) ? 1 : 0;
            }
        }
    }
    float gmin = INFINITY, gmax = -INFINITY;
    for (int64_t c = 0; c < C; c++) {
        gmin = std::min(gmin, lo[c]);
        gmax = std::max(gmax, hi[c]);
    }
    const float scal[QF_N_SCAL] = {static_cast<float>(s), static_cast<float>(ss), gmin, gmax,
                                   static_cast<float>(bad), static_cast<float>(nan),
                                   static_cast<float>(R), static_cast<float>(C), stamp};
    std::memcpy(e, scal, sizeof scal);
    if (C > 1 && C <= cap) {
        std::memcpy(e + QF_N_SCAL, lo.data(), static_cast<size_t>(C) * sizeof(float));
        std::memcpy(e + QF_N_SCAL + cap, hi.data(), static_cast<size_t>(C) * sizeof(float));
    }
    if (tok > 0 && per_token && R > 0) {
        const int64_t k = std::min(R, tok);
        for (int64_t r = 0; r < k; r++) {
            const float* p = a + r * C;
            float m = 0.f;
            bool has_nan = false;
            for (int64_t c = 0; c < C; c++) {
                if (std::isnan(p[c])) has_nan = true;
                else m = std::max(m, std::fabs(p[c]));
            }
            t[r * ts] = has_nan ? NAN : (C ? m : -INFINITY);
        }
    }
    return {bad, nan};
}

// The snapshot of one call: its input's rows, its output's, then the header.
void take_snapshot(float* s, int64_t capacity, int64_t n, const at::Tensor& out, int64_t e_out,
                   const at::Tensor* inp, int64_t e_in) {
    at::Tensor o2 = as_rows_f32(out);
    at::Tensor i2 = inp ? as_rows_f32(*inp) : at::Tensor();
    const int64_t n_in = inp ? i2.numel() : 0, n_out = o2.numel();
    const int64_t k_in = std::min(n_in, std::max(capacity / 2, capacity - n_out));
    const int64_t k_out = std::min(n_out, capacity - k_in);
    float* body = s + QF_SNAP_HEADER;
    if (k_in) std::memcpy(body, i2.const_data_ptr<float>(), k_in * sizeof(float));
    if (k_out) std::memcpy(body + k_in, o2.const_data_ptr<float>(), k_out * sizeof(float));
    s[QF_SNAP_STEP] = static_cast<float>(pos_mod(n, QF_STAMP_MOD));
    s[QF_SNAP_OUT_ENTRY] = static_cast<float>(e_out);
    s[QF_SNAP_IN_ENTRY] = static_cast<float>(e_in);
    s[QF_SNAP_IN_ROWS] = inp ? static_cast<float>(i2.size(0)) : 0.f;
    s[QF_SNAP_IN_CHANS] = inp ? static_cast<float>(i2.size(1)) : 0.f;
    s[QF_SNAP_OUT_ROWS] = static_cast<float>(o2.size(0));
    s[QF_SNAP_OUT_CHANS] = static_cast<float>(o2.size(1));
    s[QF_SNAP_IN_KEPT] = static_cast<float>(k_in);
    s[QF_SNAP_OUT_KEPT] = static_cast<float>(k_out);
    s[QF_SNAP_TAKEN] = 1.f;
}

// The first outlier's snapshot (statsop `snap`'s second region, `s`): the first candidate
// input of the group (pair[i] = -2 - k, k its call's output) whose finite absmax, read back
// from its ring row, reaches the threshold `thr`; once a run.
void outlier_snapshot(float* s, int64_t capacity, float thr, int64_t n, at::TensorList xs,
                      const float* row, c10::IntArrayRef off, c10::IntArrayRef entry,
                      c10::IntArrayRef pair) {
    if (s[QF_SNAP_TAKEN] != 0.f) return;
    for (size_t i = 0; i < pair.size(); i++) {
        if (pair[i] > -2) continue;
        const float lo = row[off[i] + QF_COL_MIN], hi = row[off[i] + QF_COL_MAX];
        if (std::max(-lo, hi) >= thr) {
            const int64_t k = -2 - pair[i];
            take_snapshot(s, capacity, n, xs[k], entry[k], &xs[i], entry[i]);
            return;
        }
    }
}

struct Scratch {
    std::vector<int64_t> desc, addr, src;
    std::vector<int8_t> done;
    std::vector<float> spill;
    std::vector<std::pair<int64_t, int64_t>> counts;
};

void stats(at::TensorList xs, const at::Tensor& ring, const at::Tensor& toks,
           const at::Tensor& first, const at::Tensor& step, c10::IntArrayRef off,
           c10::IntArrayRef cap, c10::IntArrayRef tok, c10::IntArrayRef entry,
           const at::Tensor& snap, c10::IntArrayRef pair) {
    TORCH_CHECK(ring.scalar_type() == at::kFloat && ring.dim() == 2 && ring.stride(1) == 1,
                "qforensics::stats: the ring must be [R, W] float32 with unit column stride");
    TORCH_CHECK(toks.scalar_type() == at::kFloat && toks.dim() == 3 && toks.is_contiguous(),
                "qforensics::stats: toks must be [S, T, E] float32, contiguous");
    const int64_t m = static_cast<int64_t>(xs.size());
    TORCH_CHECK(static_cast<int64_t>(off.size()) == m && static_cast<int64_t>(cap.size()) == m &&
                static_cast<int64_t>(tok.size()) == m && static_cast<int64_t>(entry.size()) == m &&
                static_cast<int64_t>(pair.size()) == m,
                "qforensics::stats: off, cap, tok, entry and pair need one value per tensor");
    const int64_t n = step.scalar_type() == at::kLong ? *step.const_data_ptr<int64_t>()
                                                      : step.item<int64_t>();
    float* row = ring.data_ptr<float>() + pos_mod(n, ring.size(0)) * ring.stride(0);
    const float stamp = static_cast<float>(pos_mod(n, QF_STAMP_MOD));
    const int64_t ts = toks.size(2), trows = toks.size(1);
    float* tslot = toks.data_ptr<float>() + pos_mod(n, toks.size(0)) * toks.stride(0);
    // an entry's token maxima: its column of the slot, at most T rows; none past E columns
    auto tok_of = [&](int64_t i) {
        return entry[i] >= 0 && entry[i] < ts ? std::min<int64_t>(tok[i], trows) : 0;
    };
    thread_local Scratch sc;
    sc.desc.assign(static_cast<size_t>(m) * GROUP_DESC, 0);
    sc.addr.assign(static_cast<size_t>(m), 0);
    sc.src.assign(static_cast<size_t>(m), -1);
    sc.done.assign(static_cast<size_t>(m), 0);
    int64_t spill = 1;
    for (int64_t i = 0; i < m; i++) {
        const at::Tensor& x = xs[i];
        int64_t* d = sc.desc.data() + GROUP_DESC * i;
        for (int64_t j = 0; j < i; j++) {
            if (sc.src[j] < 0 && cap[j] == cap[i] && tok[j] == tok[i] && same_values(xs[j], x)) {
                sc.src[i] = j;
                break;
            }
        }
        if (sc.src[i] >= 0) {
            const int64_t j = sc.src[i];
            const int64_t chans = x.dim() >= 2 ? x.size(-1) : 1;
            const int64_t rows = chans ? x.numel() / chans : 0;
            const int64_t kk = x.dim() >= 2 ? std::min(tok_of(i), tok_of(j)) : 0;
            // a repeat: its rows, and the column it copies its token maxima from in C's place
            const int64_t w[GROUP_DESC] = {entry[i], 0, rows, entry[j], off[i], cap[i], kk,
                                           off[j], entry_width(cap[i]), 0};
            std::memcpy(d, w, sizeof w);
            continue;
        }
        const int code = group_code(x.scalar_type());
        const int64_t dim = x.dim();
        const int64_t chans = dim >= 2 ? x.size(-1) : 1;
        int64_t pitch = -1;
        if (code >= 0) {
            if (x.is_contiguous()) pitch = chans;
            else if (dim == 2 && x.stride(1) == 1 && x.stride(0) >= chans) pitch = x.stride(0);
        }
        if (pitch < 0 || chans <= 0) {  // not for C: done stays 0, redone below
            const int64_t w[GROUP_DESC] = {entry[i], -1, 0, 0, off[i], cap[i], 0, -1, 0, 0};
            std::memcpy(d, w, sizeof w);
            continue;
        }
        const int64_t rows = x.numel() / chans;
        const int64_t kk = dim >= 2 ? tok_of(i) : 0;
        if (kk > 0) spill = std::max(spill, rows);  // C writes every row's maximum there
        const int64_t w[GROUP_DESC] = {entry[i], code, rows, chans, off[i], cap[i], kk, -1, 0,
                                       pitch};
        std::memcpy(d, w, sizeof w);
        sc.addr[i] = reinterpret_cast<int64_t>(x.data_ptr());
    }
    if (static_cast<int64_t>(sc.spill.size()) < spill) sc.spill.resize(static_cast<size_t>(spill));
    const int left = qf_group(m, sc.desc.data(), sc.addr.data(), row, tslot, ts, stamp,
                              sc.spill.data(), static_cast<int64_t>(sc.spill.size()),
                              sc.done.data());
    float* s = snap.data_ptr<float>();
    const int64_t half = snap.numel() / 2, cap_snap = half - QF_SNAP_HEADER;
    if (!left) {  // every tensor finite: no first-failure word, no such snapshot to consider
        outlier_snapshot(s + half, cap_snap, s[QF_SNAP_THR], n, xs, row, off, entry, pair);
        return;
    }
    sc.counts.assign(static_cast<size_t>(m), {0, 0});
    // redone below: what C left, but for repeats (copied from their first after it)
    auto redone = [&](int64_t j) { return !sc.done[j] && sc.src[j] < 0; };
    for (int64_t i = 0; i < m; i++) {
        if (!redone(i)) continue;
        const at::Tensor& x = xs[i];
        const int64_t chans = x.dim() >= 2 ? x.size(-1) : 1;
        if (chans == 0) {  // no channels: nothing to read, the figures of no value
            sc.counts[i] = exact_rows(nullptr, 0, 0, row + off[i], cap[i], tslot, ts, 0, false,
                                      stamp);
        } else {
            at::Tensor a = as_rows_f32(x.detach());
            sc.counts[i] = exact_rows(a.const_data_ptr<float>(), a.size(0), a.size(1),
                                      row + off[i], cap[i], tslot + entry[i], ts, tok_of(i),
                                      x.dim() >= 2, stamp);
        }
    }
    for (int64_t i = 0; i < m; i++) {
        const int64_t j = sc.src[i];
        if (j >= 0 && redone(j)) {
            std::memmove(row + off[i], row + off[j],
                         static_cast<size_t>(entry_width(cap[i])) * sizeof(float));
            const int64_t* d = sc.desc.data() + GROUP_DESC * i;
            for (int64_t r = 0; r < std::min(d[2], d[6]); r++)
                tslot[r * ts + entry[i]] = tslot[r * ts + entry[j]];
            sc.counts[i] = sc.counts[j];
        }
    }
    outlier_snapshot(s + half, cap_snap, s[QF_SNAP_THR], n, xs, row, off, entry, pair);
    int64_t best = kNoFirst, keep = -1;
    for (int64_t i = 0; i < m; i++) {
        if (!sc.counts[i].first) continue;
        const int64_t key = (n << (QF_ENTRY_BITS + 1)) | (entry[i] << 1) |
                            (sc.counts[i].second ? 1 : 0);
        best = std::min(best, key);
        if (keep < 0 && pair[i] >= 0) keep = i;
    }
    if (best != kNoFirst) {
        int64_t* f = first.data_ptr<int64_t>();
        f[0] = std::min(f[0], best);
    }
    if (keep >= 0 && s[QF_SNAP_TAKEN] == 0.f) {
        const int64_t j = pair[keep];
        take_snapshot(s, cap_snap, n, xs[keep], entry[keep],
                      j != keep ? &xs[j] : nullptr, j != keep ? entry[j] : -1);
    }
}

}  // namespace

TORCH_LIBRARY_IMPL(qforensics, CPU, m) { m.impl("stats", &stats); }
