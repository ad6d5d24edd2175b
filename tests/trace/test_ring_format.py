"""Format 1.1's ring, promoted blocks and limits are untrusted input like the rest of a trace:
bad values read as "not stored" or raise TraceFormatError, never crash or read out of bounds."""

from __future__ import annotations

import shutil

import h5py
import numpy as np
import pytest
import torch
from torch import nn

import qforensics
from qforensics.errors import TraceFormatError


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(16, 8)
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(input_ids)
        for lin in self.layers:
            x = lin(x)
        return x


@pytest.fixture
def ring_trace(tmp_path):
    m = Small()
    path = tmp_path / "ring.h5"
    with torch.inference_mode(), qforensics.capture(m, path, ring_steps=4, trigger_window=2):
        m(torch.arange(5).reshape(1, 5))
        for s in range(1, 12):
            m(torch.tensor([[s]]))
    return path


def _copy(src, dst, edit):
    shutil.copy(src, dst)
    with h5py.File(dst, "a") as f:
        edit(f)
    return dst


def test_ring_holds_the_last_steps_with_values_a_plain_hook_saw(ring_trace):
    m = Small()
    seen = {}
    m.layers[1].register_forward_pre_hook(
        lambda mod, a: seen.__setitem__(len(seen), a[0].reshape(-1, 8).numpy().copy()))
    with torch.inference_mode():
        m(torch.arange(5).reshape(1, 5))
        for s in range(1, 12):
            m(torch.tensor([[s]]))
    with qforensics.open_trace(ring_trace) as t:
        for step in range(12):
            got = t.channels_for("layers.1", step)
            if step in (0, 8, 9, 10, 11):  # the prefill and the ring of 4
                np.testing.assert_allclose(got[0], seen[step].min(0), rtol=1e-6)
                np.testing.assert_allclose(got[1], seen[step].max(0), rtol=1e-6)
            else:
                assert got is None


def test_ring_count_past_the_width_is_clipped(ring_trace, tmp_path):
    def edit(f):
        f["ring/count"][:] = 10**12
    path = _copy(ring_trace, tmp_path / "count.h5", edit)
    with qforensics.open_trace(path) as t:
        got = t.channels_for("layers.1", 11)
        assert got is not None and len(got[0]) == 8


def test_ring_slot_naming_another_step_reads_as_not_stored(ring_trace, tmp_path):
    def edit(f):
        f["ring/step"][:] = -1
    path = _copy(ring_trace, tmp_path / "steps.h5", edit)
    with qforensics.open_trace(path) as t:
        assert t.channels_for("layers.1", 11) is None
        assert t.channels_for("layers.1", 0) is not None  # the prefill lives in /channels


def test_promoted_rows_pointing_outside_channels_are_ignored(ring_trace, tmp_path):
    def edit(f):
        g = f["channels/promoted"]
        for name in ("step", "offset", "count"):
            g[name].resize((1,))
        g["step"][0], g["offset"][0], g["count"][0] = 3, 10**9, 16
    path = _copy(ring_trace, tmp_path / "prom.h5", edit)
    with qforensics.open_trace(path) as t:
        assert t.channels_for("layers.1", 3) is None


@pytest.mark.parametrize("what", ["missing", "shape"])
def test_malformed_ring_is_refused(ring_trace, tmp_path, what):
    def edit(f):
        if what == "missing":
            del f["ring/count"]
        else:
            del f["ring/step"]
            f["ring"].create_dataset("step", data=np.zeros(3, np.int64))
    path = _copy(ring_trace, tmp_path / f"{what}.h5", edit)
    with pytest.raises(TraceFormatError, match="ring"):
        qforensics.open_trace(path)
