"""A small offline vLLM program: `python -m qforensics.demo.vllm_serve MODEL_DIR [options]`.

Serves prompts with greedy decoding through vLLM's `LLM` API and writes what came out (text and
token ids per request, seconds spent generating) as JSON. It knows nothing about qforensics: it
is the unmodified program that `qforensics record`, the tests and bench/vllm_overhead.py run.

    qforensics record -o 't-{rank}.h5' -- python -m qforensics.demo.vllm_serve DIR --out o.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

DEFAULT_PROMPTS = ["The capital of France is", "Quantization of large language models means"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="HF folder vLLM loads (e.g. from qforensics.demo.vllm_model)")
    ap.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=1, help="serve the prompts this many times")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", help="write the outputs here as JSON")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="vLLM workers splitting each layer (one trace file per rank)")
    ap.add_argument("--pipeline-parallel-size", type=int, default=1,
                    help="vLLM workers each running a slice of the layers")
    ap.add_argument("--memory-utilization", type=float, default=0.5,
                    help="share of the machine's memory vLLM may claim (its "
                         "gpu_memory_utilization; vLLM refuses to start when less is free)")
    a = ap.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    llm = LLM(model=a.model, dtype=a.dtype, enforce_eager=True, max_model_len=512, seed=0,
              tensor_parallel_size=a.tensor_parallel_size,
              pipeline_parallel_size=a.pipeline_parallel_size,
              gpu_memory_utilization=a.memory_utilization)
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0.0)
    prompts = a.prompt or DEFAULT_PROMPTS
    runs = []
    for _ in range(a.repeat):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append({"seconds": time.perf_counter() - t0, "outputs": [
            {"request_id": o.request_id, "prompt_token_ids": list(o.prompt_token_ids or []),
             "text": o.outputs[0].text, "token_ids": list(o.outputs[0].token_ids)}
            for o in outs]})
    res = {"prompts": prompts, "runs": runs, "pid": os.getpid()}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f)
    for o in runs[-1]["outputs"]:
        print(f"{o['request_id']}: {o['text']!r}")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
