"""Session fixtures: the real model (loaded once per process, shared with tests/guard through
qforensics.whatif.run.load_demo) and a real reference trace of the demo prompt."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def demo():
    from qforensics.whatif.run import load_demo

    return load_demo()


@pytest.fixture(scope="session")
def reference_trace(demo, tmp_path_factory) -> Path:
    """/work/main/sample_traces/fp16-reference.h5 when present, else a fresh capture of the
    unquantized model answering the demo prompt (8 greedy tokens)."""
    sample = Path(__file__).resolve().parents[2] / "sample_traces" / "fp16-reference.h5"
    if sample.is_file() and os.environ.get("QF_TEST_FRESH_TRACE") is None:
        return sample
    import torch

    import qforensics
    from qforensics.whatif.run import demo_prompt_ids

    model, tok = demo
    ids = demo_prompt_ids(tok)
    path = tmp_path_factory.mktemp("whatif") / "fp16-reference.h5"
    with qforensics.capture(model, path, metadata={"scenario": "fp16-reference"}):
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                           do_sample=False, temperature=None, top_p=None, top_k=None,
                           pad_token_id=tok.eos_token_id)
    return path
