"""Fallbacks for quantized weight layouts: each dequantizes its layer's packed weight ONCE, on
the layer's first trip, to the activation dtype (one layer's memory), following the layout the
library publishes; the guard then runs the layer dense.

- `AwqGemm`: AutoAWQ ``WQLinear_GEMM``: ``qweight`` int32 [K, N/8] (4-bit, AWQ's nibble order
  [0, 2, 4, 6, 1, 3, 5, 7] inside each int32), ``qzeros`` int32 [K/G, N/8] in the same order,
  ``scales`` [K/G, N].  W[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n].
- `GptqPacked`: GPTQ / AutoGPTQ / GPTQModel ``QuantLinear``: ``qweight`` int32 [K*b/32, N]
  packed sequentially along K, ``qzeros`` int32 [K/G, N*b/32] packed along N holding zero - 1
  (the v1 checkpoint format; ``qzero_format == 2`` or ``checkpoint_format == "gptq_v2"``: the
  zero itself), ``scales`` [K/G, N], ``g_idx`` [K] (the group of each input row: act-order).
- `CompressedPacked`: compressed-tensors ``pack-quantized`` (W4A16 and other int widths):
  ``weight_packed`` int32 [N, ceil(K*b/32)] densely bit-packed along K, each value stored
  offset by 2**(b-1), ``weight_scale`` [N, K/G] (or [N, 1] per channel), optional
  ``weight_zero_point`` packed along N, ``weight_shape`` [2].
- `Fp8Weight`: float8 weight (e4m3 / e5m2) with ``weight_scale``: per tensor, per output
  channel, or per [bn, bk] block (``weight_block_size``). The activation is quantized as the
  layer's kernel does, but saturating: with a static ``input_scale`` to ±448·input_scale, without
  one (dynamic) per token; so the fallback matches the layer wherever the layer was finite.
- `BitsAndBytes4bit` / `BitsAndBytes8bit`: bitsandbytes ``Linear4bit`` (NF4 / FP4, dequantized
  by the library's own ``dequantize_4bit``) and ``Linear8bitLt`` (int8 ``CB`` with per-row
  ``SCB``: W = CB * SCB / 127).
- `QuantoWeight`: optimum-quanto ``QLinear`` (qint2/4/8, qfloat8 weights), dequantized by the
  library's own ``QTensor.dequantize``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from qforensics.guard.fallbacks import Fallback

__all__ = [
    "QUANTIZED_FALLBACKS",
    "AwqGemm",
    "BitsAndBytes4bit",
    "BitsAndBytes8bit",
    "CompressedPacked",
    "Fp8Weight",
    "GptqPacked",
    "QuantoWeight",
    "unpack_int32",
]

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # logical column of nibble i inside an AWQ int32
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _tensor(module: nn.Module, name: str) -> torch.Tensor | None:
    t = getattr(module, name, None)
    return t if isinstance(t, torch.Tensor) else None


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned ``bits``-wide values packed sequentially into int32 along ``dim`` (value i of a
    word in bits [i*b, (i+1)*b)), unpacked along that dim (int32; 32 / bits values per word)."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, device=packed.device, dtype=torch.int32)
    mask = (1 << bits) - 1
    p = packed.to(torch.int32).movedim(dim, -1)
    vals = (p.unsqueeze(-1) >> shifts) & mask  # [..., words, per]
    vals = vals.reshape(*p.shape[:-1], p.shape[-1] * per)
    return vals.movedim(-1, dim)


def _bits_of(module: nn.Module, default: int = 4) -> int:
    for attr in ("w_bit", "bits", "wbits", "num_bits"):
        v = getattr(module, attr, None)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return default


def _need(module: nn.Module, names: tuple[str, ...]) -> str:
    missing = [n for n in names if _tensor(module, n) is None]
    return f"it has no {', '.join(missing)}" if missing else ""


class AwqGemm(Fallback):
    layout = "AWQ GEMM"

    @classmethod
    def can_take(cls, module: nn.Module) -> tuple[bool, str]:
        if "WQLinear" not in type(module).__name__:
            return False, "not a WQLinear"
        why = _need(module, ("qweight", "qzeros", "scales"))
        if why:
            return False, why
        if _bits_of(module) != 4:
            return False, f"{_bits_of(module)}-bit AWQ is not supported (4-bit only)"
        qw, sc = module.qweight, module.scales
        if qw.dim() != 2 or sc.dim() != 2 or qw.shape[1] * 8 != sc.shape[1] \
                or sc.shape[0] == 0 or qw.shape[0] % sc.shape[0]:
            return False, (f"qweight {tuple(qw.shape)} / scales {tuple(sc.shape)} are not the "
                           "GEMM layout [K, N/8] / [K/G, N] (GEMV layout is not supported)")
        return True, ""

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        m = self.module
        order = torch.tensor([AWQ_ORDER.index(c) for c in range(8)], device=m.qweight.device)

        def unpack(p: torch.Tensor) -> torch.Tensor:  # [R, N/8] -> [R, N], logical columns
            v = unpack_int32(p, 4, 1).reshape(p.shape[0], p.shape[1], 8)
            return v[:, :, order].reshape(p.shape[0], -1)

        q, z = unpack(m.qweight), unpack(m.qzeros)
        g = q.shape[0] // m.scales.shape[0]
        s = m.scales.float().repeat_interleave(g, 0)
        w = (q - z.repeat_interleave(g, 0)).float() * s  # [K, N]
        return w.t().contiguous().to(dtype)


class GptqPacked(Fallback):
    layout = "GPTQ"

    @classmethod
    def can_take(cls, module: nn.Module) -> tuple[bool, str]:
        if _tensor(module, "qweight") is None or "WQLinear" in type(module).__name__:
            return False, "not a GPTQ layer"
        why = _need(module, ("qzeros", "scales"))
        if why:
            return False, why
        bits = _bits_of(module)
        if bits not in (2, 4, 8):
            return False, f"{bits}-bit GPTQ is not supported (2, 4 or 8)"
        qw, sc = module.qweight, module.scales
        k = qw.shape[0] * 32 // bits
        if qw.dim() != 2 or sc.dim() != 2 or qw.shape[1] != sc.shape[1]:
            return False, (f"qweight {tuple(qw.shape)} / scales {tuple(sc.shape)} are not the "
                           "GPTQ layout [K*b/32, N] / [K/G, N] (Marlin/ExLlama repacked weights "
                           "are not supported)")
        gi = _tensor(module, "g_idx")
        if gi is not None and gi.numel() != k:
            return False, f"g_idx has {gi.numel()} entries for K={k}"
        if gi is None and (sc.shape[0] == 0 or k % sc.shape[0]):
            return False, f"K={k} is not a multiple of the {sc.shape[0]} scale groups"
        return True, ""

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        m = self.module
        bits = _bits_of(m)
        q = unpack_int32(m.qweight, bits, 0)  # [K, N]
        z = unpack_int32(m.qzeros, bits, 1)[:, : q.shape[1]]  # [K/G, N]
        v2 = getattr(m, "qzero_format", 1) == 2 or \
            str(getattr(m, "checkpoint_format", "")).endswith("v2")
        if not v2:
            z = z + 1  # v1: the checkpoint stores zero - 1
        gi = _tensor(m, "g_idx")
        if gi is None:
            gi = torch.arange(q.shape[0], device=q.device) // (q.shape[0] // m.scales.shape[0])
        gi = gi.long()
        w = (q - z[gi]).float() * m.scales.float()[gi]  # [K, N]
        return w.t().contiguous().to(dtype)


class CompressedPacked(Fallback):
    layout = "compressed-tensors pack-quantized"

    @classmethod
    def can_take(cls, module: nn.Module) -> tuple[bool, str]:
        if _tensor(module, "weight_packed") is None:
            return False, "not a compressed-tensors packed layer"
        why = _need(module, ("weight_scale", "weight_shape"))
        if why:
            return False, why
        bits = cls._bits(module)
        if bits not in (2, 4, 8):
            return False, f"{bits}-bit packing is not supported (2, 4 or 8)"
        shape = [int(v) for v in module.weight_shape.reshape(-1).tolist()]
        sc = module.weight_scale
        if len(shape) != 2 or sc.dim() != 2 or sc.shape[0] != shape[0] or \
                shape[1] % sc.shape[1]:
            return False, (f"weight_scale {tuple(sc.shape)} does not fit weight_shape {shape} "
                           "(per-channel or per-group scales only)")
        return True, ""

    @staticmethod
    def _bits(module: nn.Module) -> int:
        args = getattr(getattr(module, "quantization_scheme", None), "weights", None)
        b = getattr(args, "num_bits", None)
        if isinstance(b, int):
            return b
        k = int(module.weight_shape.reshape(-1)[1])
        return round(module.weight_packed.shape[1] * 32 / k) if k else 0

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        m = self.module
        bits = self._bits(m)
        n, k = (int(v) for v in m.weight_shape.reshape(-1).tolist())
        off = 1 << (bits - 1)
        q = unpack_int32(m.weight_packed, bits, 1)[:, :k] - off  # signed values
        g = k // m.weight_scale.shape[1]
        s = m.weight_scale.float().repeat_interleave(g, 1)
        zp = _tensor(m, "weight_zero_point")
        if zp is not None and zp.numel() > 1 and zp.dtype == torch.int32 and zp.shape[0] != n:
            zp = (unpack_int32(zp, bits, 0)[:n] - off)  # packed along N
        if zp is not None and zp.numel() > 1:
            q = q - zp.to(torch.int32).reshape(n, -1).repeat_interleave(g, 1)
        elif zp is not None and zp.numel() == 1:
            q = q - int(zp.reshape(-1)[0])
        return (q.float() * s).to(dtype)


class Fp8Weight(Fallback):
    layout = "FP8"

    @classmethod
    def can_take(cls, module: nn.Module) -> tuple[bool, str]:
        w = _tensor(module, "weight")
        if w is None or w.dtype not in _FP8:
            return False, "not an FP8 weight"
        sc = _tensor(module, "weight_scale")
        if sc is None:
            sc = _tensor(module, "weight_scale_inv")
        if sc is None:
            return False, "its float8 weight has no weight_scale (or weight_scale_inv)"
        if w.dim() != 2:
            return False, f"its weight has {w.dim()} dimensions, not 2"
        ok = sc.numel() == 1 or (sc.dim() >= 1 and sc.shape[0] == w.shape[0] and
                                 sc.reshape(w.shape[0], -1).shape[1] == 1) or sc.dim() == 2
        return (True, "") if ok else (False, f"weight_scale {tuple(sc.shape)} is neither per "
                                             "tensor, per channel nor per block")

    def _scale(self) -> torch.Tensor:
        sc = _tensor(self.module, "weight_scale")
        return sc if sc is not None else self.module.weight_scale_inv

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        w = self.module.weight.float()
        n, k = w.shape
        sc = self._scale().float()
        if sc.numel() == 1:
            s = sc.reshape(1, 1)
        elif sc.reshape(-1).numel() == n and (sc.dim() == 1 or sc.shape[-1] == 1):
            s = sc.reshape(n, 1)
        else:  # block scales [ceil(N/bn), ceil(K/bk)]
            bn, bk = self._block(n, k, sc)
            s = sc.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
        return (w * s).to(dtype)

    def _block(self, n: int, k: int, sc: torch.Tensor) -> tuple[int, int]:
        for attr in ("weight_block_size", "block_size"):
            v = getattr(self.module, attr, None)
            if isinstance(v, (list, tuple)) and len(v) == 2:
                return int(v[0]), int(v[1])
        return math.ceil(n / sc.shape[0]), math.ceil(k / sc.shape[1])

    def prepare_input(self, x: torch.Tensor) -> torch.Tensor:
        fmax = torch.finfo(self.module.weight.dtype).max
        s_in = _tensor(self.module, "input_scale")
        xf = x.float()
        if s_in is not None and s_in.numel() == 1:  # static: the layer's scale, saturating
            s = s_in.float().reshape(())
        else:  # dynamic per-token scale (what a dynamic FP8 kernel computes)
            s = (xf.abs().amax(-1, keepdim=True) / fmax).clamp_min(1e-12)
            s = torch.where(torch.isfinite(s), s, torch.ones_like(s))
        q = (xf / s).clamp(-fmax, fmax).to(self.module.weight.dtype)
        return (q.float() * s).to(x.dtype if x.dtype not in _FP8 else torch.float32)


def _is_bnb(module: nn.Module, name: str) -> bool:
    """``module`` is (a subclass of) bitsandbytes' ``name`` (matched without importing it)."""
    return any(c.__module__.startswith("bitsandbytes") and c.__name__ == name
               for c in type(module).__mro__)


class BitsAndBytes4bit(Fallback):
    layout = "bitsandbytes 4-bit"

    @classmethod
    def can_take(cls, module: nn.Module) -> tuple[bool, str]:
        if not _is_bnb(module, "Linear4bit"):
            return False, "not a bitsandbytes Linear4bit"
        if getattr(getattr(module, "weight", None), "quant_state", None) is None:
            return False, ("its weight is not quantized yet (bitsandbytes quantizes when the "
                           "layer is moved to its device)")
        return True, ""

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        import bitsandbytes.functional as bf

        w = self.module.weight
        return bf.dequantize_4bit(w.data, w.quant_state).to(dtype)


class BitsAndBytes8bit(Fallback):
    layout = "bitsandbytes int8"

    @classmethod
    def can_take(cls, module: nn.Module) -> tuple[bool, str]:
        if not _is_bnb(module, "Linear8bitLt"):
            return False, "not a bitsandbytes Linear8bitLt"
        cb, scb = cls._parts(module)
        if cb is None or scb is None:
            return False, "its int8 weight has no CB / SCB (not quantized yet)"
        return True, ""

    @staticmethod
    def _parts(module: nn.Module) -> tuple[Any, Any]:
        w = getattr(module, "weight", None)
        state = getattr(module, "state", None)
        cb = getattr(w, "CB", None)
        if cb is None:
            cb = getattr(state, "CB", None)
        if cb is None and isinstance(w, torch.Tensor) and w.dtype == torch.int8:
            cb = w.data
        scb = getattr(w, "SCB", None)
        if scb is None:
            scb = getattr(state, "SCB", None)
        return cb, scb

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        cb, scb = self._parts(self.module)
        return (cb.float() * (scb.float().reshape(-1, 1) / 127.0)).to(dtype)


class QuantoWeight(Fallback):
    layout = "optimum-quanto"

    @classmethod
    def can_take(cls, module: nn.Module) -> tuple[bool, str]:
        if not any(c.__module__.startswith("optimum.quanto") for c in type(module).__mro__):
            return False, "not an optimum-quanto layer"
        if not callable(getattr(cls._qweight(module), "dequantize", None)):
            return False, "its weight is not quantized (call optimum.quanto.quantize first)"
        return True, ""

    @staticmethod
    def _qweight(module: nn.Module) -> Any:
        w = getattr(module, "weight", None)
        if w is not None and type(w) not in (torch.Tensor, nn.Parameter):
            return w  # frozen: the weight is a quanto QTensor
        return getattr(module, "qweight", None)  # not frozen: quantized on access

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        with torch.no_grad():
            w = self._qweight(self.module).dequantize()
        return w.detach().to(dtype)


QUANTIZED_FALLBACKS: list[type[Fallback]] = [AwqGemm, GptqPacked, CompressedPacked, Fp8Weight,
                                             BitsAndBytes4bit, BitsAndBytes8bit, QuantoWeight]
