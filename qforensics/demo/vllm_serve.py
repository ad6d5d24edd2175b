"""A small offline vLLM program: `python -m qforensics.demo.vllm_serve MODEL_DIR [options]`.

Serves prompts with greedy decoding through vLLM's `LLM` API and writes what came out (text and
token ids per request, seconds spent generating) as JSON. It knows nothing about qforensics: it
is the unmodified program that `qforensics record`, the tests and bench/vllm_overhead.py run
(started by `whatif`, it ends with it: qforensics/lifeline.py).

    qforensics record -o 't-{rank}.h5' -- python -m qforensics.demo.vllm_serve DIR --out o.json

With ``--score-ids FILE`` (a JSON list of token-id lists) it scores instead of generating:
each list is served as a prompt with ``prompt_logprobs=1``, and the output gives, for every
position after the first, the logprob of the token that is there and the model's own top-1
token (teacher forcing: perplexity and top-1 agreement without free-running divergence), and
which quant method and CPU kernel path (W4A8 or W4A16) vLLM's linears use and the engine
process's resident memory (read in vLLM's worker through ``LLM.apply_model``, for which it sets
VLLM_ALLOW_INSECURE_SERIALIZATION=1: pickle between vLLM's own local processes).

With ``--serve`` (after ``--score-ids``) it stays up and times rounds for whatif's speed
figures (qforensics/whatif/speed.py): each line on stdin is a JSON object ``{"prompts": [token-id
lists], "max_tokens": N, "out": PATH}``; it serves the prompts greedily with exactly N new tokens
each (``ignore_eos``) and writes ``{"seconds": ..., "tokens": [...]}`` to PATH; ``quit`` or the
end of stdin ends it. Prefix caching is off in this mode, so that every round prefills in full.

With ``--bare-hook`` (a baseline for bench/vllm_overhead.py) every vLLM linear layer gets what a
user would write by hand instead of a tool: one forward pre-hook keeping its input's per-channel
absmax on the device, installed in vLLM's worker through ``LLM.apply_model`` (same pickle note).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from qforensics.atomic import write_text

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
    ap.add_argument("--score-ids", metavar="FILE",
                    help="score these token-id lists (JSON) with prompt logprobs instead")
    ap.add_argument("--serve", action="store_true",
                    help="with --score-ids: then time rounds read from stdin (whatif's speed)")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--compiled", action="store_true",
                    help="vLLM's default mode: torch.compile (and CUDA graphs on a GPU) instead "
                         "of enforce_eager")
    ap.add_argument("--bare-hook", action="store_true",
                    help="a per-channel absmax pre-hook on every linear (a baseline)")
    a = ap.parse_args(argv)
    from qforensics.lifeline import watch_parent

    watch_parent()  # started by whatif: end with it (nothing without QFORENSICS_PARENT_PID)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if a.score_ids or a.bare_hook:  # _describe ships one function to vLLM's own worker process (pickle)
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from vllm import LLM, SamplingParams

    llm = LLM(model=a.model, dtype=a.dtype, enforce_eager=not a.compiled, max_model_len=a.max_model_len,
              seed=0, tensor_parallel_size=a.tensor_parallel_size,
              pipeline_parallel_size=a.pipeline_parallel_size,
              gpu_memory_utilization=a.memory_utilization,
              **({"enable_prefix_caching": False} if a.serve else {}))
    if a.score_ids:
        rc = _score(llm, a)
        return _serve_rounds(llm) if a.serve and rc == 0 else rc
    hooked = None
    if a.bare_hook:
        from qforensics.demo import vllm_serve as me  # by package name (see _describe)

        hooked = sum(llm.apply_model(me._bare_hooks))  # type: ignore[attr-defined]
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
    res = {"prompts": prompts, "runs": runs, "pid": os.getpid(), "bare_hooks": hooked}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f)
    for o in runs[-1]["outputs"]:
        print(f"{o['request_id']}: {o['text']!r}")
    sys.stdout.flush()
    return 0


def _score(llm: object, a: argparse.Namespace) -> int:
    from vllm import SamplingParams, TokensPrompt

    with open(a.score_ids) as f:
        id_lists = json.load(f)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=[int(t) for t in ids])
                         for ids in id_lists], params, use_tqdm=False)  # type: ignore[attr-defined]
    scores = []
    for ids, o in zip(id_lists, outs):
        lps, top1 = [], []
        for tok, d in zip(ids[1:], (o.prompt_logprobs or [None])[1:]):
            d = d or {}
            lp = d.get(int(tok))
            lps.append(float(lp.logprob) if lp is not None else float("nan"))
            best = [t for t, v in d.items() if v.rank == 1]
            top1.append(int(best[0]) if best else -1)
        scores.append({"request_id": o.request_id, "token_logprobs": lps, "top1": top1})
    res = {"scores": scores, "seconds": time.perf_counter() - t0, "pid": os.getpid(),
           "engine": _describe(llm)}
    if a.out:
        _write_json(a.out, res)
    return 0


def _write_json(path: str, obj: object) -> None:
    """Write, then rename: a reader polling for ``path`` never sees half a file."""
    write_text(path, json.dumps(obj))


def _serve_rounds(llm: object) -> int:
    """Timed rounds from stdin until ``quit`` or its end (see the module docstring)."""
    from vllm import SamplingParams, TokensPrompt

    while True:
        line = sys.stdin.readline()
        if not line or line.strip() == "quit":
            return 0
        cmd = json.loads(line)
        params = SamplingParams(max_tokens=int(cmd["max_tokens"]), temperature=0.0,
                                ignore_eos=True)
        prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in ids])
                   for ids in cmd["prompts"]]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)  # type: ignore[attr-defined]
        seconds = time.perf_counter() - t0
        _write_json(str(cmd["out"]), {"seconds": seconds, "tokens": [
            len(o.outputs[0].token_ids) for o in outs]})


def _layer_kernels(model: object) -> dict:
    """Runs inside vLLM's worker: which quant method and CPU kernel path the linears use; for
    compressed-tensors also the scheme vLLM picked per layer and the kernel object it holds."""
    methods: dict[str, int] = {}
    schemes: dict[str, int] = {}
    kernels: dict[str, int] = {}
    w4a8: set[bool] = set()

    def count(d: dict[str, int], key: str) -> None:
        d[key] = d.get(key, 0) + 1

    for _name, mod in model.named_modules():  # type: ignore[attr-defined]
        qm = getattr(mod, "quant_method", None)
        if qm is not None and any(c.__name__ == "LinearBase" for c in type(mod).__mro__):
            count(methods, type(qm).__name__)
            if hasattr(mod, "use_w4a8"):
                w4a8.add(bool(mod.use_w4a8))
            scheme = getattr(mod, "scheme", None)
            if scheme is not None:
                count(schemes, type(scheme).__name__)
                for obj in list(vars(scheme).values()) + list(vars(qm).values()):
                    if type(obj).__name__.endswith("Kernel"):
                        count(kernels, type(obj).__name__)
    return {"quant_methods": methods, "use_w4a8": sorted(w4a8), "schemes": schemes,
            "kernels": kernels, **_resident()}


def _resident() -> dict:
    """The engine process's resident memory (VmRSS) and its peak (VmHWM), in bytes, read
    where it runs: vllm-cpu reports no model memory of its own (its CPU model runner skips
    the profiler behind the GPU runners' "Model loading took X GiB")."""
    out = {}
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    out["rss_bytes" if key == "VmRSS" else "peak_rss_bytes"] = \
                        int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass  # not Linux: no figure
    return out


_KEPT: list = []  # the bare hooks' per-channel absmax, kept on the device (in the worker)


def _bare_hooks(model: object) -> int:
    """Runs inside vLLM's worker: a per-channel absmax pre-hook on every vLLM linear layer."""
    def hook(mod: object, args: tuple) -> None:
        x = args[0]
        _KEPT.append(x.detach().abs().amax(dim=tuple(range(x.dim() - 1))))

    n = 0
    for _name, mod in model.named_modules():  # type: ignore[attr-defined]
        if any(c.__name__ == "LinearBase" for c in type(mod).__mro__):
            mod.register_forward_pre_hook(hook)
            n += 1
    return n


def _describe(llm: object) -> dict:
    """vLLM's version and its layers' kernels (best effort: {"error": ...} when unreadable)."""
    import vllm

    out: dict = {"vllm": str(getattr(vllm, "__version__", "unknown"))}
    try:
        # by its package name: run with -m, this module is __main__, which the worker lacks
        from qforensics.demo import vllm_serve as me

        got = llm.apply_model(me._layer_kernels)  # type: ignore[attr-defined]
        out.update(got[0] if got else {})
    except Exception as exc:  # older vLLM, or functions not shippable to the worker
        out["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return out


if __name__ == "__main__":
    raise SystemExit(main())
