"""`VllmAdapter`: what a step, a request and the logits are when vLLM's model runner owns the
model; the capture core (hooks/session.py) talks to it only through hooks/adapter.py.

Differences from a plain HF capture: the model's forward returns hidden states, so a step does
not end there; it ends when the model's `logits_processor` returns the logits (recorded as the
model's output, as in HF where the model returns logits). A forward whose logits never come
(a warm-up or profile run, a non-last pipeline rank) is closed by the next forward or at exit.
Each step also writes its /engine rows: warm-up flag, and for every token row its request,
position and phase; the tokens vLLM sampled follow when the runner returns them.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import numpy as np
import torch
from torch import nn

from qforensics.formats import KIND_LINEAR
from qforensics.hooks import reduce
from qforensics.hooks.adapter import AdapterCalls, EngineAdapter, ModuleRow
from qforensics.hooks.session import Capture
from qforensics.engines.vllm_runner import (
    compile_off,
    max_batch_tokens,
    note_unmapped,
    runner_rows,
    scheduled,
)
from qforensics.trace import schema

log = logging.getLogger(__name__)

ROW_FLAGS_LOGITS = schema.ENGINE_ROW_FLAG_SLOTS["logits"]
ROW_FLAGS_HIDDEN = schema.ENGINE_ROW_FLAG_SLOTS["hidden"]


def vllm_capture(model: nn.Module, path: Any, *, runner: Any, **options: Any) -> Capture:
    """A capture session on the model that `runner` (vLLM's GPU/CPU model runner) owns."""
    return Capture(model, path, adapter=VllmAdapter(runner), **options)


class VllmAdapter(EngineAdapter):
    logits_from_root = False  # the model returns hidden states; the logits processor, logits

    def __init__(self, runner: Any) -> None:
        self._runner = weakref.ref(runner)
        # vLLM compiles the model (its default): the layers get compiled mode's torch-op
        # hooks (hooks/graphmode.py), traced into vLLM's graph
        self._compiled = not compile_off(runner)
        self._tok_rows = max_batch_tokens(runner)
        self._session: "weakref.ref[AdapterCalls] | None" = None
        self._req_index: dict[str, int] = {}
        self._logits_step = -1
        self._hidden: torch.Tensor | None = None
        # what the open step is, for the flight recorder: decode steps carry one row per
        # request, so "more than one token" does not mean prefill here
        self._step_prefill: bool | None = None
        self._step_warmup = False
        self._lm_id: int | None = None

    def compiled(self) -> bool:
        return self._compiled

    def token_rows(self) -> int:
        return self._tok_rows

    def extra_modules(self, model: nn.Module, chosen: list[ModuleRow]) -> list[ModuleRow]:
        """vLLM's lm_head: its logits processor applies it (quant_method.apply), never its
        forward, so no hook sees it; the logits' call is recorded as lm_head's (input: the
        hidden states, output: the logits), so that analyze can name it, and the embedding it
        is tied to (SmolLM2), as the producer of non-finite logits."""
        lm = getattr(model, "lm_head", None)
        if not isinstance(lm, nn.Module) or any(m is lm for _, m, _ in chosen):
            return []
        return [("lm_head", lm, KIND_LINEAR)]

    def attach(self, session: AdapterCalls) -> None:
        self._session = weakref.ref(session)
        model = session.model  # type: ignore[attr-defined]
        lm = getattr(model, "lm_head", None)
        self._lm_id = session.module_id(lm) if isinstance(lm, nn.Module) else None
        lp = getattr(model, "logits_processor", None)
        if isinstance(lp, nn.Module):
            session.hook_output(lp, self.on_logits)
        else:
            note_unmapped(f"{type(model).__name__} has no logits_processor: "
                                   "the logits are not recorded")

    # -- step boundaries -------------------------------------------------------------------------
    def root_returned(self, session: AdapterCalls, output: Any) -> None:
        # hidden states, not logits: the step goes on until the logits processor returns
        if isinstance(output, torch.Tensor):
            self._hidden = output

    def on_logits(self, module: nn.Module, args: tuple, output: Any) -> None:
        cap = self._session() if self._session is not None else None
        if cap is None or not cap.recording or not cap.in_step:
            return  # the sampler's warm-up computes logits without a model forward
        try:
            if isinstance(output, torch.Tensor):
                root_id = cap.root_id
                hidden = args[1] if len(args) > 1 else None
                if self._lm_id is not None and isinstance(hidden, torch.Tensor):
                    ci = cap.new_call()  # lm_head's call: hidden states in, logits out
                    cap.take(ci, self._lm_id, schema.IO_INPUT, 0, hidden)
                    cap.take(ci, self._lm_id, schema.IO_OUTPUT, 0, output)
                ci = cap.new_call()
                cap.take(ci, root_id, schema.IO_OUTPUT, 0, output)
                # Which rows are non-finite, as [rows, 1] 0/1 tensors whose per-token absmax
                # the batched reduction stores (no extra sync): slot ROW_FLAGS_LOGITS per
                # logits row (one per request), slot ROW_FLAGS_HIDDEN per token row.
                for slot, t in ((ROW_FLAGS_LOGITS, output), (ROW_FLAGS_HIDDEN, self._hidden)):
                    if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 1 \
                            and t.numel():
                        cap.take(ci, root_id, schema.IO_OUTPUT, slot, reduce.nonfinite_rows(t))
                cap.set_logits(output)
            self._hidden = None
            self._logits_step = cap.step
            cap.end_step(complete=True)
        except Exception as exc:
            cap.degrade(exc)

    # -- engine meaning --------------------------------------------------------------------------
    def step_began(self, session: AdapterCalls, args: tuple, kwargs: dict) -> None:
        runner = self._runner()
        sched = scheduled(runner) if runner is not None else None
        ids = kwargs.get("input_ids")
        if not isinstance(ids, torch.Tensor):
            ids = next((a for a in args if isinstance(a, torch.Tensor)), None)
        n_rows = int(ids.shape[0]) if isinstance(ids, torch.Tensor) and ids.dim() else 0
        step = session.step
        st = np.zeros(1, schema.engine_dtype("steps"))
        st["step"] = step
        st["n_rows"] = n_rows
        self._step_prefill, self._step_warmup = None, sched is None
        if sched is None:
            st["warmup"] = 1
            session.submit_engine(steps=st)
            return
        req_ids, prompt, req, pos, phase = runner_rows(runner, sched)
        self._step_prefill = bool((np.asarray(phase) == 0).any())
        new = np.zeros(0, schema.engine_dtype("requests"))
        idx = np.empty(len(req_ids), np.int64)
        fresh = []
        for i, rid in enumerate(req_ids):
            j = self._req_index.get(rid)
            if j is None:
                j = self._req_index[rid] = len(self._req_index)
                fresh.append((j, rid, int(prompt[i])))
            idx[i] = j
        if fresh:
            new = np.zeros(len(fresh), schema.engine_dtype("requests"))
            new["request"] = [f[0] for f in fresh]
            new["request_id"] = [f[1].encode("utf-8", "replace")[:64] for f in fresh]
            new["prompt_tokens"] = [f[2] for f in fresh]
            new["first_step"] = step
        rows = np.zeros(len(req), schema.engine_dtype("rows"))
        rows["step"] = step
        rows["row"] = np.arange(len(req))
        rows["request"] = idx[req] if len(req) else 0
        rows["position"] = pos
        rows["phase"] = phase
        st["n_requests"] = len(req_ids)
        session.submit_engine(steps=st, rows=rows, requests=new)

    def step_kind(self) -> dict[str, Any]:
        return {"prefill": self._step_prefill, "warmup": self._step_warmup}

    def on_runner_output(self, out: Any) -> None:
        """The runner's output of the last step: record each request's sampled token(s)."""
        cap = self._session() if self._session is not None else None
        if cap is None or not cap.recording or out is None:
            return
        try:
            if not hasattr(out, "sampled_token_ids") and hasattr(out, "get_output"):
                self._wrap_async(out)
                return
            req_ids = getattr(out, "req_ids", None)
            sampled = getattr(out, "sampled_token_ids", None)
            if not req_ids or sampled is None or self._logits_step < 0:
                return
            rows = []
            for rid, toks in zip(req_ids, sampled):
                j = self._req_index.get(rid)
                if j is None:
                    continue
                for tok in (toks.tolist() if hasattr(toks, "tolist") else list(toks)):
                    rows.append((self._logits_step, j, int(tok)))
            if rows:
                arr = np.zeros(len(rows), schema.engine_dtype("sampled"))
                arr["step"], arr["request"], arr["token"] = zip(*rows)
                cap.submit_engine(sampled=arr)
        except Exception as exc:
            log.warning("qforensics: vLLM sampled tokens not recorded (%s)", exc)

    def _wrap_async(self, out: Any) -> None:
        """Async scheduling: read the tokens when vLLM itself resolves the output."""
        orig = out.get_output
        me = weakref.ref(self)

        def get_output() -> Any:
            res = orig()
            this = me()
            if this is not None:
                this.on_runner_output(res)
            return res

        out.get_output = get_output
