"""Per-layer fallbacks of the vLLM guard (qforensics.engines.vllm_guard): the dense weight of one
vLLM linear layer, built once on its first trip, from what vLLM holds after loading.

- `VllmCpuW4A16`: the AWQ/GPTQ layers vLLM's CPU W4A16 kernel runs (``CPUWNA16LinearKernel``,
  ``use_w4a8`` False) hold ``qweight`` repacked at load into [N/16, 2K]; replay's
  ``vllm-cpu-w4a16`` layout (qforensics.layouts.vllm_cpu) undoes the repack.
- `VllmMethodProbe`: any other vLLM linear (the W4A8 blocked layout on AMX CPUs, Marlin, FP8,
  unquantized): the layer's own quantization method on an identity input,
  ``quant_method.apply(layer, I_K, bias=None)`` = W^T (one K x K x N GEMM, once).

Both keep the weight in the activation dtype (one layer's memory) and set the entries that come
out non-finite (a NaN/Inf scale or weight in the checkpoint) to 0, counting them in ``zeroed``.
Under tensor parallelism a layer whose output is this rank's own slice (column-parallel,
vLLM's qkv_proj and gate_up_proj) falls back on this rank's shard alone. A row-parallel layer
(o_proj, down_proj) is complete only after vLLM's all-reduce: its fallback (``pre_reduce``)
stands in for this rank's partial output before the reduce (engines.vllm_tp).
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import numpy as np
import torch
from torch import nn

from qforensics.guard.fallbacks import Fallback, dense_linear
from qforensics.guard.policy import GuardPolicy
from qforensics.layouts import LAYOUTS

__all__ = ["VLLM_FALLBACKS", "VllmCpuW4A16", "VllmLinearFallback", "VllmMethodProbe",
           "is_vllm_linear", "local_output", "parallel_kind"]

_MAX_PROBE_K = 1 << 16  # an identity probe of a wider input would not be "one layer's memory"


def is_vllm_linear(name: str, module: nn.Module) -> bool:
    """A vLLM linear layer (a ``vllm...linear.LinearBase``, matched without importing vLLM):
    it has a quantization method and partition sizes. Embeddings and the LM head are not."""
    return (any(c.__name__ == "LinearBase" and c.__module__.startswith("vllm")
                for c in type(module).__mro__)
            and getattr(module, "quant_method", None) is not None
            and isinstance(getattr(module, "input_size_per_partition", None), int))


def local_output(module: nn.Module) -> bool:
    """Whether a tensor-parallel layer's output is this rank's own work, with no collective
    inside its forward: a column-parallel layer that does not gather its output (vLLM's
    QKVParallelLinear and MergedColumnParallelLinear: each rank computes its slice of the
    output columns from the whole input), or a row-parallel one that leaves the all-reduce to
    its caller. Then this rank's dense shard stands in for the layer on this rank alone."""
    kind = parallel_kind(module)
    if kind == "column":
        return getattr(module, "gather_output", True) is False
    if kind == "row":
        return getattr(module, "reduce_results", True) is False
    return False


def parallel_kind(module: nn.Module) -> str | None:
    """"column" / "row" for vLLM's ColumnParallelLinear / RowParallelLinear (and subclasses:
    QKVParallelLinear, MergedColumnParallelLinear), matched by class name; else None."""
    names = {c.__name__ for c in type(module).__mro__}
    return ("column" if "ColumnParallelLinear" in names else
            "row" if "RowParallelLinear" in names else None)


class VllmLinearFallback(Fallback):
    """Base of the vLLM layer fallbacks: the dense weight [N, K] of this rank's partition, its
    non-finite entries zeroed (counted in ``zeroed``), the layer's bias unless vLLM returns it
    separately (``skip_bias_add``)."""

    layout = "vLLM"
    short = "vLLM"

    def __init__(self, module: nn.Module, policy: GuardPolicy) -> None:
        super().__init__(module, policy)
        self.pre_reduce = False  # stands in for a row-parallel shard's partial (vllm_tp)
        self.zeroed = 0  # dense weight entries that came out non-finite, set to 0
        self.imputed = 0  # non-finite group scales estimated from their column (W4A16)
        self.params_zeroed = 0  # non-finite parameter entries the identity probe ran with as 0
        self.seconds = 0.0

    @staticmethod
    def layer_ok(module: nn.Module, pre_reduce: bool = False) -> tuple[bool, str]:
        """``pre_reduce``: the guard stands in for the layer's partial output before vLLM's
        all-reduce (engines.vllm_tp), so a row-parallel shard qualifies."""
        if not is_vllm_linear("", module):
            return False, "not a vLLM linear"
        tp = int(getattr(module, "tp_size", 1) or 1)
        if tp > 1 and not local_output(module) and not pre_reduce:
            return False, (f"it is sharded over {tp} tensor-parallel ranks and its output is "
                           "complete only after vLLM's all-reduce (row-parallel) or gather")
        return True, ""

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] (may hold non-finite entries)."""
        raise NotImplementedError

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        t0 = time.perf_counter()
        w = self.dequantize()
        bad = ~torch.isfinite(w)
        self.zeroed = int(bad.sum())
        if self.zeroed:
            w = torch.where(bad, torch.zeros_like(w), w)
        self.seconds = time.perf_counter() - t0
        return w.to(dtype).contiguous()

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        m = self.module
        b = getattr(m, "bias", None)
        bias = b.detach() if isinstance(b, torch.Tensor) and b.is_floating_point() and not \
            getattr(m, "skip_bias_add", False) else None
        if self.pre_reduce and int(getattr(m, "tp_rank", 0) or 0) != 0:
            bias = None  # a row-parallel layer adds its bias on rank 0 only, before the reduce
        act = x.dtype if x.is_floating_point() else out_dtype
        return dense_linear(self.weight_for(act), bias, x, out_dtype)

    def summary(self) -> str:
        shape = list(self._dense.shape) if self._dense is not None else "?"
        what = f"{self.short}: dense {shape} in {1000 * self.seconds:.0f} ms"
        if self.imputed:
            what += f"; {self.imputed} NaN/Inf group scale(s) -> their column's median"
        if self.params_zeroed:
            what += f"; {self.params_zeroed} NaN/Inf scale/weight entries -> 0"
        if self.zeroed:
            what += f"; {self.zeroed} NaN/Inf weights -> 0"
        return what


class VllmCpuW4A16(VllmLinearFallback):
    """vLLM's CPU W4A16 layer (``CPUWNA16LinearKernel`` with ``use_w4a8`` False): ``qweight``
    int32 [N/16, 2K] as repacked at load, ``scales`` [K/G, N], ``qzeros`` [K/G, N/8] (AWQ) or
    none (GPTQ uint4b8); read with replay's ``vllm-cpu-w4a16`` layout adapter."""

    layout = "vLLM CPU W4A16 repack (replay layout vllm-cpu-w4a16)"
    short = "vllm-cpu-w4a16 layout"

    @classmethod
    def can_take(cls, module: nn.Module, pre_reduce: bool = False) -> tuple[bool, str]:
        ok, why = cls.layer_ok(module, pre_reduce)
        if not ok:
            return ok, why
        if getattr(module, "use_w4a8", None) is not False:
            return False, "not vLLM's CPU W4A16 layout"
        gi = getattr(module, "g_idx", None)
        if isinstance(gi, torch.Tensor) and gi.numel():
            return False, "act-order (g_idx) is not read by the vllm-cpu-w4a16 layout"
        tensors, meta = cls._tensors(module, shapes_only=True)
        if tensors is None:
            return False, "it has no qweight / scales"
        why = LAYOUTS["vllm-cpu-w4a16"].can_take(tensors, meta)
        return (not why), why

    @staticmethod
    def _tensors(module: nn.Module, shapes_only: bool = False
                 ) -> tuple[dict[str, np.ndarray] | None, dict[str, Any]]:
        qw, sc = getattr(module, "qweight", None), getattr(module, "scales", None)
        if not isinstance(qw, torch.Tensor) or not isinstance(sc, torch.Tensor):
            return None, {}
        qz = getattr(module, "qzeros", None)
        k = int(module.input_size_per_partition)
        group = getattr(getattr(module.quant_method, "quant_config", None), "group_size", None)
        if not isinstance(group, int) or group <= 0:
            group = k // sc.shape[0] if sc.dim() == 2 and sc.shape[0] else -1
        meta = {"K": k, "group_size": group}

        def arr(t: torch.Tensor) -> np.ndarray:
            if shapes_only:  # what the layout's check reads: dtype kind, ndim, shape
                return np.empty(tuple(t.shape), np.int32 if not t.is_floating_point()
                                else np.float32)
            t = t.detach().cpu()  # a copy below: the estimate never touches vLLM's tensors
            return (t.float() if t.is_floating_point() else t.to(torch.int32)).numpy().copy()

        out = {"qweight": arr(qw), "scales": arr(sc)}
        if isinstance(qz, torch.Tensor):
            out["qzeros"] = arr(qz)
        return out, meta

    def dequantize(self) -> torch.Tensor:
        tensors, meta = self._tensors(self.module)
        sc = tensors["scales"]  # [K/G, N] float32 (a copy)
        bad = ~np.isfinite(sc)
        if bad.any():
            # a NaN/Inf group scale: estimated by the median of the finite scales of the same
            # output column (the 4-bit values and zero points are intact; only the group's
            # magnitude is lost). A column with no finite scale stays non-finite -> zeroed.
            with warnings.catch_warnings():  # an all-NaN column: its median is NaN
                warnings.simplefilter("ignore", RuntimeWarning)
                col = np.nanmedian(np.where(bad, np.nan, sc), axis=0)
            fill = np.broadcast_to(col, sc.shape)
            fixed = bad & np.isfinite(fill)
            sc[fixed] = fill[fixed]
            self.imputed = int(fixed.sum())
        w_kn = LAYOUTS["vllm-cpu-w4a16"].weight_kn(tensors, meta)  # float64 [K, N]
        return torch.from_numpy(w_kn.T.astype(np.float32)).to(self.module.qweight.device)


class VllmMethodProbe(VllmLinearFallback):
    """Any other vLLM linear: its dense weight is what its own quantization method computes for
    an identity input, ``quant_method.apply(layer, I_K, bias=None)`` = W^T (exact for weight-only
    kernels; W8A8 kernels quantize each identity row exactly too)."""

    layout = "the layer's quant method on an identity input"
    short = "quant method on identity"

    @classmethod
    def can_take(cls, module: nn.Module, pre_reduce: bool = False) -> tuple[bool, str]:
        ok, why = cls.layer_ok(module, pre_reduce)
        if not ok:
            return ok, why
        if not callable(getattr(module.quant_method, "apply", None)):
            return False, f"its quant method {type(module.quant_method).__name__} has no apply"
        if module.input_size_per_partition > _MAX_PROBE_K:
            return False, f"K={module.input_size_per_partition} is too wide for an identity probe"
        return True, ""

    def _probe(self) -> torch.Tensor:
        """W^T [K, N] float32: the layer's quant method on I_K."""
        m = self.module
        k = int(m.input_size_per_partition)
        dt = getattr(m, "params_dtype", None)
        dt = dt if isinstance(dt, torch.dtype) and dt.is_floating_point else torch.bfloat16
        dev = next((p.device for p in m.parameters()), torch.device("cpu"))
        qm = getattr(m.quant_method, "inner", m.quant_method)  # never through the guard's proxy
        y = qm.apply(m, torch.eye(k, dtype=dt, device=dev), None)
        return (y[0] if isinstance(y, (tuple, list)) else y).float()

    def dequantize(self) -> torch.Tensor:
        # A kernel that sums scaled group partials (W4A8) turns ONE non-finite scale into a
        # non-finite column for every input row (Inf x 0). So the probe runs with the layer's
        # non-finite float parameter entries set to 0 (that group drops out; every other weight
        # comes out exact), and the entries are put back right after, whatever happens. For a
        # group-scaled layer whose bad entries are scales, a second probe with every scale set
        # to 1 reads the integer weights (q - z); each group's scale is then W / (q - z), and a
        # dropped group's scale is estimated like the W4A16 path does: its column's median.
        m = self.module
        saved: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        with torch.no_grad():
            try:
                for p in [*m.parameters(recurse=False), *m.buffers(recurse=False)]:
                    if p.is_floating_point() and p.numel():
                        bad = ~torch.isfinite(p)
                        if bool(bad.any()):
                            saved.append((p, bad, p[bad].clone()))
                            p[bad] = 0
                self.params_zeroed = sum(int(b.sum()) for _, b, _ in saved)
                w0 = self._probe()  # [K, N]
                sc = getattr(m, "scales", None)
                group = getattr(getattr(m.quant_method, "quant_config", None), "group_size", 0)
                if saved and isinstance(sc, torch.Tensor) and any(p is sc for p, _, _ in saved) \
                        and isinstance(group, int) and group > 0 \
                        and w0.shape[0] % group == 0:
                    keep = sc.clone()
                    try:
                        sc.fill_(1.0)
                        ints = self._probe().round()  # q - z, [K, N]
                    finally:
                        sc.copy_(keep)
                    w0 = self._impute(w0, ints, group)
            finally:
                for p, bad, vals in saved:
                    p[bad] = vals
        return w0.t()  # [N, K]

    def _impute(self, w0: torch.Tensor, ints: torch.Tensor, group: int) -> torch.Tensor:
        """Each group's scale W / (q - z); groups whose weights all came out 0 while their
        integers are not (the dropped ones) get their column's median scale."""
        k, n = w0.shape
        wg = w0.reshape(k // group, group, n)
        ig = ints.reshape(k // group, group, n)
        nz = ig != 0
        ratio = torch.where(nz, wg / torch.where(nz, ig, torch.ones_like(ig)),
                            torch.full_like(wg, float("nan")))
        s = ratio.nanmedian(1).values  # [G, N]; NaN: a group of all-zero integers
        dropped = nz.any(1) & ~(wg != 0).any(1)
        if not bool(dropped.any()):
            return w0
        col = torch.where(dropped, torch.full_like(s, float("nan")), s).nanmedian(0).values
        fill = dropped & torch.isfinite(col).expand_as(dropped)
        self.imputed = int(fill.sum())
        est = torch.where(fill, col.expand_as(s), torch.zeros_like(s))  # [G, N]
        return torch.where(fill[:, None, :], ig * est[:, None, :], wg).reshape(k, n)


VLLM_FALLBACKS: list[type[VllmLinearFallback]] = [VllmCpuW4A16, VllmMethodProbe]
