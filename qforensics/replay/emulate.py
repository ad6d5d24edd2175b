"""Bounds-checked CPU emulation of the project kernel's index arithmetic (no GPU needed).

Mirrors kernels/awq_gemm.cu expression by expression, vectorized with numpy over blocks x
k-tiles x threads. Offsets are computed exactly in int64 and then wrapped to int32 the way the
unchecked build does, so an M*N >= 2^31 launch is analysed without allocating anything of that
size. Each faulty access becomes an `AccessRecord` shaped like the sanitizer parser's.

Grids above `max_blocks` are sampled: the corner blocks of each grid dimension plus the blocks
where an int32 offset crosses 2^31 or 2^32. Every offset is affine and non-decreasing in the block
index, so an out-of-bounds access exists iff one exists in a corner or crossing block; counts are
then those of the sampled blocks (`sampled` is set and the analytic overflow count is reported).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from qforensics.errors import ReplayError
from qforensics.layouts.bits import AWQ_REVERSE as REVERSE
from qforensics.replay.records import AccessRecord

TILE_M, TILE_N, TILE_K, THREADS = 8, 64, 32, 256
KERNEL_SOURCE = Path(__file__).parent / "kernels" / "awq_gemm.cu"
INT32_MAX = 2**31 - 1
BUFFER_ORDER = ("x", "qweight", "qzeros", "scales", "g_idx", "y")
_ELEM = {"x": 2, "qweight": 4, "qzeros": 4, "scales": 2, "g_idx": 4, "y": 4}

# site name -> (buffer, kind, access bytes, alignment, marker text in awq_gemm.cu)
SITES: dict[str, tuple[str, str, int, int, str]] = {
    "x": ("x", "read", 16, 16, "reinterpret_cast<const uint4*>(X + a_off)"),
    "g_idx": ("g_idx", "read", 4, 4, "const int g = g_idx ? g_idx[k] : k / group_size;"),
    "qweight": ("qweight", "read", 4, 4, "const int qw = qweight[q_off];"),
    "qzeros": ("qzeros", "read", 4, 4, "const int zw = qzeros[z_off];"),
    "scales": ("scales", "read", 4, 4, "reinterpret_cast<const half2*>(scales + s_off)"),
    "y": ("y", "write", 4, 4, "Y[qf_wrap_mad(m, N, na)] = acc0;"),
}
_SITE_ORDER = {"x": 0, "g_idx": 1, "qweight": 2, "qzeros": 3, "scales": 4, "y": 8}


@lru_cache(maxsize=1)
def site_lines() -> dict[str, int]:
    """Line numbers of each access site in the kernel source (for records' source:line)."""
    lines = KERNEL_SOURCE.read_text().splitlines()
    out = {}
    for site, (_b, _k, _s, _a, marker) in SITES.items():
        for i, line in enumerate(lines, 1):
            if marker in line:
                out[site] = i
                break
    return out


def wrap32(v: np.ndarray) -> np.ndarray:
    """Two's-complement int32 wrap of int64 values (what `int` index math does on the GPU)."""
    v = np.asarray(v, dtype=np.int64) & 0xFFFFFFFF
    return np.where(v >= 2**31, v - 2**32, v)


@dataclass
class LaunchGeometry:
    """One launch of the project kernel: shapes, buffer byte sizes and (optionally) g_idx."""

    M: int
    N: int
    K: int
    group_size: int
    n_groups: int
    sizes: dict[str, int]  # bytes per buffer; g_idx absent when the launch has none
    g_idx: np.ndarray | None = None

    @property
    def grid(self) -> tuple[int, int]:
        return math.ceil(self.N / TILE_N), math.ceil(self.M / TILE_M)

    @property
    def k_tiles(self) -> int:
        return math.ceil(self.K / TILE_K)

    @classmethod
    def from_tensors(cls, tensors: dict[str, np.ndarray], group_size: int, m: int | None = None) -> LaunchGeometry:
        """Geometry of launching on these kernel tensors (x [M, K], qweight, qzeros, scales[, g_idx])."""
        x = tensors["x"]
        mm = int(x.shape[0]) if m is None else int(m)
        k = int(x.shape[1])
        n = int(tensors["qweight"].shape[1]) * 8
        sizes = {
            "x": mm * k * 2,
            "qweight": int(tensors["qweight"].size) * 4,
            "qzeros": int(tensors["qzeros"].size) * 4,
            "scales": int(tensors["scales"].size) * 2,
            "y": mm * n * 4,
        }
        g = tensors.get("g_idx")
        if g is not None:
            sizes["g_idx"] = int(g.size) * 4
        return cls(mm, n, k, int(group_size), int(tensors["scales"].shape[0]), sizes,
                   None if g is None else np.asarray(g, dtype=np.int64))

    def bases(self) -> dict[str, int]:
        """Synthetic device addresses, 2 MiB aligned with a 2 MiB gap, in host allocation order."""
        out, addr = {}, 0x7F0000000000
        for name in BUFFER_ORDER:
            if name in self.sizes:
                out[name] = addr
                addr += (self.sizes[name] + 2 * 2**21 - 1) // 2**21 * 2**21
        return out


@dataclass
class EmulationResult:
    build: str
    geometry: dict[str, Any]
    records: list[AccessRecord] = field(default_factory=list)  # first `limit`, in launch order
    total_errors: int = 0
    by_buffer: dict[str, dict[str, Any]] = field(default_factory=dict)
    blocks_evaluated: int = 0
    blocks_total: int = 0
    sampled: bool = False
    preconditions: list[str] = field(default_factory=list)  # checked build: host would refuse
    checked_flags: int = 0  # checked build: k rows whose group index is out of range
    analytic: dict[str, Any] = field(default_factory=dict)
    numerics: dict[str, Any] | None = None
    output: np.ndarray | None = None  # emulated Y [M, N] (float64, NaN where unknown)
    notes: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return (self.total_errors == 0 and not self.preconditions and not self.checked_flags
                and not (self.numerics or {}).get("mismatches"))

    def to_dict(self) -> dict[str, Any]:
        return {
            "build": self.build,
            "geometry": self.geometry,
            "total_errors": self.total_errors,
            "records": [r.to_dict() for r in self.records],
            "by_buffer": self.by_buffer,
            "blocks_evaluated": self.blocks_evaluated,
            "blocks_total": self.blocks_total,
            "sampled": self.sampled,
            "preconditions": list(self.preconditions),
            "checked_flags": self.checked_flags,
            "analytic": self.analytic,
            "numerics": self.numerics,
            "notes": list(self.notes),
        }


# ------------------------------------------------------------------------------------------


def _sample_blocks(geom: LaunchGeometry, max_blocks: int) -> tuple[np.ndarray, np.ndarray, bool]:
    gx, gy = geom.grid
    if gx * gy <= max_blocks:
        by, bx = np.divmod(np.arange(gx * gy, dtype=np.int64), gx)
        return bx, by, False
    xs = {0, 1, gx - 2, gx - 1}
    ys = {0, 1, gy - 2, gy - 1}
    for limit in (2**31, 2**32):
        for stride, rowdim in ((geom.N, "y"), (geom.K, "x")):
            m_c = limit // max(stride, 1)
            if m_c < geom.M:
                ys.update({m_c // TILE_M - 1, m_c // TILE_M, m_c // TILE_M + 1})
                if rowdim == "y":
                    xs.update({(limit % stride) // TILE_N, (limit % stride) // TILE_N + 1})
    xs = sorted(v for v in xs if 0 <= v < gx)
    ys = sorted(v for v in ys if 0 <= v < gy)
    bx, by = np.meshgrid(np.array(xs, np.int64), np.array(ys, np.int64))
    return bx.ravel(), by.ravel(), True


class _Collector:
    def __init__(self, geom: LaunchGeometry, kernel: str, limit: int) -> None:
        self.geom, self.kernel, self.limit = geom, kernel, limit
        self.bases = geom.bases()
        self.lines = site_lines()
        self.total = 0
        self.by_buffer: dict[str, dict[str, Any]] = {}
        self.pending: list[tuple[tuple[int, int, int, int], AccessRecord]] = []

    def add(self, site: str, sub: int, true_off: np.ndarray, active: np.ndarray,
            coords: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]) -> None:
        """true_off: element offsets (int64, before wrapping); coords: block_lin, kt, tid, bx/by packed."""
        buf, kind, size, align, _ = SITES[site]
        elem = _ELEM[buf]
        alloc = self.geom.sizes[buf]
        wrapped = wrap32(true_off)
        byte = wrapped * elem
        mis = (byte % align) != 0
        oob = (byte < 0) | (byte + size > alloc)
        ovf = wrapped != true_off
        bad = active & (mis | oob | ovf)
        n_bad = int(np.count_nonzero(bad))
        if not n_bad:
            return
        self.total += n_bad
        idx = np.nonzero(bad)
        b_byte, b_mis, b_oob, b_ovf = byte[idx], mis[idx], oob[idx], ovf[idx]
        stat = self.by_buffer.setdefault(buf, {"count": 0, "kind": kind, "before": 0, "after": 0,
                                               "inside": 0, "misaligned": 0, "int32_overflow": 0,
                                               "max_distance": 0})
        stat["count"] += n_bad
        before = b_oob & (b_byte < 0)
        after = b_oob & (b_byte >= alloc)
        inside = b_oob & ~before & ~after
        stat["before"] += int(before.sum())
        stat["after"] += int(after.sum())
        stat["inside"] += int(inside.sum())
        stat["misaligned"] += int(b_mis.sum())
        stat["int32_overflow"] += int(b_ovf.sum())
        dist = np.where(before, -b_byte, np.where(after, b_byte - (alloc - 1), 0))
        stat["max_distance"] = max(stat["max_distance"], int(dist.max()))
        blin, kt, tid, _ = (np.broadcast_to(c, bad.shape)[idx] for c in coords)
        keys = np.lexsort((np.full(len(blin), _SITE_ORDER[site] + sub), tid, kt, blin))[: self.limit]
        gx = self.geom.grid[0]
        for i in keys:
            bl = int(blin[i])
            rel = "before" if before[i] else "after" if after[i] else "inside" if inside[i] else None
            err = "misaligned" if b_mis[i] else "out_of_bounds" if b_oob[i] else "int32_overflow"
            rec = AccessRecord(
                kind=kind, size=size, space="__global__", error=err, function=self.kernel,
                kernel=self.kernel, source=KERNEL_SOURCE.name, line=self.lines.get(site),
                thread=(int(tid[i]), 0, 0), block=(bl % gx, bl // gx, 0),
                address=self.bases[buf] + int(b_byte[i]), relation=rel,
                distance=int(dist[i]) if rel else None, alloc_address=self.bases[buf],
                alloc_size=alloc, buffer=buf, origin="emulation", overflow=bool(b_ovf[i]),
                message=f"Invalid __global__ {kind} of size {size} bytes (emulated, k-tile {int(kt[i])})",
            )
            self.pending.append(((bl, int(kt[i]), int(tid[i]), _SITE_ORDER[site] + sub), rec))
        self.pending.sort(key=lambda p: p[0])
        del self.pending[self.limit:]


def _group_of(geom: LaunchGeometry, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(g, known) for k-row indices as the unchecked kernel computes them."""
    if geom.g_idx is None:
        return k // geom.group_size, np.ones(k.shape, bool)
    n = len(geom.g_idx)
    known = (k >= 0) & (k < n) if "g_idx" not in geom.sizes else (k >= 0) & (k * 4 + 4 <= geom.sizes["g_idx"])
    known &= k < n
    g = np.where(known, geom.g_idx[np.clip(k, 0, max(n - 1, 0))] if n else 0, 0)
    return g.astype(np.int64), known


def emulate_launch(
    geom: LaunchGeometry,
    *,
    checked: bool = False,
    data: dict[str, np.ndarray] | None = None,
    reference: np.ndarray | None = None,
    limit: int = 100,
    max_blocks: int = 4096,
) -> EmulationResult:
    """Emulate one launch; with `data` (kernel tensors) also the output, compared to `reference`."""
    if min(geom.M, geom.N, geom.K) <= 0 or geom.group_size <= 0:
        raise ReplayError(f"bad launch shape M={geom.M} N={geom.N} K={geom.K} group_size={geom.group_size}")
    kernel = "qf_awq_gemm_checked" if checked else "qf_awq_gemm_unchecked"
    gx, gy = geom.grid
    res = EmulationResult(
        build="checked" if checked else "unchecked",
        geometry={"M": geom.M, "N": geom.N, "K": geom.K, "group_size": geom.group_size,
                  "n_groups": geom.n_groups, "grid": [gx, gy, 1], "block": [THREADS, 1, 1],
                  "sizes": dict(geom.sizes), "g_idx": geom.g_idx is not None, "kernel": kernel},
        blocks_total=gx * gy,
    )
    if geom.M * geom.N > INT32_MAX:
        res.analytic["y_int32_overflow_outputs"] = geom.M * geom.N - 2**31
        first = 2**31
        res.analytic["y_first_overflow"] = {"m": first // geom.N, "n": first % geom.N}
    if geom.M * geom.K > INT32_MAX:
        res.analytic["x_int32_overflow_first_row"] = 2**31 // geom.K
    if checked:
        _emulate_checked(geom, res)
    else:
        _emulate_unchecked(geom, res, kernel, limit, max_blocks)
    if data is not None:
        if res.sampled or geom.M * geom.N > INT32_MAX:
            res.notes.append("numerics skipped: the launch is too large to emulate element by element")
        else:
            res.output, res.numerics = _emulate_numerics(geom, data, reference, checked)
    return res


def _emulate_checked(geom: LaunchGeometry, res: EmulationResult) -> None:
    M, N, K, G = geom.M, geom.N, geom.K, geom.n_groups
    want = {"x": M * K * 2, "qweight": K * (N // 8) * 4, "qzeros": G * (N // 8) * 4,
            "scales": G * N * 2, "y": M * N * 4}
    if geom.g_idx is not None:
        want["g_idx"] = K * 4
    for name, nbytes in want.items():
        if geom.sizes.get(name) != nbytes:
            res.preconditions.append(f"{name} is {geom.sizes.get(name)} bytes; M={M} N={N} K={K} n_groups={G} need {nbytes}")
    if N % 8:
        res.preconditions.append(f"N={N} is not a multiple of 8")
    k = np.arange(K, dtype=np.int64)
    g, known = _group_of(geom, k)
    res.checked_flags = int(np.count_nonzero(known & ((g < 0) | (g >= G))))
    res.blocks_evaluated = res.blocks_total


def _emulate_unchecked(geom: LaunchGeometry, res: EmulationResult, kernel: str, limit: int,
                       max_blocks: int) -> None:
    M, N, K = geom.M, geom.N, geom.K
    gx, _gy = geom.grid
    bx_all, by_all, sampled = _sample_blocks(geom, max_blocks)
    res.sampled, res.blocks_evaluated = sampled, len(bx_all)
    col = _Collector(geom, kernel, limit)
    wpr = N // 8
    KT = geom.k_tiles
    tid = np.arange(THREADS, dtype=np.int64)
    k0 = np.arange(KT, dtype=np.int64)[:, None] * TILE_K  # [KT, 1]
    k = k0 + tid[None, :] // 8  # [KT, T]: B-tile row of each thread
    g, g_known = _group_of(geom, k)
    chunk = max(1, (1 << 22) // (KT * THREADS))
    for s in range(0, len(bx_all), chunk):
        bx = bx_all[s:s + chunk][:, None, None]
        by = by_all[s:s + chunk][:, None, None]
        blin = by * gx + bx
        n0, m0 = bx * TILE_N, by * TILE_M
        ktile = np.arange(KT, dtype=np.int64)[None, :, None]
        t3 = tid[None, None, :]
        coords = (blin, ktile, t3, blin)
        # A tile: threads 0..31, 16-byte vector loads
        a_active = np.broadcast_to(t3 < 32, (1, 1, THREADS))
        a_off = (m0 + t3 // 4) * K + k0[None, :, :] + (t3 % 4) * 8
        col.add("x", 0, a_off, a_active, coords)
        if geom.g_idx is not None:
            col.add("g_idx", 0, np.broadcast_to(k[None], (blin.shape[0], KT, THREADS)),
                    np.ones((1, KT, THREADS), bool), coords)
        wcol = n0 // 8 + t3 % 8
        col.add("qweight", 0, k[None] * wpr + wcol, np.ones((1, 1, THREADS), bool), coords)
        known = g_known[None]
        col.add("qzeros", 0, g[None] * wpr + wcol, known, coords)
        for p in range(4):
            col.add("scales", p, g[None] * N + wcol * 8 + 2 * p, known, coords)
        # epilogue: guarded stores, int32 offsets
        m = m0 + t3 // 32
        for sub, dn in enumerate((0, 32)):
            n = n0 + t3 % 32 + dn
            col.add("y", sub, m * N + n, (m < M) & (n < N),
                    (blin, np.full((1, 1, 1), KT, np.int64), t3, blin))
    if g_known.size and not g_known.all():
        res.notes.append("g_idx read past its end for some k: the group index there is garbage; "
                         "qzeros/scales reads for those k are not checked")
    res.records = [r for _key, r in col.pending]
    res.total_errors = col.total
    res.by_buffer = col.by_buffer


def _emulate_numerics(geom: LaunchGeometry, data: dict[str, np.ndarray], reference: np.ndarray | None,
                      checked: bool) -> tuple[np.ndarray, dict[str, Any]]:
    M, N, K = geom.M, geom.N, geom.K
    gx, gy = geom.grid
    Mp, Kp, Wp = gy * TILE_M, geom.k_tiles * TILE_K, gx * 8
    xf = np.asarray(data["x"], np.float16).astype(np.float64).ravel()
    qf = np.asarray(data["qweight"]).astype(np.int64).ravel() & 0xFFFFFFFF
    zf = np.asarray(data["qzeros"]).astype(np.int64).ravel() & 0xFFFFFFFF
    sf = np.asarray(data["scales"], np.float16).astype(np.float64).ravel()
    m = np.arange(Mp, dtype=np.int64)[:, None]
    k = np.arange(Kp, dtype=np.int64)[None, :]
    if checked:
        a_ok = (m < M) & (k < K)
        a = np.where(a_ok, xf[np.clip(m * K + k, 0, max(len(xf) - 1, 0))] if len(xf) else 0.0, 0.0)
        a_unk = np.zeros(a.shape, bool)
    else:
        base = wrap32(m * K + (k // 8) * 8)
        a_ok = (base >= 0) & (base * 2 + 16 <= len(xf) * 2) & (base % 8 == 0)
        a = np.where(a_ok, xf[np.clip(base + k % 8, 0, max(len(xf) - 1, 0))] if len(xf) else 0.0, 0.0)
        a_unk = ~a_ok
    kk = np.arange(Kp, dtype=np.int64)[:, None]
    wcol = np.arange(Wp, dtype=np.int64)[None, :]
    g, g_known = _group_of(geom, kk)
    wpr = N // 8
    w = np.zeros((Kp, Wp * 8))
    w_unk = np.zeros((Kp, Wp * 8), bool)
    if checked:
        ok = (kk < K) & (wcol < wpr) & g_known & (g >= 0) & (g < geom.n_groups)
        q_off, z_off = kk * wpr + wcol, g * wpr + wcol
        s_base = g * N + wcol * 8
        q_ok = z_ok = ok
        s_ok = [ok] * 4
    else:
        q_off, z_off = wrap32(kk * wpr + wcol), wrap32(g * wpr + wcol)
        q_ok = (q_off >= 0) & (q_off < len(qf))
        z_ok = g_known & (z_off >= 0) & (z_off < len(zf))
        s_base = g * N + wcol * 8
        s_ok = []
        for p in range(4):
            so = wrap32(s_base + 2 * p)
            s_ok.append(g_known & (so >= 0) & (so + 2 <= len(sf)))
    qw = np.where(q_ok, qf[np.clip(q_off, 0, max(len(qf) - 1, 0))] if len(qf) else 0, 0)
    zw = np.where(z_ok, zf[np.clip(z_off, 0, max(len(zf) - 1, 0))] if len(zf) else 0, 0)
    for j in range(8):
        p = j // 2
        s_off = wrap32(s_base + 2 * p) + (j % 2) if not checked else s_base + j
        s = np.where(s_ok[p], sf[np.clip(s_off, 0, max(len(sf) - 1, 0))] if len(sf) else 0.0, 0.0)
        q = (qw >> (4 * int(REVERSE[j]))) & 0xF
        z = (zw >> (4 * int(REVERSE[j]))) & 0xF
        val = (q - z).astype(np.float64) * s
        if checked:
            w[:, j::8] = np.where(ok, val, 0.0)
        else:
            w[:, j::8] = val
            w_unk[:, j::8] = ~(q_ok & z_ok & s_ok[p])
    with np.errstate(invalid="ignore", over="ignore"):
        y = a @ w
        mag = np.abs(a) @ np.abs(w)
    y = y[:M, :N]
    mag = mag[:M, :N]
    unknown = (a_unk.any(axis=1)[:M, None]) | (w_unk.any(axis=0)[None, :N])
    y = np.where(unknown, np.nan, y)
    out: dict[str, Any] = {"unknown": int(unknown.sum()), "compared": 0, "mismatches": 0,
                           "max_abs_err": None, "first_mismatch": None, "reference": reference is not None}
    if reference is not None and reference.shape == (M, N):
        known = ~unknown
        with np.errstate(invalid="ignore"):
            close = np.isclose(y, reference, rtol=1e-9, atol=1e-9 * (mag + 1e-12), equal_nan=True)
        bad = known & ~close
        out["compared"] = int(known.sum())
        out["mismatches"] = int(bad.sum())
        finite = known & np.isfinite(y) & np.isfinite(reference)
        out["max_abs_err"] = float(np.max(np.abs(y - reference)[finite])) if finite.any() else None
        if bad.any():
            i, j = np.argwhere(bad)[0]
            out["first_mismatch"] = {"m": int(i), "n": int(j), "emulated": float(y[i, j]),
                                     "reference": float(reference[i, j])}
    return y, out
