"""Capture promises on the real SmolLM2-135M model."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import qforensics

pytestmark = pytest.mark.model


def _greedy(model, enc, n):
    with torch.inference_mode():
        return model.generate(**enc, max_new_tokens=n, min_new_tokens=n, do_sample=False)


def test_greedy_decode_bit_identical_with_capture(smollm2, tmp_path):
    model, tok, enc = smollm2
    ref = _greedy(model, enc, 12)
    with torch.inference_mode():
        ref_logits = model(**enc).logits
    with qforensics.capture(model, tmp_path / "t.h5") as cap:
        got = _greedy(model, enc, 12)
        with torch.inference_mode():
            got_logits = model(**enc).logits
    assert cap.degraded is None
    assert torch.equal(ref, got)
    assert torch.equal(ref_logits, got_logits)  # bit-identical logits, not just tokens
    with qforensics.open_trace(tmp_path / "t.h5") as t:
        assert t.n_steps == 13  # 12 generate steps + the extra forward
        s = t.steps
        n_prompt = enc["input_ids"].shape[1]
        # min_new_tokens masks EOS after the model's raw argmax was recorded
        eos = {int(i) for i in ([tok.eos_token_id] if isinstance(tok.eos_token_id, int)
                                else tok.eos_token_id)} | {model.generation_config.eos_token_id
                                                            if isinstance(model.generation_config.eos_token_id, int) else -1}
        pairs = [(a, b) for a, b in zip(s.logits_argmax.tolist()[:12],
                                        got[0, n_prompt:].tolist()) if a not in eos]
        assert len(pairs) >= 6 and all(a == b for a, b in pairs)
        assert t.input_ids(0).tolist() == enc["input_ids"][0].tolist()
        mods = t.modules
        assert (mods.kind == "linear").sum() == 30 * 7 + 1
        assert (mods.kind == "block").sum() == 30
        r0 = t.records(0)
        down = r0[(r0.module == "model.layers.11.mlp.down_proj") & (r0.io == 0)].iloc[0]
        cmin, cmax = t.channel_ranges(int(down["row"]))
        absmax = abs(cmin).clip(min=abs(cmax))
        # the real massive activation: input channel 1229 at about 3,000
        assert int(absmax.argmax()) == 1229 and 2500 < absmax.max() < 3500
        # the outlier snapshot holds that GEMM's input and a weight tile
        snaps = t.snapshots
        assert "first_outlier" in set(snaps.reason)
        kept = t.snapshot_tensors(int(snaps.call_index.iloc[0]))
        assert "input.0" in kept and "weight" in kept
        env = t.meta["environment"]
        cast = torch.tensor([1000.0, -1000.0]).to(torch.float8_e4m3fn).float()
        want = ("nan" if torch.isnan(cast).all() else "saturate" if cast.tolist() == [
            torch.finfo(torch.float8_e4m3fn).max, -torch.finfo(torch.float8_e4m3fn).max]
            else "inf" if torch.isinf(cast).all() else f"other:{cast.tolist()}")
        assert env["fp8_cast"]["e4m3fn"] == want
        assert env["torch"] == torch.__version__


CHILD = textwrap.dedent("""
    import sys, time, torch, qforensics
    from transformers import TextStreamer
    from qforensics.demo.model import load_model
    model, tok = load_model()
    enc = tok.apply_chat_template([{"role": "user", "content": "Tell me a long story."}],
                                  add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)

    class Tick:
        def __init__(self): self.n = 0
        def put(self, value):
            print(f"STEP {self.n} {time.time():.4f}", flush=True); self.n += 1
        def end(self): pass

    with qforensics.capture(model, sys.argv[1], flush_interval=0.5):
        with torch.inference_mode():
            model.generate(**enc, max_new_tokens=400, min_new_tokens=400, do_sample=False,
                           streamer=Tick())
""")


def test_sigkill_mid_generation_keeps_flushed_steps(tmp_path):
    """A real kill -9 of a process capturing the real model."""
    path = tmp_path / "killed.h5"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    ticks: list[tuple[int, float]] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("STEP"):
                _, n, t = line.split()
                ticks.append((int(n), float(t)))
                if len(ticks) >= 15:
                    break
        kill_time = time.time()
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    # the streamer's first put is the prompt; put n (n >= 1) comes after step n-1 was
    # submitted. Every step submitted more than the flush interval (0.5 s) before the kill
    # must be on disk.
    old_enough = [n for n, t in ticks if t < kill_time - 0.5 - 0.1 and n >= 1]
    assert old_enough, "the child made no progress"
    with qforensics.open_trace(path) as t:
        assert not t.end.complete
        assert t.n_steps >= max(old_enough)
        assert t.steps.step.tolist() == list(range(t.n_steps))
        assert len(t.records(t.n_steps - 1)) > 400
        assert "never closed" in t.end.reason


SCRIPT = textwrap.dedent("""
    import sys, torch
    from qforensics.demo.model import load_model
    model, tok = load_model()
    enc = tok.apply_chat_template([{"role": "user", "content": sys.argv[1]}],
                                  add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)
    out = model.generate(**enc, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    print("TEXT", tok.decode(out[0, enc["input_ids"].shape[1]:]))
    raise RuntimeError("CUDA error: an illegal memory access was encountered")
""")


def test_record_wraps_an_unmodified_script(tmp_path):
    script = tmp_path / "serve_once.py"
    script.write_text(SCRIPT)
    out = tmp_path / "rec.h5"
    proc = subprocess.run(["qforensics", "record", "-o", str(out), "--", sys.executable,
                           str(script), "hello"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1  # the script's own exit code
    assert "TEXT" in proc.stdout
    assert "capturing LlamaForCausalLM" in proc.stderr
    assert f"{out}: 4 steps" in proc.stderr
    with qforensics.open_trace(out) as t:
        assert t.n_steps == 4
        assert t.meta["status"]["state"] == "error"
        assert "illegal memory access" in t.meta["status"]["error"]
        assert len(t.input_ids(0)) > 5  # the prefill's prompt ids were caught


def test_record_print_env(tmp_path):
    proc = subprocess.run(["qforensics", "record", "-o", str(tmp_path / "x.h5"), "--print-env"],
                          capture_output=True, text=True)
    assert proc.returncode == 0
    assert "export QFORENSICS_TRACE=" in proc.stdout
    assert "_bootstrap" in proc.stdout


FP8_SCRIPT = textwrap.dedent("""
    import torch
    from qforensics.demo.model import load_model
    from qforensics.quant import emulate_quantized_linears
    m, tok = load_model()
    enc = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France? Answer in one short sentence."}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with emulate_quantized_linears(m, "fp8-e4m3-nosat", exclude=("lm_head",)):
        with torch.inference_mode():
            out = m.generate(**enc, max_new_tokens=8, do_sample=False)
    print("TEXT", repr(tok.decode(out[0, enc["input_ids"].shape[1]:])))
""")


def test_record_with_guard_recovers_the_fp8_run(tmp_path):
    """record --guard on an unmodified script running non-saturating FP8 activations."""
    script = tmp_path / "fp8_serve.py"
    script.write_text(FP8_SCRIPT)
    out = tmp_path / "guarded.h5"
    proc = subprocess.run(["qforensics", "record", "--guard", "-o", str(out), "--",
                           sys.executable, str(script)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "TEXT 'The capital of France is Paris.<|im_end|>'" in proc.stdout
    with qforensics.open_trace(out) as t:
        assert t.end.complete and t.meta["status"]["state"] == "complete"
        inc = t.incidents
        assert "model.layers.11.mlp.down_proj" in set(inc.module)
        assert set(inc.action) == {"fallback"}
        assert (t.steps.logits_nan == 0).all()  # the guard kept every step's logits finite
