"""The flight recorder over a long generation: a failure that starts at step 700 of 1,000.

A small synthetic model decodes 1,000 steps. From step 680 an unhooked op makes input channel 3
of `layers.0.up` grow step by step; at step 700 it is large enough that `layers.0.up`'s output
overflows to Inf (its input stays finite: `layers.0.up` is the producer). Expectations come from
that construction and from an independent plain hook, never from qforensics' own output."""

from __future__ import annotations

import os

import numpy as np
import torch
from torch import nn

import qforensics
from qforensics.analyze.analyzer import analyze_trace
from qforensics.trace import schema

FAIL_AT = 700
DRIFT_FROM = 680
N_STEPS = 1000


class Drifting(nn.Module):
    def __init__(self, d: int = 32, fail_at: int = FAIL_AT) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(64, d)
        self.layers = nn.ModuleList([nn.ModuleDict({"up": nn.Linear(d, 2 * d),
                                                    "down": nn.Linear(2 * d, d)})
                                     for _ in range(2)])
        self.head = nn.Linear(d, 64)
        with torch.no_grad():
            self.layers[0]["up"].weight[:, 3] = 100.0
        self.t = 0
        self.fail_at = fail_at

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(input_ids)
        t, self.t = self.t, self.t + 1
        start = self.fail_at - (FAIL_AT - DRIFT_FROM)
        if t >= start:  # unhooked op: channel 3 grows, then explodes at fail_at
            x[..., 3] = (1.0 + 2.0 * (t - start)) + (1e37 if t >= self.fail_at else 0.0)
        for layer in self.layers:
            x = x + layer["down"](torch.relu(layer["up"](x)))
        return self.head(x)


def decode(model: nn.Module, steps: int) -> None:
    with torch.inference_mode():
        model(torch.arange(8).reshape(1, 8))  # prefill
        for s in range(1, steps):
            model(torch.tensor([[s % 64]]))


def test_failure_at_step_700_of_1000_keeps_what_the_analysis_needs(tmp_path):
    m = Drifting()
    seen: dict[int, float] = {}  # plain hook: channel 3 of layers.0.up's input, per step

    def plain(mod, args):
        seen[len(seen)] = float(args[0][..., 3].abs().max())

    h = m.layers[0]["up"].register_forward_pre_hook(plain)
    path = tmp_path / "long.h5"
    with qforensics.capture(m, path, ring_steps=16, trigger_window=8):
        decode(m, N_STEPS)
    h.remove()
    assert seen[FAIL_AT] > 1e36 and seen[FAIL_AT - 1] < 100  # the construction holds

    f = analyze_trace(path)
    first = f.first_nonfinite
    assert first is not None and first.step == FAIL_AT
    assert first.producer_module == "layers.0.up"  # finite input, non-finite output
    assert any(o.channel == 3 and o.module == "layers.0.up" for o in f.outliers)

    with qforensics.open_trace(path) as t:
        assert t.n_steps == N_STEPS

        def ch3(step: int) -> float | None:
            got = t.channels_for("layers.0.up", step)
            return None if got is None else float(max(abs(got[0][3]), abs(got[1][3])))

        # kept: the prefill, the failing step, the window before it, the last ring_steps steps
        for step in [0, *range(FAIL_AT - 8, FAIL_AT + 1), *range(N_STEPS - 16, N_STEPS)]:
            got = ch3(step)
            assert got is not None, f"channels of step {step} were not kept"
            np.testing.assert_allclose(got, seen[step], rtol=1e-6)
        # the trend before the failure is there and grows as constructed
        trend = [ch3(s) for s in range(FAIL_AT - 8, FAIL_AT)]
        assert all(b > a for a, b in zip(trend, trend[1:]))
        # a quiet step in the middle kept only scalars
        assert ch3(300) is None
        recs = t.records(300)
        assert np.isfinite(recs["absmax"]).all() and (recs["chan_offset"] == -1).all()
        trig = t.triggers
        assert FAIL_AT in set(trig.loc[trig["kind"] == "nonfinite", "step"])
        assert not (trig["step"] < DRIFT_FROM).any()  # nothing fires on the quiet part
        # bounded: channels of the prefill, the 8 steps before the failure, 32 non-finite steps
        # (trigger_limit, from the failing one on) and the 16 ring steps: 57 of 1,000 steps
        cols = t.record_columns(["step", "chan_offset"])
        with_channels = set(np.unique(cols["step"][cols["chan_offset"] >= 0]).tolist())
        assert with_channels == {0, *range(FAIL_AT - 8, FAIL_AT + 32),
                                 *range(N_STEPS - 16, N_STEPS)}


def test_max_bytes_caps_the_file_and_says_so(tmp_path):
    """The byte budget (format 1.2) is never passed, and where full detail stops being appended
    the trace says at which step. Its least size is the ring plus the room held back for the
    pinned failure windows (about 11.5 MiB for this model, checked at attach)."""
    m = Drifting(d=256)
    path = tmp_path / "capped.h5"
    cap = 12 << 20
    with qforensics.capture(m, path, max_bytes=cap, flush_interval=0.01, channel_steps="all"):
        decode(m, 300)
    with qforensics.open_trace(path) as t:
        assert t.limits["max_bytes"] == cap
        assert 0 < t.limits["reached_at_step"] < 300  # reached
        assert t.meta["status"]["max_bytes_reached"]["step"] == t.limits["reached_at_step"]
    assert os.path.getsize(path) <= cap

    path = tmp_path / "ring.h5"  # the flight recorder: triggered steps pinned, the ring turns
    m = Drifting(d=256, fail_at=30)  # steps 30-229 trigger
    cap = 14 << 20
    with qforensics.capture(m, path, max_bytes=cap, flush_interval=0.01, trigger_limit=200):
        decode(m, 300)
    assert os.path.getsize(path) <= cap
    with qforensics.open_trace(path) as t:
        assert t.limits["max_bytes"] == cap
        assert int(t.triggers["step"].min()) == 30
        ring_steps = set(t._f["ring/step"][:].tolist())  # noqa: SLF001
        assert 299 in ring_steps  # the last steps' channels are in the ring


KILLED_RUN = """
import os, signal, sys, time
sys.path.insert(0, {here!r})
import torch
import qforensics
from test_flight_recorder import Drifting, decode
m = Drifting()
cap = qforensics.capture(m, sys.argv[1], flush_interval=0.05, ring_steps=16)
cap.attach()
decode(m, 100)
# no close: wait (polling, 30 s at most) until the writer's own schedule has put every step on
# disk, as it does within a flush interval, then die without a word
deadline = time.monotonic() + 30
while cap._writer.steps_written < 100 and time.monotonic() < deadline:
    time.sleep(0.01)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_sigkill_keeps_the_steps_and_the_last_window(tmp_path):
    import signal
    import subprocess
    import sys

    path = tmp_path / "killed.h5"
    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, "-c", KILLED_RUN.format(here=here), str(path)],
                          timeout=300, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              [os.path.dirname(os.path.dirname(here)), here])})
    assert proc.returncode == -signal.SIGKILL
    with qforensics.open_trace(path) as t:
        assert not t.end.complete
        assert t.n_steps == 100
        cols = t.record_columns(["step", "chan_offset"])
        with_channels = set(np.unique(cols["step"][cols["chan_offset"] >= 0]).tolist())
        assert with_channels == {0, *range(84, 100)}  # the prefill and the last window
        got = t.channels_for("layers.0.up", 99)
        assert got is not None and np.isfinite(got[0]).all()


def test_a_loop_that_refeeds_its_sequence_keeps_only_its_prompts(tmp_path):
    """Without a KV cache (or with a static-shape buffer) a loop feeds its whole sequence every
    step: those steps are decodes, their channels go to the ring; a new prompt is kept."""
    m = Drifting(fail_at=10 ** 6)  # never drifts
    path = tmp_path / "refeed.h5"
    prompt = [5, 6, 7, 8]
    with qforensics.capture(m, path, ring_steps=4, trigger_window=0), torch.inference_mode():
        seq = list(prompt)
        for _ in range(6):  # steps 0-5: the sequence grows by one token a step
            m(torch.tensor([seq]))
            seq.append(len(seq) % 64)
        buf = torch.zeros((1, 12), dtype=torch.long)  # steps 6-11: a fixed-width buffer
        buf[0, :3] = torch.tensor([9, 10, 11])
        for i in range(6):
            m(buf)
            buf[0, 3 + i] = 20 + i
        m(torch.tensor([[30, 31, 32]]))  # step 12: a new, shorter prompt
    with qforensics.open_trace(path) as t:
        cols = t.record_columns(["step", "chan_offset", "flags"])
        kept = (cols["chan_offset"] >= 0) & ((cols["flags"] & schema.FLAG_RING) == 0)
        # step 6 is a new prompt too: a buffer unlike step 5's sequence
        assert set(np.unique(cols["step"][kept]).tolist()) == {0, 6, 12}
