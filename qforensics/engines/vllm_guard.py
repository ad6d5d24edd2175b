"""The runtime NaN/Inf guard inside vLLM's worker (`qforensics record --guard -- python serve.py`).

`VllmGuard` is the HF guard (qforensics.guard: rerun in locate mode, per-layer fallback,
suspect layers on ``torch.where``, circuit breaker) on the model a vLLM model runner owns, with
what vLLM changes:

- **A step is one engine forward.** Its root output is the hidden states, not the logits; the
  guard checks them when the model's forward returns (one on-device sum, one host read), which
  is still inside vLLM's forward context, so a failing forward can be rerun there in locate
  mode. The rerun writes the same KV
  cache slots again (vLLM's paged cache is addressed by the step's slot mapping), so the cache
  ends up holding the repaired keys and values: nothing to roll back.
- **Per-request check of the logits** vLLM computes (a forward hook on the model's
  ``logits_processor``: one reduction and one host read per step, of one count per logits
  row). A request whose model-output rows were non-finite gets one incident
  (``request_repaired``: its rows, its NaN/Inf count, the layer whose fallback repaired it); a
  request whose logits row is still non-finite after every repair gets one incident
  (``request_sanitized``) and its row is sanitized (NaN -> -1e4, +-Inf -> +-1e4), so the
  sampler never sees NaN.
- **Fallbacks through vLLM's layers** (``VLLM_FALLBACKS``, tried before the generic ones): the
  AWQ/GPTQ layers vLLM's CPU W4A16 kernel holds (repacked at load) are dequantized with the
  ``vllm-cpu-w4a16`` layout (qforensics.layouts.vllm_cpu), which undoes the repack; any
  other vLLM linear (the W4A8 blocked layout on AMX CPUs, Marlin, FP8, unquantized) is
  dequantized through its own quantization method, ``quant_method.apply(layer, I)`` on an
  identity input (one GEMM of K x K x N, once). Either way once, on the layer's first trip, to
  the activation dtype. A NaN/Inf group scale in the checkpoint is re-estimated from its output
  column's other scales; whatever still comes out non-finite is set to 0; the incident
  ``dequantized`` says how, how long and what was replaced (engines.vllm_fallbacks).
- **Warm-up forwards** (vLLM's profile and dummy runs, no scheduler output) are never checked.
- **The engine never crashes**: any error inside the guard turns it off (passive) with one
  stderr line and an incident ``guard_off``; ``on_unrecoverable="raise"`` becomes sanitizing.

Tensor parallelism: every rank runs its own guard. The hidden states a forward returns are the
same on every rank (after the row-parallel all-reduce), so all ranks decide alike to rerun a
step in locate mode, and the rerun's collectives match. A column-parallel layer (qkv_proj,
gate_up_proj) trips on the rank whose shard produced the NaN and falls back there on that
shard alone. A row-parallel layer (o_proj, down_proj) is complete only after vLLM's all-reduce,
so it is guarded one level lower, on this rank's partial output before the reduce
(engines.vllm_tp): the rank whose shard produced the NaN repairs its partial, and the
all-reduce sums repaired partials. A
failing step is rerun at most once under TP: a second rerun would be decided by this rank's own
trips, and a rank rerunning alone would wait forever in the rerun's collectives.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any

import numpy as np
import torch
from torch import nn

from qforensics.engines import vllm_tp
from qforensics.engines.vllm_fallbacks import (
    VLLM_FALLBACKS,
    VllmLinearFallback,
    is_vllm_linear,
)
from qforensics.engines.vllm_runner import compile_off, runner_rows, scheduled
from qforensics.engines.vllm_tp import needs_pre_reduce
from qforensics.guard.fallbacks import Fallback, choose_fallback
from qforensics.hooks import reduce
from qforensics.guard.outputs import fetch, split_output
from qforensics.guard.policy import GuardPolicy, resolve_policy
from qforensics.guard.runtime import Guard
from qforensics.guard.steps import HEALTHY

__all__ = ["VllmGuard", "install_guard"]

REQUEST = "(request)"  # module name of per-request incidents
_MAX_NAMED = 1 << 16


class VllmGuard(Guard):
    """The guard on a vLLM runner's model (see the module docstring). Created by
    `install_guard` in the worker, right after capture attaches."""

    def __init__(self, model: nn.Module, policy: GuardPolicy, runner: Any) -> None:
        super().__init__(model, policy)
        self._runner = runner
        self._sched: Any = None  # the scheduler output of this forward (None: warm-up)
        self._row_counts: np.ndarray | None = None  # [rows, 2] NaN/Inf of the first pass
        self._layer_rows: torch.Tensor | None = None  # [rows, 2] NaN/Inf of suspect layers
        self._named: dict[str, None] = {}  # requests already reported repaired
        self._unrepaired = ""
        self._said_off = False
        self._pre: set[int] = set()  # row-parallel layers guarded before the all-reduce
        self._put_back: list = []
        try:
            self._act_dtype = runner.vllm_config.model_config.dtype
        except Exception:
            self._act_dtype = torch.bfloat16

    # -- set-up ----------------------------------------------------------------------------
    def _choose_fallback(self, name: str, module: nn.Module) -> tuple[Fallback | None, str]:
        if is_vllm_linear(name, module):
            reasons = []
            pre = needs_pre_reduce(module)  # row-parallel under TP: its partial (vllm_tp)
            for cls in VLLM_FALLBACKS:
                ok, why = cls.can_take(module, pre_reduce=pre)
                if ok:
                    fb = cls(module, self.policy)
                    fb.pre_reduce = pre
                    return fb, ""
                reasons.append(f"{cls.layout}: {why}")
            return None, f"no fallback for {type(module).__name__} ({'; '.join(reasons)})"
        return choose_fallback(name, module, self.policy)

    def attach(self) -> None:
        super().attach()
        self._pre = {i for i, fb in enumerate(self._fallbacks) if getattr(fb, "pre_reduce", False)}
        self._put_back = vllm_tp.install(self)
        tp = max((int(getattr(m, "tp_size", 1) or 1) for m in self._modules), default=1)
        if tp > 1 and self.policy.max_reruns > 1:
            # every rank must rerun the same number of times (each rerun runs vLLM's
            # collectives): the first rerun follows the hidden states, the same on every rank,
            # but a second one would follow this rank's own trips
            self.policy = dataclasses.replace(self.policy, max_reruns=1)
        lp = getattr(self.model, "logits_processor", None)
        if isinstance(lp, nn.Module):
            # prepend: the sampler and the capture see the checked (sanitized) logits
            self._root_handles.append(lp.register_forward_hook(self._on_logits, prepend=True))
        else:
            sys.stderr.write(f"qforensics: vLLM guard: {type(self.model).__name__} has no "
                             "logits_processor: no per-request logits check\n")

    def close(self) -> None:
        vllm_tp.uninstall(getattr(self, "_put_back", []))
        self._put_back = []
        super().close()

    # -- step boundaries -------------------------------------------------------------------
    def _on_root_pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        super()._on_root_pre(module, args, kwargs)
        if self._depth == 1:
            self._sched = scheduled(self._runner)
            self._row_counts = None
            self._layer_rows = None
            self._unrepaired = ""

    def _on_module(self, i: int, module: nn.Module, args: tuple, kwargs: dict,
                   result: Any) -> Any:
        if i in self._pre:
            return None  # after vLLM's all-reduce: this layer is guarded in on_partial
        if not self._count_rows(i, result):
            return None
        return super()._on_module(i, module, args, kwargs, result)

    def on_partial(self, i: int, module: nn.Module, x: Any, partial: Any) -> Any:
        """A row-parallel layer's partial output on this rank, before vLLM's all-reduce
        (engines.vllm_tp): checked, located and repaired like a layer's output."""
        if not self._count_rows(i, partial):
            return partial
        got = super()._on_module(i, module, (x,), {}, partial)
        return partial if got is None else got

    def _count_rows(self, i: int, result: Any) -> bool:
        """A suspect layer: NaN / Inf per token row of its quantized output, on device, read
        with the step's one host read (which requests its fallback repaired). False when the
        guard just failed."""
        if self._state[i] != HEALTHY and self._sched is not None and self._in_step \
                and not self._locating and not self._failed:
            raw, _ = split_output(result)
            if raw is not None and raw.dim() >= 2:
                try:
                    t = raw.detach().reshape(-1, raw.shape[-1])
                    c = torch.stack([torch.isnan(t).sum(-1), torch.isinf(t).sum(-1)], -1)
                    prev = self._layer_rows
                    self._layer_rows = c if prev is None or prev.shape != c.shape else prev + c
                except Exception as exc:
                    self._fail(exc)
                    return False
        return True

    def _end_step(self, module: nn.Module, output: Any) -> Any:
        if self._sched is None:  # warm-up / profile / dummy run: never checked
            self._flags, self._counts = [], []
            return None
        return super()._end_step(module, output)

    def _read(self, logits: torch.Tensor | None) -> tuple[bool, list[tuple[int, bool]]]:
        ok, bad = super()._read(logits)
        if not ok and logits is not None and self._row_counts is None and logits.dim() >= 1:
            # the first pass of a failing step: NaN / Inf per token row (failing steps only)
            t = logits.detach().reshape(logits.shape[0], -1)
            both = torch.stack([torch.isnan(t).sum(-1), torch.isinf(t).sum(-1)], -1)
            self._row_counts = both.cpu().numpy()
            self.stats.host_syncs += 1
        return ok, bad

    def _sanitize(self, output: Any, logits: torch.Tensor, why: str) -> Any:
        # the root output is the hidden states: leave them; the logits hook sanitizes the
        # logits rows of the requests that stayed non-finite
        self._unrepaired = why or "the rerun is still non-finite"
        return output

    def _trip(self, i: int, nan: int, inf: int, action: str, detail: str) -> None:
        super()._trip(i, nan, inf, action, detail)
        fb = self._fallbacks[i]
        if isinstance(fb, VllmLinearFallback) and not fb.materialized:
            fb.weight_for(self._act_dtype)  # once, on the first trip
            self._incident(self.names[i], "dequantized", 0, 0, fb.summary())

    # -- the logits vLLM computes ----------------------------------------------------------
    def _on_logits(self, module: nn.Module, args: tuple, output: Any) -> Any:
        sched, self._sched = self._sched, None
        layer_rows, self._layer_rows = self._layer_rows, None
        if self._failed or sched is None or not isinstance(output, torch.Tensor) \
                or not output.is_floating_point() or output.dim() != 2:
            return None
        try:
            # 1 for a row with a NaN or Inf (~10x cheaper than isfinite on bf16 logits); exact
            # counts only on a failing step
            flag = reduce.nonfinite_rows(output).reshape(-1)
            parts = [flag] if layer_rows is None else [flag, layer_rows]
            vals = fetch(parts)  # one host read per step
            self.stats.host_syncs += 1
            n = int(flag.numel())
            counts = [0] * n
            if any(vals[:n]):
                counts = [int(v) for v in (~torch.isfinite(output)).sum(-1).tolist()]
                self.stats.host_syncs += 1
            rows = np.asarray(vals[n:], np.int64).reshape(-1, 2) if layer_rows is not None \
                else None
            if not any(counts) and self._row_counts is None and (rows is None or not rows.any()):
                return None
            return self._report_requests(sched, output, counts, rows)
        except Exception as exc:
            self._fail(exc)
            return None

    def _report_requests(self, sched: Any, logits: torch.Tensor, counts: list[int],
                         layer_rows: np.ndarray | None) -> Any:
        req_ids, _prompt, req, _pos, _phase = runner_rows(self._runner, sched)
        n = len(req_ids)
        tripped = [self.names[i] for i in sorted(self._tripped)]
        fixer = f"the fallback of {', '.join(tripped)}" if tripped else "a layer's fallback"
        sources = (("the model output", self._row_counts),
                   (f"the output of {', '.join(tripped) or 'a suspect layer'}", layer_rows))
        for where, rc in sources:
            if rc is None or not len(req):
                continue
            rc = rc[: len(req)]
            r = req[: len(rc)]
            nan = np.bincount(r, weights=rc[:, 0], minlength=n)
            inf = np.bincount(r, weights=rc[:, 1], minlength=n)
            nbad = np.bincount(r, weights=(rc.sum(-1) > 0), minlength=n)
            nrows = np.bincount(req, minlength=n)
            for j in np.flatnonzero(nbad):
                rid = req_ids[j]
                if rid in self._named or (j < len(counts) and counts[j]):
                    continue  # named before, or still non-finite: sanitized below
                self._name(rid)
                self._incident(REQUEST, "request_repaired", int(nan[j]), int(inf[j]),
                               f"request {rid}: {int(nbad[j])} of {int(nrows[j])} token rows "
                               f"non-finite in {where}; repaired by {fixer}")
        if not any(counts):
            return None
        nan_rows = torch.isnan(logits).sum(-1).tolist()
        vocab = int(logits.shape[-1])
        why = self._unrepaired or "non-finite logits from an op the guard does not cover"
        for j, c in enumerate(counts):
            if not c:
                continue
            rid = req_ids[j] if len(counts) == n else f"logits row {j}"
            self.stats.sanitized_steps += 1
            self._incident(REQUEST, "request_sanitized", int(nan_rows[j]), c - int(nan_rows[j]),
                           f"request {rid}: {c} of {vocab} logits NaN/Inf; sanitized: {why}")
        if not self._warned_sanitize:
            self._warned_sanitize = True
            sys.stderr.write(f"qforensics: vLLM guard: step {self.step}: non-finite logits "
                             f"sanitized for {sum(1 for c in counts if c)} request(s) (last "
                             "resort; every one is an incident)\n")
        v = min(float(self.policy.sanitize_value), torch.finfo(logits.dtype).max)
        return torch.nan_to_num(logits, nan=-v, posinf=v, neginf=-v)

    def _name(self, rid: str) -> None:
        """Remember that a request was reported repaired (bounded: a long-running server)."""
        self._named[rid] = None
        if len(self._named) > _MAX_NAMED:
            self._named.pop(next(iter(self._named)))

    # -- failures --------------------------------------------------------------------------
    def _fail(self, exc: BaseException) -> None:
        first = self._failed is None
        super()._fail(exc)
        if first and not self._said_off:
            self._said_off = True
            sys.stderr.write(f"qforensics: vLLM guard off after an internal error "
                             f"({self._failed}); the engine goes on unguarded\n")
            try:
                self._incident("(guard)", "guard_off", 0, 0, f"internal error: {self._failed}")
            except Exception:
                pass


def _policy_from_env(raw: str) -> dict[str, Any]:
    try:
        pol = json.loads(raw)
    except json.JSONDecodeError:
        pol = None
    pol = dict(pol) if isinstance(pol, dict) else {}
    if pol.get("on_unrecoverable") == "raise":
        sys.stderr.write("qforensics: vLLM guard: on_unrecoverable='raise' would stop the "
                         "engine; sanitizing instead\n")
    pol["on_unrecoverable"] = "sanitize"
    pol.setdefault("modules", is_vllm_linear)
    return pol


def install_guard(runner: Any, model: nn.Module) -> VllmGuard | None:
    """Attach `VllmGuard` to the runner's model when QFORENSICS_GUARD is set (`record --guard`:
    a JSON object of guard policy fields). Never raises: a failure is one stderr line."""
    raw = os.environ.get("QFORENSICS_GUARD")
    if not raw:
        return None
    pol = _policy_from_env(raw)
    if not compile_off(runner):
        # vLLM compiles the model: hooks added to its layers after the compile never run, and
        # a rerun replays the compiled graph, which no layer swap reaches. What works there is
        # the per-request logits check and sanitizing (outside the graph).
        pol["check"], pol["max_reruns"] = "logits", 0
        sys.stderr.write("qforensics: vLLM guard in compiled mode: per-request logits check "
                         "and sanitizing only (locating a layer and its fallback rerun need "
                         "record --eager)\n")
    try:
        g = VllmGuard(model, resolve_policy(pol), runner)
        g.attach()
    except Exception as exc:
        sys.stderr.write(f"qforensics: vLLM guard not installed: {type(exc).__name__}: {exc}\n")
        return None
    kinds: dict[str, int] = {}
    for _, fb in g.guarded:
        key = fb.layout if fb is not None else "no fallback"
        kinds[key] = kinds.get(key, 0) + 1
    sys.stderr.write(f"qforensics: vLLM guard on {len(g.names)} layers ("
                     + ", ".join(f"{n} x {k}" for k, n in kinds.items()) + ")\n")
    no_fb = [n for n, (_, f) in zip(g.names, g.guarded) if f is None]
    if no_fb:
        sys.stderr.write(f"qforensics: vLLM guard: no fallback for {no_fb[0]}: "
                         f"{g.no_fallback_reason(no_fb[0])}\n")
    return g
