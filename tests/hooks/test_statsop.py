"""The one stats op (qforensics/hooks/statsop.py): its CPU kernel and its Triton kernel (run by
Triton's interpreter on this CPU, in a child process that sets TRITON_INTERPRET=1 before Triton
loads) against numpy, on tensors with NaN, inf, ragged tiles and several dtypes."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from qforensics.hooks import statscpu, statsop

CAP, TOK = 700, 40
ENTRIES = 32  # the token ring's columns in these tests (entries 0..31)


def _toks(ring: torch.Tensor, rows: int = TOK) -> torch.Tensor:
    """A token ring beside `ring` (its slots), zeroed so that a stray write shows."""
    return torch.zeros(ring.shape[0], rows, ENTRIES)


@pytest.fixture(params=["c++", "python"])
def kernel(request):  # noqa: ANN001, ANN201
    """The op's CPU kernels: the C++ one behind the dispatcher (hooks/statsop_cpu.cpp, what
    runs wherever it is built; the install builds it) and the Python one (hooks/statscpu.py,
    what runs where it is not)."""
    if request.param == "c++":
        from qforensics.hooks import statsnative

        assert statsnative.KERNEL["kernel"] == "c++", statsnative.KERNEL["why"]
        return torch.ops.qforensics.stats
    return statscpu.stats_cpu


def _cases() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    big = torch.randn(37, 650, generator=g) * 3  # several row and channel tiles
    bad = big.clone()
    bad[3, 10] = float("nan")
    bad[5, 11] = float("inf")
    bad[5, 12] = float("-inf")
    bad[:, 600] = float("nan")  # a channel with no finite value
    wide = torch.randn(2, 3, 900, generator=g)  # wider than CAP: scalars and tokens only
    return [
        ("decode-bf16", torch.randn(1, 576, generator=g).to(torch.bfloat16)),
        ("big-f32", big),
        ("bad-f32", bad),
        ("bad-bf16", bad.to(torch.bfloat16)),
        ("3d-f16", torch.randn(2, 3, 64, generator=g).to(torch.float16)),
        ("wide", wide),
        ("vector", torch.randn(33, generator=g)),
        ("ids-int64", torch.randint(0, 49152, (1, 9), generator=g)),
        ("positions-int32", torch.arange(100, 106, dtype=torch.int32)),  # vLLM's layer input
        # an FP8 model's quantized activations: neither C's dtypes nor Triton's, read as float32
        ("fp8-e4m3", (torch.randn(3, 40, generator=g) * 100).to(torch.float8_e4m3fn)),
        # columns cut from a wider tensor (q out of a fused qkv projection): a row stride > C
        ("slice-bf16", torch.randn(5, 960, generator=g).to(torch.bfloat16)[:, 576:768]),
        ("slice-f32", torch.randn(7, 960, generator=g)[:, 100:676]),
        ("all-nan", torch.full((4, 8), float("nan"))),
    ]


def _reference(x: torch.Tensor, step: int) -> dict[str, np.ndarray]:
    """Independent of the op: float64 numpy over the finite values."""
    a = x.detach().double().numpy()
    a = a.reshape(-1, a.shape[-1]) if a.ndim >= 2 else a.reshape(-1, 1)
    fin = np.isfinite(a)
    z = np.where(fin, a, 0.0)
    lo = np.where(fin, a, np.inf).min(axis=0)
    hi = np.where(fin, a, -np.inf).max(axis=0)
    scal = np.array([z.sum(), (z * z).sum(), lo.min(), hi.max(), (~fin).sum(),
                     np.isnan(a).sum(), a.shape[0], a.shape[1], step % statsop.STAMP_MOD])
    with np.errstate(invalid="ignore"):
        tok = np.abs(a).max(axis=1)  # NaN for a row holding one
    return {"scal": scal, "lo": lo, "hi": hi, "tok": tok}


def _snap(capacity: int = 0) -> torch.Tensor:
    return statsop.new_snap(torch.device("cpu"), capacity)


def _run(kernel, x: torch.Tensor, step: int, entry: int):  # noqa: ANN001, ANN202
    ring = torch.zeros(3, 50 + statsop.entry_width(CAP))
    toks = _toks(ring)
    first = statsop.new_first(torch.device("cpu"))
    kernel([x], ring, toks, first, torch.tensor(step), [50], [CAP], [TOK], [entry], _snap(),
           [-1])
    return ring, toks, first


def _group(kernel):  # noqa: ANN001, ANN202
    """Every float case in one call, each at its own offset (one program per tensor)."""
    xs = [x for _, x in _cases() if x.is_floating_point()]
    xs = xs[:3] + [xs[1]] + xs[3:]  # big-f32 twice: one tensor, two entries (q and k)
    w = statsop.entry_width(CAP)
    ring = torch.zeros(2, w * len(xs))
    toks = _toks(ring)
    first = statsop.new_first(torch.device("cpu"))
    n = len(xs)
    kernel(xs, ring, toks, first, torch.tensor(9), [i * w for i in range(n)], [CAP] * n,
           [TOK] * n, list(range(10, 10 + n)), _snap(), [-1] * n)
    return ring, toks, first


def _check(x: torch.Tensor, ring: np.ndarray, toks: np.ndarray, first: np.ndarray, step: int,
           entry: int, tol: float) -> None:
    ref = _reference(x, step)
    slot = step % ring.shape[0]
    row = ring[slot]
    others = [i for i in range(ring.shape[0]) if i != slot]
    assert not ring[others].any() and not toks[others].any()
    got = row[50:50 + statsop.N_SCAL].astype(np.float64)
    np.testing.assert_allclose(got[2:], ref["scal"][2:], rtol=0, atol=0)  # exact figures
    np.testing.assert_allclose(got[:2], ref["scal"][:2], rtol=tol,
                               atol=tol * x.double().abs().nan_to_num(0, 0, 0).sum().item())
    chans = int(ref["scal"][7])
    c0, c1 = statsop.chan_span(50, CAP)
    if 1 < chans <= CAP:
        np.testing.assert_array_equal(row[c0:c0 + chans], ref["lo"].astype(np.float32))
        np.testing.assert_array_equal(row[c1:c1 + chans], ref["hi"].astype(np.float32))
    else:
        assert not row[c0:c0 + 2 * CAP].any()  # nothing written
    assert not row[c1 + CAP:].any()
    # token maxima: the entry's column of the slot, token-major; no other column written
    k = min(len(ref["tok"]), TOK) if x.dim() >= 2 else 0
    col = toks[slot, :, entry]
    np.testing.assert_array_equal(col[:k], ref["tok"][:k].astype(np.float32))
    assert not col[k:].any()
    assert not np.delete(toks[slot], entry, axis=1).any()
    bad = ref["scal"][4] > 0
    want = (step, entry, int(ref["scal"][5] > 0)) if bad else None
    assert statsop.decode_first(int(first[0])) == want


@pytest.mark.parametrize("name,x", _cases(), ids=[n for n, _ in _cases()])
def test_cpu_kernel_matches_numpy(name: str, x: torch.Tensor, kernel) -> None:  # noqa: ANN001
    ring, toks, first = _run(kernel, x, 7, 3)
    _check(x, ring.numpy(), toks.numpy(), first.numpy(), 7, 3, 1e-5)


@pytest.mark.parametrize("path", ["group", "numpy"])
@pytest.mark.parametrize("name,x", _cases() + [
    ("more-rows-than-tok", torch.randn(2 * TOK + 3, 64)),
    ("one-row-f32", torch.randn(1, 300))], ids=[n for n, _ in _cases()] + [
    "more-rows-than-tok", "one-row-f32"])
def test_cpu_kernel_matches_numpy_on_each_path(name: str, x: torch.Tensor, path: str,
                                               monkeypatch) -> None:
    """The whole group in one C call (fused_reduce.c's qf_group, the default), or numpy alone:
    the same figures (numpy's float64 reference)."""
    from qforensics.hooks import fused

    assert fused.REDUCER.ready() or (fused.REDUCER.wait() or fused.REDUCER.ready())
    groups: list[int] = []
    real_group = fused.REDUCER.group()
    assert real_group is not None

    def group(m, *a):  # noqa: ANN001, ANN002, ANN202
        groups.append(m)
        return real_group(m, *a)

    monkeypatch.setattr(fused.REDUCER, "group", lambda: group if path == "group" else None)
    numpy_calls: list[int] = []
    real_numpy = statscpu._one_numpy
    monkeypatch.setattr(statscpu, "_one_numpy",
                        lambda *a: (numpy_calls.append(1), real_numpy(*a))[1])
    redos = sum(statscpu.REDOS.values())
    ring, toks, first = _run(statscpu.stats_cpu, x, 7, 3)
    _check(x, ring.numpy(), toks.numpy(), first.numpy(), 7, 3, 1e-5)
    # what C finishes: qf_group a finite float32 or bf16 tensor, or an int64 / int32 one, laid
    # out as rows (contiguous, or a 2-d slice of columns); numpy redoes everything else
    finite = not x.is_floating_point() or bool(torch.isfinite(x.float()).all())
    c_float = x.dtype in (torch.float32, torch.bfloat16)
    rows_layout = x.is_contiguous() or (x.dim() == 2 and x.stride(1) == 1)
    in_c = {"group": finite and rows_layout and (c_float or x.dtype in (torch.int64,
                                                                       torch.int32)),
            "numpy": False}[path]
    assert groups == ([1] if path == "group" else [])
    assert numpy_calls == ([] if in_c else [1])
    # a tensor the group's C pass left to numpy is counted (the trace's status shows it)
    assert sum(statscpu.REDOS.values()) - redos == (path == "group" and not in_c)


def test_the_dispatcher_runs_the_cpp_kernel_without_python(monkeypatch) -> None:  # noqa: ANN001
    """Where the C++ kernel is built (the install builds it) an op call runs no Python: with
    the Python kernel made to fail, a call through the dispatcher still writes its figures; and
    it writes what the Python kernel writes, group for group (every float case in one call, a
    repeated tensor among them)."""
    from qforensics.hooks import statsnative

    assert statsnative.KERNEL["kernel"] == "c++", statsnative.KERNEL["why"]
    py_ring, py_toks, py_first = _group(statscpu.stats_cpu)

    def fail(*a):  # noqa: ANN002, ANN202
        raise AssertionError("the Python kernel ran")

    monkeypatch.setattr(statscpu, "stats_cpu", fail)
    monkeypatch.setattr(statscpu, "_kernel", fail)
    ring, toks, first = _group(torch.ops.qforensics.stats)
    for got, want in ((ring.numpy(), py_ring.numpy()), (toks.numpy(), py_toks.numpy())):
        assert (np.isnan(got) == np.isnan(want)).all()
        fin = np.isfinite(want)
        assert (np.isfinite(got) == fin).all()
        np.testing.assert_allclose(got[fin], want[fin], rtol=1e-6, atol=1e-4)
        np.testing.assert_array_equal(got[~fin], want[~fin])
    assert toks.numpy()[1].any()  # the group's token maxima were written
    assert first.tolist() == py_first.tolist()


@pytest.mark.parametrize("shape", [(0, 8), (2, 0, 8)])
def test_a_tensor_with_no_rows_reads_as_no_finite_value(shape, kernel) -> None:  # noqa: ANN001
    """A tensor with no rows (an engine step that scheduled no token for a layer): sums 0, no
    finite min or max (+inf / -inf), 0 rows, its channels; each channel's range +inf / -inf;
    no token maxima; no failure."""
    w = statsop.entry_width(16)
    ring = torch.zeros(2, w)
    toks = _toks(ring, 4)
    first = statsop.new_first(torch.device("cpu"))
    kernel([torch.randn(shape)], ring, toks, first, torch.tensor(3), [0], [16], [4], [0],
           _snap(), [-1])
    row = ring[1].numpy()
    inf = float("inf")
    assert row[:statsop.N_SCAL].tolist() == [0, 0, inf, -inf, 0, 0, 0, 8, 3]
    c0, c1 = statsop.chan_span(0, 16)
    assert row[c0:c0 + 8].tolist() == [inf] * 8 and row[c1:c1 + 8].tolist() == [-inf] * 8
    assert not row[c1 + 16:].any() and not toks.any()
    assert statsop.decode_first(int(first[0])) is None


def test_first_word_keeps_the_earliest_step_then_the_first_entry(kernel) -> None:  # noqa: ANN001
    w = statsop.entry_width(8)
    ring = torch.zeros(2, w * 3)
    toks = _toks(ring, 4)
    first = statsop.new_first(torch.device("cpu"))
    ones, inf = torch.ones(2, 8), torch.full((2, 8), float("inf"))
    nan = torch.full((2, 8), float("nan"))
    assert statsop.decode_first(int(first[0])) is None
    # one group, handed over out of call order: entry 2 (NaN) before entry 1 (inf)
    kernel([ones, nan, inf], ring, toks, first, torch.tensor(4), [0, 2 * w, w], [8] * 3,
           [4] * 3, [0, 2, 1], _snap(), [-1] * 3)
    assert statsop.decode_first(int(first[0])) == (4, 1, 0)
    # a later step never takes it over, an earlier entry of it neither
    kernel([nan], ring, toks, first, torch.tensor(5), [0], [8], [4], [0], _snap(), [-1])
    assert statsop.decode_first(int(first[0])) == (4, 1, 0)
    assert statsop.decode_first(statsop.first_key(3, 7, True)) == (3, 7, 1)


@pytest.mark.parametrize("nan", [True, False])
def test_a_shared_tensor_is_written_to_each_of_its_entries(nan: bool, kernel) -> None:  # noqa: ANN001
    """q, k and v take one tensor: reduced once on the CPU, each entry's row the same (copied
    by the C group pass, or again after numpy redid a non-finite one); an entry with other
    caps is reduced on its own."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 12, generator=g)
    if nan:
        x[1, 3] = float("nan")
    w = statsop.entry_width(12)
    ring = torch.zeros(2, 3 * w + statsop.entry_width(4))
    toks = _toks(ring, 8)
    first = statsop.new_first(torch.device("cpu"))
    kernel([x, x, x, x], ring, toks, first, torch.tensor(1), [0, w, 2 * w, 3 * w],
           [12, 12, 12, 4], [8, 8, 8, 8], [0, 1, 2, 3], _snap(), [-1] * 4)
    row = ring[1].numpy()
    solo, solo_toks = torch.zeros(2, w), _toks(torch.zeros(2, w), 8)
    kernel([x.clone()], solo, solo_toks, statsop.new_first(torch.device("cpu")),
           torch.tensor(1), [0], [12], [8], [0], _snap(), [-1])
    for k in range(3):
        np.testing.assert_array_equal(row[k * w:(k + 1) * w], solo[1].numpy())
    # every entry's token maxima: its own column, each the lone tensor's (entry 0's)
    for k in range(4):
        np.testing.assert_array_equal(toks[1, :, k].numpy(), solo_toks[1, :, 0].numpy())
    assert toks[1, :5, 0].isnan().any() == nan and not toks[1, :, 4:].any()
    # the entry that keeps no channel ranges (12 channels > cap 4): scalars and tokens only
    tail = row[3 * w:]
    np.testing.assert_array_equal(tail[:statsop.N_SCAL], solo[1].numpy()[:statsop.N_SCAL])
    assert not tail[statsop.N_SCAL:statsop.N_SCAL + 8].any()
    assert statsop.decode_first(int(first[0])) == ((1, 0, 1) if nan else None)


def test_one_call_site_called_again_with_other_buffers() -> None:
    """A call site's description is built once (statscpu._Site) and reused: each later call
    at that site, with new tensors at other addresses (as Inductor allocates its buffers per
    run), another row count, or tensors that share memory where they did not, still writes
    each tensor's own figures, each checked against numpy's float64 reference."""
    from qforensics.hooks import fused

    assert fused.REDUCER.ready() or (fused.REDUCER.wait() or fused.REDUCER.ready())
    sites = len(statscpu._SITES)
    w = statsop.entry_width(CAP)
    off = [50, 50 + w, 50 + 2 * w]
    g = torch.Generator().manual_seed(11)
    ring = torch.zeros(3, 50 + 3 * w)
    toks = _toks(ring)
    calls = []
    a = torch.randn(6, 64, generator=g)
    calls.append([a, torch.randn(6, 64, generator=g), torch.randn(6, 32, generator=g)])
    calls.append([torch.randn(6, 64, generator=g) * 5, torch.randn(6, 64, generator=g),
                  torch.randn(6, 32, generator=g)])  # the same layout, new buffers
    b = torch.randn(6, 64, generator=g)
    calls.append([b, b, torch.randn(6, 32, generator=g)])  # now one buffer, two entries
    calls.append([torch.randn(2, 64, generator=g), torch.randn(2, 64, generator=g),
                  torch.randn(9, 32, generator=g)])  # other row counts
    for step, xs in enumerate(calls):
        ring.zero_()
        toks.zero_()
        first = statsop.new_first(torch.device("cpu"))
        redos = sum(statscpu.REDOS.values())
        statscpu.stats_cpu(xs, ring, toks, first, torch.tensor(step), off, [CAP] * 3,
                           [TOK] * 3, [0, 1, 2], _snap(), [-1] * 3)
        # finite float32 rows: all done by the C pass, none left to numpy to put right
        assert sum(statscpu.REDOS.values()) == redos
        for e, (x, o) in enumerate(zip(xs, off)):  # each entry moved to where _check reads
            one = ring.clone()                     # (offset 50, column 0)
            one[:, 50:50 + w] = ring[:, o:o + w]
            one[:, 50 + w:] = 0
            col = torch.zeros_like(toks)
            col[:, :, 0] = toks[:, :, e]
            _check(x, one.numpy(), col.numpy(), first.numpy(), step, 0, 1e-5)
    # the first two calls share one description; the shared buffer and the rows make two more
    assert len(statscpu._SITES) - sites == 3


def _snap_group(kernel, capacity: int = 4096, order: str = ""):  # noqa: ANN001, ANN202
    """Four modules' inputs and outputs in one group (`pair` as graphhooks builds it): the
    second's, the third's and a fourth's (no input in the group) outputs fail; then a later
    step where all fail. The second's call is kept, once."""
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(5, 6, generator=g), torch.randn(5, 4, generator=g),
          torch.randn(1, 5, 4, generator=g), torch.randn(1, 5, 3, generator=g),
          torch.randn(5, 3, generator=g), torch.randn(5, 2, generator=g),
          torch.randn(2, 7, generator=g)]
    xs[3][0, 2, 1] = float("nan")
    xs[5][4, 0] = float("inf")
    xs[6][1, 1] = float("nan")
    n, w = len(xs), statsop.entry_width(CAP)
    ring, first = torch.zeros(2, w * n), statsop.new_first(torch.device("cpu"))
    toks = _toks(ring)
    snap = statsop.new_snap(torch.device("cpu"), capacity)
    pair = [-1, 0, -1, 2, -1, 4, 6]
    for step, group in ((3, xs), (4, [torch.full_like(x, float("nan")) for x in xs])):
        kernel(group, ring, toks, first, torch.tensor(step), [i * w for i in range(n)],
               [CAP] * n, [TOK] * n, list(range(20, 20 + n)), snap, pair)
    return xs, snap


def _check_snap(xs, snap: np.ndarray, capacity: int) -> None:  # noqa: ANN001
    inp, out = xs[2].reshape(5, 4).numpy(), xs[3].reshape(5, 3).numpy()
    k_in = min(inp.size, max(capacity // 2, capacity - out.size))  # half each when short
    k_out = min(out.size, capacity - k_in)
    assert snap.size == 2 * (statsop.SNAP_HEADER + capacity)  # two regions
    h = snap[:statsop.SNAP_HEADER]
    assert h[:10].tolist() == [1, 3, 23, 22, 5, 4, 5, 3, k_in, k_out]
    body = snap[statsop.SNAP_HEADER:statsop.SNAP_HEADER + capacity]
    np.testing.assert_array_equal(body[:k_in], inp.reshape(-1)[:k_in])
    np.testing.assert_array_equal(body[k_in:k_in + k_out], out.reshape(-1)[:k_out])
    assert not body[k_in + k_out:].any()
    # no threshold given: the outlier's region was taken from the start, and stays empty
    b = snap[statsop.SNAP_HEADER + capacity:]
    assert b[0] == 1 and not b[1:].any()


@pytest.mark.parametrize("capacity", [4096, 30])
def test_cpu_kernel_keeps_the_first_failing_output_call_once(capacity: int,
                                                             kernel) -> None:  # noqa: ANN001
    xs, snap = _snap_group(kernel, capacity)
    _check_snap(xs, snap.numpy(), capacity)


def test_no_snapshot_without_capacity_or_a_failing_output(kernel) -> None:  # noqa: ANN001
    xs, snap = _snap_group(kernel, 0)
    header = [1.0] + [0.0] * (statsop.SNAP_HEADER - 1)
    assert snap.numpy().tolist() == header[:-1] + [float("inf")] + header
    w = statsop.entry_width(8)
    snap = statsop.new_snap(torch.device("cpu"), 64)
    nan = torch.full((2, 8), float("nan"))  # a failing input is no candidate
    ring = torch.zeros(2, 2 * w)
    kernel([nan, torch.ones(2, 8)], ring, _toks(ring, 4),
           statsop.new_first(torch.device("cpu")), torch.tensor(0), [0, w], [8] * 2,
           [4] * 2, [0, 1], snap, [-1, 0])
    assert not snap.numpy()[:statsop.SNAP_HEADER + 64].any() or (
        snap.numpy()[:statsop.SNAP_HEADER + 64].tolist()
        == [0.0] * (statsop.SNAP_HEADER - 1) + [float("inf")] + [0.0] * 64)


THR = 448.0


def _outlier_group(kernel, capacity: int = 4096):  # noqa: ANN001, ANN202
    """Three GEMM calls in one group, inputs at 5, 1000 (with a NaN) and 2000 in absmax;
    the second's output holds a NaN as well. Then a later step whose first input is the
    largest. `pair` as graphhooks builds it for GEMM modules: input i -> -2 - its output."""
    g = torch.Generator().manual_seed(9)
    xs = [torch.rand(1, 4, 6, generator=g), torch.rand(4, 3, generator=g),
          torch.rand(1, 4, 5, generator=g), torch.rand(4, 2, generator=g),
          torch.rand(2, 5, generator=g), torch.rand(2, 3, generator=g)]
    xs[0][0, 1, 2] = -5.0
    xs[2][0, 3, 4], xs[2][0, 0, 0] = -1000.0, float("nan")  # finite absmax 1000
    xs[3][1, 1] = float("nan")
    xs[4][1, 0] = 2000.0
    n, w = len(xs), statsop.entry_width(CAP)
    ring, first = torch.zeros(2, w * n), statsop.new_first(torch.device("cpu"))
    toks = _toks(ring)
    snap = statsop.new_snap(torch.device("cpu"), capacity, THR)
    pair = [-3, 0, -5, 2, -7, 4]
    later = [x * 10 for x in xs]
    for step, group in ((3, xs), (4, later)):
        kernel(group, ring, toks, first, torch.tensor(step), [i * w for i in range(n)],
               [CAP] * n, [TOK] * n, list(range(30, 30 + n)), snap, pair)
    return xs, snap


def _check_outlier(xs, snap: np.ndarray, capacity: int) -> None:  # noqa: ANN001
    """The second call (input entry 32, output 33) in the second region at step 3, its
    input's rows (NaN kept as it was) and its output's; the NaN output's call in the first
    region: the same call, each region on its own."""
    inp, out = xs[2].reshape(4, 5).numpy(), xs[3].numpy()
    H = statsop.SNAP_HEADER
    b = snap[H + capacity:]
    assert b[:10].tolist() == [1, 3, 33, 32, 4, 5, 4, 2, inp.size, out.size]
    np.testing.assert_array_equal(b[H:H + inp.size], inp.reshape(-1))
    np.testing.assert_array_equal(b[H + inp.size:H + inp.size + out.size], out.reshape(-1))
    assert not b[H + inp.size + out.size:].any()
    assert snap[:10].tolist() == [1, 3, 33, 32, 4, 5, 4, 2, inp.size, out.size]


def test_cpu_kernel_keeps_the_first_outlier_call_once(kernel) -> None:  # noqa: ANN001
    xs, snap = _outlier_group(kernel)
    _check_outlier(xs, snap.numpy(), 4096)


def test_no_outlier_snapshot_below_the_threshold_or_for_a_non_candidate(kernel) -> None:  # noqa: ANN001
    w = statsop.entry_width(8)
    ring = torch.zeros(2, 3 * w)
    big = torch.full((2, 8), 447.0)
    big[0, 0] = -447.9
    for pair in ([-3, -1, 1], [-1, -1, 1]):  # below: a candidate; at 500: no candidate
        snap = statsop.new_snap(torch.device("cpu"), 64, THR)
        x = big if pair[0] == -3 else big + 53.0
        kernel([x, x, torch.ones(2, 8)], ring, _toks(ring, 4),
               statsop.new_first(torch.device("cpu")), torch.tensor(0), [0, w, 2 * w],
               [8] * 3, [4] * 3, [0, 1, 2], snap, pair)
        assert not snap.numpy()[statsop.SNAP_HEADER + 64:].any()


_CHILD = r"""
import sys, numpy as np, torch
sys.path.insert(0, sys.argv[2])
from qforensics.hooks import statscpu, statsop
from qforensics.hooks.statstriton import launch_triton
import test_statsop as t
out = {}
for i, (name, x) in enumerate(t._cases()):
    ring, toks, first = t._run(launch_triton, x, 11 + i, i)
    out[name + ".ring"] = ring.numpy()
    out[name + ".toks"] = toks.numpy()
    out[name + ".first"] = first.numpy()
for kernel, tag in ((launch_triton, "group.triton"), (statscpu.stats_cpu, "group.cpu")):
    ring, toks, first = t._group(kernel)
    out[tag + ".ring"] = ring.numpy()
    out[tag + ".toks"] = toks.numpy()
    out[tag + ".first"] = first.numpy()
for cap in (4096, 30):
    out[f"snap.{cap}"] = t._snap_group(launch_triton, cap)[1].numpy()
out["outlier"] = t._outlier_group(launch_triton)[1].numpy()
# programs in reverse order: the later failing outputs run first and must leave the call to
# the first one (a GPU runs them in any order)
import triton.runtime.interpreter as ti
b, dims = ti.interpreter_builder, [1]
set_dim, set_idx = b.set_grid_dim, b.set_grid_idx
b.set_grid_dim = lambda x, y, z: (dims.__setitem__(0, x), set_dim(x, y, z))[1]
b.set_grid_idx = lambda x, y, z: set_idx(dims[0] - 1 - x, y, z)
out["snap.reversed"] = t._snap_group(launch_triton, 4096)[1].numpy()
out["outlier.reversed"] = t._outlier_group(launch_triton)[1].numpy()
np.savez(sys.argv[1], **out)
"""


def test_triton_kernel_matches_numpy_in_the_interpreter(tmp_path) -> None:  # noqa: ANN001
    pytest.importorskip("triton", reason="Triton is a test dependency (pyproject [test])")
    out = tmp_path / "triton.npz"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", _CHILD, str(out), os.path.dirname(__file__)],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = np.load(out)
    for i, (name, x) in enumerate(_cases()):
        _check(x, got[name + ".ring"], got[name + ".toks"], got[name + ".first"], 11 + i, i,
               1e-5)
    # a group in one launch: the CPU kernel's figures, the first failure of the group
    for part in ("ring", "toks"):
        tri, cpu = got[f"group.triton.{part}"], got[f"group.cpu.{part}"]
        fin = np.isfinite(cpu)
        assert (np.isfinite(tri) == fin).all()
        np.testing.assert_allclose(tri[fin], cpu[fin], rtol=1e-4, atol=1e-3)
        assert (np.isnan(tri) == np.isnan(cpu)).all()
    tri = got["group.triton.ring"]
    assert got["group.triton.first"].tolist() == got["group.cpu.first"].tolist()
    assert statsop.decode_first(int(got["group.cpu.first"][0]))[1] == 12  # bad-f32, 3rd
    w = statsop.entry_width(CAP)
    np.testing.assert_array_equal(tri[9 % 2, 3 * w:4 * w], tri[9 % 2, w:2 * w])
    tt = got["group.triton.toks"]
    np.testing.assert_array_equal(tt[9 % 2, :, 13], tt[9 % 2, :, 11])  # entries 11 and 13
    # the snapshot: claimed by the first failing output's program, copied, once
    xs = _snap_group(statscpu.stats_cpu)[0]
    for cap in (4096, 30):
        _check_snap(xs, got[f"snap.{cap}"], cap)
    _check_snap(xs, got["snap.reversed"], 4096)
    # the first outlier: claimed by the first candidate at the threshold, whatever the order
    xs = _outlier_group(statscpu.stats_cpu)[0]
    _check_outlier(xs, got["outlier"], 4096)
    _check_outlier(xs, got["outlier.reversed"], 4096)


_CAPTURE_CHILD = r"""
import sys, torch
sys.path.insert(0, sys.argv[2])
from qforensics.hooks import graphstats, statsop  # the C++ kernel registers as it loads
from qforensics.hooks.statstriton import launch_triton
calls = []
statsop.register_kernel(lambda *a: (calls.append(1), launch_triton(*a))[1], "CPU")
from capture_models import Tiny, greedy_tokens
toks = greedy_tokens(torch.compile(Tiny(), dynamic=True), sys.argv[1], 3)
print(len(calls))
print(toks)
"""


def test_triton_kernel_through_a_compiled_capture_writes_the_cpu_kernels_trace(tmp_path
                                                                               ) -> None:
    """The Triton kernel (in its interpreter, registered as the op's CPU kernel in a child)
    behind a whole compiled capture: the graph's op calls, the ring, the token ring and the
    host's reading of them give the trace the C++ kernel gives, record for record."""
    pytest.importorskip("triton", reason="Triton is a test dependency (pyproject [test])")
    import qforensics
    from capture_models import Tiny, assert_same_channels, greedy_tokens

    tri_path, cpu_path = tmp_path / "triton.h5", tmp_path / "cpu.h5"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", _CAPTURE_CHILD, str(tri_path),
                        os.path.dirname(__file__)], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    toks = greedy_tokens(torch.compile(Tiny(), dynamic=True), cpu_path, 3)
    out = r.stdout.strip().splitlines()
    assert out[-1] == str(toks) and int(out[-2]) > 0  # the Triton kernel ran the op
    tt, tc = qforensics.open_trace(tri_path), qforensics.open_trace(cpu_path)
    assert tt.meta["status"]["capture_mode"] == tc.meta["status"]["capture_mode"] == "compiled"
    a, b = tt.records(), tc.records()
    assert len(a) == len(b) > 0
    exact = ["step", "call_index", "module_id", "io", "slot", "rows", "channels", "numel",
             "nan_count", "inf_count", "tok_count", "min", "max", "absmax"]
    assert a[exact].values.tolist() == b[exact].values.tolist()
    np.testing.assert_allclose(a["mean"].values, b["mean"].values, rtol=1e-5, atol=1e-6)
    # every record's token maxima and channel ranges, read back through the trace
    toks_seen, chans_seen = assert_same_channels(tt, tc)
    assert toks_seen > len(b) and chans_seen > 0


def test_numpy_pass_calls_no_blas(monkeypatch) -> None:
    """The CPU kernel's numpy pass (a dtype C does not read) never calls BLAS: numpy's OpenBLAS
    threads would wake and spin on the cores an engine binds its OpenMP threads to (vLLM
    compiled ran at 2.1x plain until this held, docs/benchmarks.md)."""
    def blas(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("a BLAS call in the stats op's numpy pass")

    for name in ("dot", "vdot", "inner", "matmul", "tensordot"):
        monkeypatch.setattr(np, name, blas)
    for x in (torch.randn(6, 40).to(torch.float16), torch.arange(100, 106)):
        ring, toks, first = _run(statscpu.stats_cpu, x, 7, 3)
        _check(x, ring.numpy(), toks.numpy(), first.numpy(), 7, 3, 1e-3)
