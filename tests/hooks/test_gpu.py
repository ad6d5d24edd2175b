"""The capture's GPU path on a real CUDA device, each against what the CPU gives:
- the stats op's CUDA kernel (Triton, compiled for the device: elsewhere only its interpreter
  runs) on test_statsop's cases, groups and snapshots;
- compiled capture under CUDA graphs (`reduce-overhead`): the ring's asynchronous host copies,
  the pinned buffers, the events, the drainer; a weight row overwritten with NaN mid-run;
- eager capture on the device, its default path and the op path (`compiled=True`).

Without a CUDA device every test here skips, saying so. scripts/gpu_session.sh runs them on a
GPU machine; `QF_GPU_TEST_DEVICE=cpu` runs the same tests on the CPU (the session script's
--self-check), which checks the tests, not the GPU.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import qforensics
from qforensics.hooks import statscpu
from qforensics.trace import schema

DEV = torch.device(os.environ.get("QF_GPU_TEST_DEVICE", "cuda"))
pytestmark = pytest.mark.skipif(DEV.type == "cuda" and not torch.cuda.is_available(),
                                reason="needs a CUDA device (scripts/gpu_session.sh runs these "
                                       "on a GPU machine)")

import test_statsop as so  # noqa: E402 - the op's cases and numpy checks, in one place
from capture_models import Tiny  # noqa: E402

STEPS = 6
WIDTH = 16  # the static row every step re-feeds: 4 prompt ids, then the greedy tokens


def _sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def _on_device(xs, ring, toks, first, step, off, cap, tok, entry, snap,  # noqa: ANN001, ANN202
               pair):
    """The op with every tensor on DEV (dispatched to its kernel there: Triton on CUDA), its
    outputs copied back into the CPU tensors test_statsop's checks read."""
    if DEV.type == "cuda":
        from qforensics.hooks import statstriton

        assert statstriton.triton is not None, "no Triton: the op has no CUDA kernel"
    outs = [t.to(DEV) for t in (ring, toks, first, snap)]
    torch.ops.qforensics.stats([x.to(DEV) for x in xs], *outs[:3], step.to(DEV), off, cap, tok,
                               entry, outs[3], pair)
    _sync()
    for cpu, dev in zip((ring, toks, first, snap), outs):
        cpu.copy_(dev.cpu())


@pytest.mark.parametrize("i", range(len(so._cases())), ids=[n for n, _ in so._cases()])
def test_op_on_the_device_matches_numpy(i: int) -> None:
    _, x = so._cases()[i]
    ring, toks, first = so._run(_on_device, x, 11 + i, i)
    so._check(x, ring.numpy(), toks.numpy(), first.numpy(), 11 + i, i, 1e-5)


def test_op_on_the_device_reduces_a_group_and_keeps_the_first_failing_call() -> None:
    dev, cpu = so._group(_on_device), so._group(statscpu.stats_cpu)
    for d, c in zip(dev[:2], cpu[:2]):  # the ring, the token ring
        d, c = d.numpy(), c.numpy()
        fin = np.isfinite(c)
        assert (np.isfinite(d) == fin).all() and (np.isnan(d) == np.isnan(c)).all()
        np.testing.assert_allclose(d[fin], c[fin], rtol=1e-4, atol=1e-3)
    assert dev[2].tolist() == cpu[2].tolist()  # the first-failure word
    for cap in (4096, 30):
        xs, snap = so._snap_group(_on_device, cap)
        so._check_snap(xs, snap.numpy(), cap)


def _greedy(model: torch.nn.Module, path, dev: torch.device = DEV, plant: int | None = None,
            **kw) -> tuple[list[int], int | None]:
    """STEPS greedy tokens from ids 1-4 with a static shape (a row of WIDTH ids, zeros past the
    tokens: Tiny has no attention, so position n-1's logits depend on token n-1 only), under
    capture on DEV; `plant`: before that step one row of layers.2.down's weight is set to NaN
    in place, as a kernel's stray store would. Returns the tokens and, on CUDA, Inductor's
    count of CUDA graphs it skipped (read before close: closing resets Dynamo)."""
    x = torch.zeros(1, WIDTH, dtype=torch.long, device=dev)
    x[0, :4] = torch.tensor([1, 2, 3, 4])
    n, out, skips = 4, [], None
    with qforensics.capture(model, path, **kw), torch.no_grad():
        for step in range(STEPS):
            if step == plant:
                inner = getattr(model, "_orig_mod", model)
                inner.layers[2].down.weight[3].fill_(float("nan"))
            logits = model(x)
            nxt = int(logits[0, n - 1].argmax())
            x[0, n] = nxt
            out.append(nxt)
            n += 1
        if dev.type == "cuda":
            from torch._dynamo.utils import counters

            skips = int(counters["inductor"]["cudagraph_skips"])
    return out, skips


def _same_figures(ref, got) -> None:  # noqa: ANN001
    """Every step of trace `got` holds the records of trace `ref` (module, io, slot, shape,
    counts exact; figures, token maxima and channel ranges to float32 rounding: another
    device's GEMMs), and the same first failing call. A step `got`'s drainer spilled (it
    lagged: `complete` 2, no records; docs/architecture.md) is left out, its row kept."""
    ra, rb = ref.records(), got.records()
    kept = got.steps["step"][got.steps["complete"] == 1].tolist()
    assert got.steps["step"].tolist() == list(range(STEPS)) and len(kept) > 0
    assert len(ra[ra.step.isin(kept)]) == len(rb) > 0
    for step in kept:
        a = ra[ra.step == step].sort_values(["call_index", "io", "slot"])
        b = rb[rb.step == step].sort_values(["call_index", "io", "slot"])
        exact = ["module_id", "io", "slot", "rows", "channels", "numel", "nan_count",
                 "inf_count"]
        assert a[exact].values.tolist() == b[exact].values.tolist(), step
        for f in ("min", "max", "mean", "absmax"):
            fin = np.isfinite(a[f].values)
            assert (np.isfinite(b[f].values) == fin).all(), (step, f)
            np.testing.assert_allclose(b[f].values[fin], a[f].values[fin], rtol=1e-4,
                                       atol=1e-5)
        for (_, x), (_, y) in zip(a.iterrows(), b.iterrows()):
            for pa, pb in ((ref.token_absmax(x), got.token_absmax(y)),
                           *zip(ref.channel_ranges(x) or (None, None),
                                got.channel_ranges(y) or (None, None))):
                assert (pa is None) == (pb is None)
                if pa is not None:
                    np.testing.assert_allclose(pb, pa, rtol=1e-4, atol=1e-5)
    fa, fb = ref.steps["first_nonfinite_call"], got.steps["first_nonfinite_call"]
    assert ((fa >= 0) == (fb >= 0)).all()


def _cpu_reference(tmp_path):  # noqa: ANN001, ANN202
    """The same run in eager capture on the CPU: its tokens and trace."""
    toks, _ = _greedy(Tiny(), tmp_path / "cpu.h5", torch.device("cpu"))
    return toks, qforensics.open_trace(tmp_path / "cpu.h5")


def test_compiled_capture_under_cuda_graphs_records_what_the_cpu_records(tmp_path):
    want, ref = _cpu_reference(tmp_path)
    model = torch.compile(Tiny().to(DEV), mode="reduce-overhead")
    toks, skips = _greedy(model, tmp_path / "dev.h5")
    assert toks == want
    assert skips in (None, 0)  # every step replayed a CUDA graph
    got = qforensics.open_trace(tmp_path / "dev.h5")
    st = got.meta["status"]
    assert st["capture_mode"] == "compiled" and st["hook_path"] == "graph"
    assert got.n_steps == STEPS
    if DEV.type == "cuda":  # the GPU's way: host copies read by the drainer, nothing dropped
        assert st["graph_drain"]["thread"] is True and st["graph_drain"]["dropped"] == 0
    _same_figures(ref, got)


def test_a_weight_row_set_to_nan_under_cuda_graphs_is_found_at_its_step(tmp_path):
    model = torch.compile(Tiny().to(DEV), mode="reduce-overhead")
    _greedy(model, tmp_path / "dev.h5", plant=3)
    t = qforensics.open_trace(tmp_path / "dev.h5")
    first = t.steps["first_nonfinite_call"].tolist()
    assert first[:3] == [-1] * 3 and first[3] >= 0
    rec = t.records(3)
    hit = rec[rec.call_index == first[3]]
    names = list(t.module_columns["name"])
    assert {names[int(m)] for m in hit.module_id} == {"layers.2.down"}
    assert (hit[hit.io == schema.IO_INPUT].nan_count == 0).all()  # finite in, NaN out
    assert (hit[hit.io == schema.IO_OUTPUT].nan_count > 0).all()


def test_eager_capture_on_the_device_records_what_the_cpu_records(tmp_path):
    """An eager model on the device: its hooks call the stats op (Triton on CUDA) at once."""
    want, ref = _cpu_reference(tmp_path)
    toks, _ = _greedy(Tiny().to(DEV), tmp_path / "dev.h5")
    assert toks == want
    got = qforensics.open_trace(tmp_path / "dev.h5")
    assert got.meta["status"]["capture_mode"] == "compiled"
    _same_figures(ref, got)
