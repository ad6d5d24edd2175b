"""The one stats op: the statistics of a group of tensors in one call, written into a device
ring.

`torch.ops.qforensics.stats(xs, ring, toks, first, step, off, cap, tok, entry, snap, pair)`
reduces each tensor of `xs` (viewed as [rows, channels], channels the last dim; a 0/1-d tensor
is [n, 1]) and writes its entry's part of the ring slot `step % R` (`ring`: [R, W] float32), at
`off[i]`, laid out as `ENTRY_COLS` says:

    [ sum, sum of squares, min, max, non-finite, nan, rows, channels, stamp | channel minima
      (cap) | channel maxima (cap) ]

and its token maxima into `toks` ([S, T, E] float32), token-major: row r of tensor i at
`toks[step % S, r, entry[i]]` (S may be fewer slots than the ring's: a GPU copies a step's
token rows to the host as soon as the step ends). A decode step's maxima are then one short
run of the slot (every entry's row 0 side by side), not one page per entry, and a GPU copies
to the host only the rows the step has (graphstats.start_copy).

- sums, min and max are over the finite values only (min +inf / max -inf when there is none);
  `stamp` is `step mod 2**24`, so the host tells a row written at this step from a stale one;
- the channel ranges are written when `1 < channels <= cap` (finite values only; +inf/-inf for
  a channel without one), the token maxima when `tok > 0` and x has >= 2 dims, for its first
  `min(rows, tok, T)` rows (NaN for a row that holds a NaN, else inf for one that holds an
  inf);
- `first` ([1] int64) keeps the least `first_key(step, entry, nan)` of the calls that saw a
  non-finite value: the earliest step, then the entry placed first (entries are placed in
  call order), whichever order the tensors are reduced in;
- `snap` ([SNAP_HEADER + capacity] float32) keeps the first failing output's call once a run:
  the first tensor i of the first call, in group order, that holds a non-finite value and is a
  candidate (`pair[i] >= 0`: an output; `pair[i]` is the index of its module's `input.0` in the
  group, or i itself when the group has none), while the header's `taken` is 0. Its input's
  rows then its own (float32, flattened, split by `snap_split`), the header (`SNAP_COLS`) and
  `taken` = 1. What `qforensics replay` starts from in compiled mode (hooks/graphsnap.py).
  `snap` holds two such regions of equal size (`new_snap`, `snap_region`): the first failing
  output's call in the first, in the second the first call whose input reaches the outlier
  threshold (`thr` in the first region's header; inf: never): a candidate input has
  `pair[i] = -2 - k`, k the index of its call's output in the group (a GEMM's float input.0;
  -1: not a candidate), and the first of them, in group order, whose finite absmax is at least
  the threshold keeps its rows and its output's the same way, while the second region's
  `taken` is 0.

Why one op for a group: the capture's hooks queue their tensors and the decoder layer's hook
(or a module outside any layer) hands them over at once (hooks/graphhooks.py), so Inductor sees
one opaque call per layer instead of ~10 fused reductions per tensor, its mutations declared
(`ring`, `toks`, `first`, `snap`), so the graph writes them in place; the ring is a static
buffer that CUDA graph replays keep writing. `step` is a device counter the host advances
before each step (no sync). The CUDA kernel is Triton (hooks/statstriton.py: one program per
tensor, one pass over it, the group's tensors gathered into one buffer: two launches a call);
the CPU kernel is C++ behind the dispatcher (hooks/statsop_cpu.cpp, built by
hooks/statsnative.py: the whole group in one call of hooks/fused_reduce.c's `qf_group`, an
exact pass for what C does not finish, a tensor that several entries share reduced once), or
where that is not built the same in Python (hooks/statscpu.py). All write the same layout (tests/hooks/test_statsop.py
checks each against numpy, the Triton kernel through Triton's interpreter).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor

log = logging.getLogger("qforensics.hooks.capture")

# The record layout of one entry's ring row: defined here and nowhere else.
ENTRY_COLS = ("sum", "sumsq", "min", "max", "nonfinite", "nan", "rows", "channels", "stamp")
N_SCAL = len(ENTRY_COLS)
COL = {name: i for i, name in enumerate(ENTRY_COLS)}
STAMP_MOD = 1 << 24  # float32 holds every integer below this exactly
NO_FIRST = (1 << 63) - 1  # the first-failure word before any failure
# The snapshot buffer's header (float32, every value exact below 2**24), then its floats:
# the kept input's, then the output's
SNAP_COLS = ("taken", "step", "out_entry", "in_entry", "in_rows", "in_chans", "out_rows",
             "out_chans", "in_kept", "out_kept")
SNAP = {name: i for i, name in enumerate(SNAP_COLS)}
SNAP_HEADER = 16
SNAP["thr"] = SNAP_HEADER - 1  # the first region's header: the outlier threshold
_ENTRY_BITS = 32


def entry_width(cap: int) -> int:
    """Floats one entry takes in a ring row: scalars, channel minima and maxima (its token
    maxima are a column of `toks`)."""
    return N_SCAL + 2 * cap


def chan_span(off: int, cap: int) -> tuple[int, int]:
    """Where an entry's channel minima and maxima start in its ring row."""
    return off + N_SCAL, off + N_SCAL + cap


def _as_rows(x: Tensor) -> Tensor:
    x = x.detach()
    return x.reshape(-1, x.shape[-1]) if x.dim() >= 2 else x.reshape(-1, 1)


def _same_memory(x: Tensor) -> tuple:
    """What makes two tensors of one call the same values: memory, dtype, shape, strides."""
    return (x.data_ptr(), x.dtype, tuple(x.shape), tuple(x.stride()))


def new_toks(slots: int, rows: int, entries: int, device: torch.device) -> Tensor:
    """The token maxima's ring: [slots, rows, entries] float32. Empty, not zeros: the host
    reads only the rows an entry wrote in the step its stamp names, and on the CPU the pages
    no step reaches are never touched."""
    return torch.empty(max(1, int(slots)), max(1, int(rows)), max(1, int(entries)),
                       dtype=torch.float32, device=device)


def new_first(device: torch.device) -> Tensor:
    return torch.full((1,), NO_FIRST, dtype=torch.int64, device=device)


def snap_split(n_in: int, n_out: int, capacity: int) -> tuple[int, int]:
    """Floats of the input and of the output a snapshot keeps: each at least half the capacity
    when the other needs more (the Triton kernel computes the same)."""
    k_in = min(n_in, max(capacity // 2, capacity - n_out))
    return k_in, min(n_out, capacity - k_in)


def first_key(step: int, entry: int, nan: bool) -> int:
    """The first-failure word of one call: ordered by step, then by entry."""
    return (int(step) << (_ENTRY_BITS + 1)) | (int(entry) << 1) | int(bool(nan))


def decode_first(key: int) -> tuple[int, int, int] | None:
    """(step, entry, 1 if NaN else 0) of a first-failure word; None: no failure."""
    key = int(key)
    if key == NO_FIRST or key < 0:
        return None
    return key >> (_ENTRY_BITS + 1), (key >> 1) & ((1 << _ENTRY_BITS) - 1), key & 1


# -- the op ----------------------------------------------------------------------------------

SCHEMA = ("stats(Tensor[] xs, Tensor(a!) ring, Tensor(b!) toks, Tensor(c!) first, Tensor step, "
          "int[] off, int[] cap, int[] tok, int[] entry, Tensor(d!) snap, int[] pair) -> ()")


def new_snap(device: torch.device, capacity: int, threshold: float = float("inf")) -> Tensor:
    """A snapshot buffer: two regions of `capacity` floats each (`snap_region`), the first
    failing output's call and the first outlier's; a region that cannot keep anything (no
    capacity; no threshold for the second) is `taken` from the start."""
    cap = max(0, int(capacity))
    s = torch.zeros(2 * (SNAP_HEADER + cap), dtype=torch.float32, device=device)
    s[SNAP["thr"]] = float(threshold)
    if cap <= 0:
        s[SNAP["taken"]] = 1.0
    if cap <= 0 or not threshold < float("inf"):
        s[SNAP_HEADER + cap + SNAP["taken"]] = 1.0
    return s


def snap_region(numel: int, which: int) -> tuple[int, int]:
    """(start, body capacity) of region `which` (0: the first failing output's; 1: the first
    outlier's) of a snapshot buffer of `numel` floats."""
    half = int(numel) // 2
    return which * half, half - SNAP_HEADER


def _define() -> Any:
    """The op through torch.library's low-level registration: one Python kernel per device
    behind the dispatcher (custom_op's autograd and defaults wrappers cost ~60 us a call)."""
    lib = torch.library.Library("qforensics", "FRAGMENT")
    lib.define(SCHEMA)

    @torch.library.register_fake("qforensics::stats", lib=lib)
    def _fake(xs, ring, toks, first, step, off, cap, tok, entry, snap,  # noqa: ANN001, ANN202
              pair):
        return None

    _LIBS.append(lib)  # a Library unregisters its ops when collected


_LIBS: list[Any] = []


def register_kernel(kernel: Any, key: str) -> None:
    """The op's kernel for one dispatch key: hooks/statscpu.py registers the CPU one when it is
    imported (hooks/graphstats.py imports it, as does whoever calls the op on the CPU without
    it), hooks/statstriton.py its Triton launcher for CUDA; both import this module's layout,
    which never imports them: no import circle."""
    _get()
    if _LIBS:
        _LIBS[0].impl("stats", kernel, key)


def _get() -> Any:
    try:
        return torch.ops.qforensics.stats
    except (AttributeError, RuntimeError):
        _define()
        return torch.ops.qforensics.stats


stats = _get()
