"""Threads: generate on worker threads with the guard and the capture attached. Concurrent
requests keep separate steps (each step is one forward of one request), a capture attached on a
worker thread is sealed at interpreter exit, and `qforensics record --guard` works when the
program generates on a TextIteratorStreamer's worker thread (the real model)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from collections import Counter

import torch

import qforensics
from qforensics.guard import guard
from test_guard_cache import NoSatFp8Linear, _mistral


def _model():
    model, _ = _mistral(window=64)  # a cache the guard can roll back
    mlp = model.model.layers[1].mlp
    mlp.down_proj = NoSatFp8Linear(mlp.down_proj)
    return model


PROMPTS = {"a": torch.arange(8).reshape(1, 8) % 64, "b": (torch.arange(5) * 7 + 3).reshape(1, 5)}


def _generate(model, ids):
    return model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                          pad_token_id=0)


def test_concurrent_requests_keep_separate_steps(tmp_path):
    model = _model()
    with torch.no_grad():  # each request alone, under the guard: the expected outputs
        alone = {}
        for k, ids in PROMPTS.items():
            with guard(model) as g1:
                alone[k] = _generate(model, ids)
            assert g1.stats.repaired_steps >= 1  # the layer trips; the guard repairs it
    results: dict[str, torch.Tensor] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(PROMPTS))

    def worker(k):
        try:
            barrier.wait()
            with torch.no_grad():
                results[k] = _generate(model, PROMPTS[k])
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    path = tmp_path / "threads.h5"
    with qforensics.capture(model, path), guard(model) as g:
        threads = [threading.Thread(target=worker, args=(k,)) for k in PROMPTS]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert not errors and set(results) == set(PROMPTS)
    for k in PROMPTS:  # no request saw another's arguments, cache or rerun
        assert torch.equal(results[k], alone[k]), k
    assert g.failed is None and g.stats.steps == 12 and g.stats.sanitized_steps == 0
    with qforensics.open_trace(path) as t:
        steps = t.steps
        assert t.n_steps == 12  # 2 requests x (prefill + 5 decode steps)
        # every step is one forward of one request: the prompt or one new token ...
        assert Counter(steps.token_count.tolist()) == Counter({8: 1, 5: 1, 1: 10})
        # ... and holds one call of each hooked module: an input and an output record per
        # module, the root's output; a repaired step also holds the guard's rerun of the
        # modules (not of the root)
        per_call = 2 * (len(t.modules) - 1)
        reruns = g.stats.reruns
        assert reruns >= 1
        assert Counter(steps.record_count.tolist()) == Counter(
            {per_call + 1: 12 - reruns, 2 * per_call + 1: reruns})
        assert set(t.incidents.action) <= {"fallback", "breaker_open", "breaker_fallback"}


WORKER_SCRIPT = textwrap.dedent("""
    import sys, threading, torch
    sys.path.insert(0, sys.argv[2])
    import qforensics
    from test_guard_cache import _mistral

    model, _ = _mistral(window=64)

    def work():
        cap = qforensics.capture(model, sys.argv[1])
        cap.attach()  # never closed by the program: interpreter exit must seal it
        with torch.no_grad():
            model.generate(torch.arange(6).reshape(1, 6), max_new_tokens=3, min_new_tokens=3,
                           do_sample=False, pad_token_id=0)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    print("DONE")
""")


def test_capture_attached_on_a_worker_thread_is_sealed_at_exit(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER_SCRIPT)
    out = tmp_path / "worker.h5"
    here = str(__import__("pathlib").Path(__file__).parent)
    proc = subprocess.run([sys.executable, str(script), str(out), here], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "DONE" in proc.stdout
    with qforensics.open_trace(out) as t:
        assert t.end.complete, t.end
        assert t.meta["status"]["state"] == "complete"
        assert t.meta["status"]["closed_by"] == "interpreter exit"
        assert t.n_steps == 3


STREAMER_SCRIPT = textwrap.dedent("""
    import threading, torch
    from transformers import TextIteratorStreamer
    from qforensics.demo.model import load_model
    from qforensics.quant import emulate_quantized_linears
    m, tok = load_model()
    enc = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France? Answer in one short sentence."}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True)
    streamer = TextIteratorStreamer(tok, skip_prompt=True, skip_special_tokens=False,
                                    timeout=300)  # a failed generate must not hang the test

    def run():
        with emulate_quantized_linears(m, "fp8-e4m3-nosat", exclude=("lm_head",)):
            with torch.inference_mode():
                m.generate(**enc, max_new_tokens=8, do_sample=False, streamer=streamer)

    t = threading.Thread(target=run)  # the model's first forward happens on this thread
    t.start()
    text = "".join(streamer)
    t.join()
    print("TEXT", repr(text))
""")


def test_record_guard_with_text_iterator_streamer(tmp_path):
    """The fp8-e4m3-nosat run of the real model, generated on a worker thread."""
    script = tmp_path / "stream.py"
    script.write_text(STREAMER_SCRIPT)
    out = tmp_path / "stream.h5"
    proc = subprocess.run(["qforensics", "record", "--guard", "-o", str(out), "--",
                           sys.executable, str(script)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "TEXT 'The capital of France is Paris.<|im_end|>'" in proc.stdout
    with qforensics.open_trace(out) as t:
        assert t.end.complete and t.meta["status"]["state"] == "complete"
        assert "model.layers.11.mlp.down_proj" in set(t.incidents.module)
        assert (t.steps.logits_nan == 0).all()
