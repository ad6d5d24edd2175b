"""Per-kernel error bounds: how far a healthy kernel's output may lie from the float64 reference,
derived from that kernel's own arithmetic (docs/replay.md, "Error bounds").

Every bound has one form, per output [m, n], with S = sum_k |x_k| A_kn (A_kn >= |w_kn|: the
magnitudes the kernel's weight operand is built from) and y the float64 reference:

    |kernel - reference| <= a * S + b * |y| + eta

derived from these steps, each a documented rounding of the kernel (u = unit roundoff, half an
ulp at 1: 2**-24 float32, 2**-11 float16 and tf32, 2**-8 bfloat16):

1. operands: the kernel rounds x and/or its weight into its operand dtype: u_x * S and
   r_w * u_w * S (r_w roundings of the weight: e.g. a bf16 scale and zero, then the bf16 value).
   0 where the reference already holds the operand as the kernel sees it (FP8 bit patterns).
2. products: exact in every kernel here (fp8 x fp8, bf16 x bf16 and fp16 x fp16 products fit
   the fp32 / tensor-core product).
3. accumulation in chunks of C terms, in an accumulator of unit u_acc: gamma_C(u_acc) * S with
   gamma_n(u) = n u / (1 - n u) (Higham, "Accuracy and Stability of Numerical Algorithms",
   Lemma 3.1 / eq. 3.5; it holds for any summation order, so for any split-K or tree order).
   The ceil(K/C) chunk partials are then added in an accumulator of unit u_red (split-K,
   FP8 promotion): gamma_{ceil(K/C)}(u_red) * (1 + gamma_C) * S. The operand rounding of step 1
   enlarges S by (1 + u_x)(1 + u_w).
4. epilogue: e float32 multiplications by scales: e u_f32 (|y| + the error so far).
5. output rounding into the output dtype: half an ulp, u_out (|y| + the error so far), plus
   eta = half the smallest subnormal of the output dtype (outputs that underflow).

FP8 on Hopper (torch._scaled_mm on CUDA): the tensor core keeps only about 14 bits of the running
sum (DeepSeek-V3 technical report, section 3.3.2, measured on H800: "limited to retaining around
14 bits", products aligned by right shifts and the bits beyond truncated). Counted here as 13
kept bits with truncation: u_acc = 2**-12 (one bit of margin for "about"; truncation costs a full
ulp, 2**-13 of 14 bits). With use_fast_accum=False (torch's default, what qforensics calls)
cuBLASLt "periodically promotes" the partial sums to fp32 (CUBLASLT_MATMUL_DESC_FAST_ACCUM);
the period is not documented by cuBLAS: C = 128 (4 WGMMAs of k=32, CUTLASS's default
mma_promotion_interval and DeepSeek's N_C). With fast accumulation the whole K stays in the
tensor core: C = K. The scales multiply in the fp32 epilogue (alpha = sa * sb, then alpha * acc).

A kernel with no model here has no stated bound: it is never judged KERNEL DIVERGES (judge.py
reads INCONCLUSIVE with the reason). A --launcher states its bound with an `error_bound`
attribute on its function (a dict of BoundModel.from_spec's keys, or "float32").
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

U = {"float64": 2.0 ** -53, "float32": 2.0 ** -24, "tf32": 2.0 ** -11, "float16": 2.0 ** -11,
     "bfloat16": 2.0 ** -8, "float8_e4m3fn": 2.0 ** -4, "fp8-tensor-core": 2.0 ** -12}
# half the smallest positive subnormal of each output dtype
ETA = {"float64": 2.0 ** -1075, "float32": 2.0 ** -150, "float16": 2.0 ** -25, "bfloat16": 2.0 ** -134}
HOPPER_FP8_ACC_BITS = 13  # "about 14 bits" (DeepSeek-V3 3.3.2), one bit of margin
HOPPER_FP8_PROMOTION = 128  # fp32 promotion interval with use_fast_accum=False (see module doc)
_EXACT_IN = {"float32": ("float16", "bfloat16", "float32"), "bfloat16": ("bfloat16",), "float16": ("float16",),
             "tf32": ()}


def gamma(n: int, u: float) -> float:
    """Higham's gamma_n = n u / (1 - n u); inf when n u >= 1 (no bound)."""
    return n * u / (1 - n * u) if n * u < 1 else math.inf


def _u(dtype: str | None) -> float:
    return 0.0 if dtype is None else U[dtype]


@dataclass(frozen=True)
class BoundModel:
    """One kernel's arithmetic, as far as its error bound needs it (module doc, steps 1-5)."""

    name: str
    kernel: str
    device: str
    x_dtype: str | None  # dtype the kernel rounds x into; None: exact (the reference holds it)
    w_dtype: str | None  # dtype the kernel rounds its weight into; None: exact
    w_roundings: int  # roundings into w_dtype the weight operand carries
    acc: str  # accumulator of the chunks (key of U)
    chunk: int | None  # chunk length C; None: all of K in one accumulator
    reduce: str  # accumulator the chunk partials are added in
    epilogue: int  # float32 scale multiplications after the sum
    out: str  # output dtype
    basis: str  # where the model comes from, in words

    @classmethod
    def from_spec(cls, spec: Any, *, kernel: str, device: str = "unknown") -> "BoundModel":
        """A launcher's stated bound: "float32", or a dict with keys inputs, weight, weight_roundings,
        accumulate, chunk, reduce, epilogue, output, basis (dtype names as in U)."""
        if spec == "float32":
            spec = {"accumulate": "float32", "output": "float32", "basis": "stated by the launcher: float32 throughout"}
        if not isinstance(spec, dict):
            raise ValueError(f"error_bound must be 'float32' or a dict, got {type(spec).__name__}")
        keys = {"inputs", "weight", "weight_roundings", "accumulate", "chunk", "reduce", "epilogue", "output", "basis"}
        if set(spec) - keys:
            raise ValueError(f"error_bound has unknown keys {sorted(set(spec) - keys)}")
        for k in ("inputs", "weight", "accumulate", "reduce", "output"):
            if spec.get(k) is not None and spec[k] not in U:
                raise ValueError(f"error_bound {k}={spec[k]!r}: not one of {sorted(U)}")
        return cls(name="stated-by-launcher", kernel=kernel, device=device, x_dtype=spec.get("inputs"),
                   w_dtype=spec.get("weight"), w_roundings=int(spec.get("weight_roundings", 1)),
                   acc=spec.get("accumulate", "float32"), chunk=spec.get("chunk"),
                   reduce=spec.get("reduce", "float32"), epilogue=int(spec.get("epilogue", 0)),
                   out=spec.get("output", "float32"), basis=str(spec.get("basis", "stated by the launcher")))

    def coefficients(self, k: int) -> tuple[float, float, float]:
        """(a, b, eta) of |err| <= a S + b |y| + eta for dot products of length k."""
        u_x, u_w = _u(self.x_dtype), _u(self.w_dtype)
        c = min(self.chunk or k, k)
        g_acc = gamma(c, U[self.acc])
        n_chunks = -(-k // c)
        g_red = gamma(n_chunks, U[self.reduce]) if n_chunks > 1 else 0.0
        a_pre = u_x + self.w_roundings * u_w + (1 + u_x) * (1 + u_w) ** self.w_roundings * (g_acc + g_red * (1 + g_acc))
        e = self.epilogue * U["float32"]
        u_out = U[self.out]
        return a_pre * (1 + e) * (1 + u_out), e * (1 + u_out) + u_out, ETA.get(self.out, 0.0)

    def statement(self, k: int) -> str:
        a, b, eta = self.coefficients(k)
        c = min(self.chunk or k, k)
        acc = (f"accumulate in {self.acc} (u={U[self.acc]:.3g})" + (f" over chunks of {c}, the {-(-k // c)} "
               f"chunk sums in {self.reduce}" if c < k else f" over all K={k}"))
        ops = ", ".join(f"{n} rounded to {d}" for n, d in (("x", self.x_dtype), ("weight", self.w_dtype)) if d) \
            or "operands exact as the reference holds them"
        return (f"bound model {self.name} ({self.kernel} on {self.device}: {ops}; {acc}; "
                f"{self.epilogue} fp32 scale multiplication(s); {self.out} output): "
                f"|kernel - reference| <= {a:.3g} * sum_k |x_k||w_kn| + {b:.3g} * |y|")

    def to_dict(self, k: int) -> dict[str, Any]:
        a, b, eta = self.coefficients(k)
        return {**asdict(self), "K": k, "a": a, "b": b, "eta": eta, "statement": self.statement(k)}

    def evaluate(self, s: np.ndarray, y_ref: np.ndarray, k: int) -> np.ndarray:
        """The per-output bound from S = sum_k |x_k| A_kn and the reference y."""
        a, b, eta = self.coefficients(k)
        with np.errstate(over="ignore", invalid="ignore"):
            return a * s + b * np.abs(np.where(np.isfinite(y_ref), y_ref, 0.0)) + eta + 1e-300


def _exact(stored: str | None, into: str) -> bool:
    return stored is not None and stored in _EXACT_IN.get(into, ())


def model_for(kernel: str, device: str, meta: dict[str, Any], *, x_stored: str | None = None,
              w_stored: str | None = None, cuda_flags: dict[str, bool] | None = None
              ) -> tuple[BoundModel | None, str]:
    """The bound model of one of qforensics' torch kernels on `device` (x_stored, w_stored: the
    bundle's dtypes of x and a dense weight; cuda_flags: torch.backends.cuda.matmul's flags in
    the process that runs the kernel, `torch_kernels.cuda_matmul_flags`, read there so that
    this module stays torch-free); (None, why) without one."""
    flags = cuda_flags or {}

    def _cuda_flag(name: str) -> bool | None:
        return flags.get(name)

    cd = str(meta.get("compute_dtype") or "float32").replace("torch.", "")
    if kernel == "torch-scaled-mm":
        if device == "cuda":
            fast = bool(meta.get("use_fast_accum", False))
            return BoundModel(
                "fp8-tensor-core-14bit" + ("-fast-accum" if fast else "-promote128"), kernel, device, None, None, 1,
                "fp8-tensor-core", None if fast else HOPPER_FP8_PROMOTION, "float32", 2, "float32",
                "e4m3 x e4m3 products exact; the tensor core keeps about 14 bits of the running sum (DeepSeek-V3 "
                "report 3.3.2, H800), counted as 13 bits truncated; " + (
                    "use_fast_accum=True: all of K in the tensor core" if fast else
                    f"use_fast_accum=False: partial sums promoted to fp32 every {HOPPER_FP8_PROMOTION} "
                    "(cuBLASLt FAST_ACCUM off; period from CUTLASS / DeepSeek, not documented by cuBLAS)")
                + "; per-tensor scales in the fp32 epilogue; fp32 output"), ""
        return BoundModel("fp8-upcast-fp32", kernel, device, None, None, 1, "float32", None, "float32", 2, "float32",
                          "CPU: e4m3 operands widened to fp32 (exact), fp32 GEMM, scales in fp32, fp32 output"), ""
    if kernel == "torch-int4pack":
        return BoundModel("tinygemm-bf16", kernel, device, None if x_stored == "bfloat16" else "bfloat16",
                          "bfloat16", 2, "float32", None, "float32", 0, "bfloat16",
                          "x in bf16; the weight (q - 8) * scale + zero from bf16 scale and zero, a bf16 value; "
                          "bf16 products exact in fp32, fp32 accumulation (any split); bf16 output"), ""
    if kernel == "torch-compile":
        tf32 = device == "cuda" and bool(_cuda_flag("allow_tf32"))
        op = "tf32" if tf32 else "float32"
        return BoundModel("inductor-fp32" + ("-tf32" if tf32 else ""), kernel, device,
                          None if (not tf32 and _exact(x_stored, "float32")) else op, op, 1, "float32", None,
                          "float32", 0, "float32",
                          "(q - z) exact in fp32, times the fp32 scale: one rounding; fp32 GEMM (Inductor C++ on CPU, "
                          "Triton on CUDA, any split-K order); fp32 output" + ("; TF32 operands (allow_tf32)" if tf32
                                                                                else "")), ""
    if kernel in ("torch-linear", "qforensics-fakequant"):
        if cd not in ("float32", "float16", "bfloat16"):
            return None, f"compute dtype {cd!r} has no model"
        if device == "cuda" and cd in ("float16", "bfloat16"):
            flag = f"allow_{'fp16' if cd == 'float16' else 'bf16'}_reduced_precision_reduction"
            if _cuda_flag(flag) is not False:
                return None, (f"cuBLAS may reduce split-K partial sums in {cd} (torch.backends.cuda.matmul.{flag} "
                              "is on) with a split count it does not document; set it False to judge this kernel")
        tf32 = device == "cuda" and cd == "float32" and bool(_cuda_flag("allow_tf32"))
        op = "tf32" if tf32 else cd
        fq = kernel == "qforensics-fakequant"
        x_d = op if (fq or tf32 or not _exact(x_stored, cd)) else None
        w_d = op if (tf32 or not _exact(w_stored, cd)) else None
        return BoundModel(f"linear-{op}", kernel, device, x_d, w_d, 1, "float32", None, "float32", 0, cd,
                          f"x{' (fake-quantized)' if fq else ''} and weight in {op}; products exact in fp32, fp32 "
                          f"accumulation (any order); {cd} output"), ""
    if kernel == "vllm-cpu-wna16":
        ad = x_stored if x_stored in ("bfloat16", "float16") else "bfloat16"
        return BoundModel("wna16-cpu", kernel, device, None if x_stored == ad else ad, ad, 2, "float32", None,
                          "float32", 0, ad,
                          f"activations in {ad}; weight (q - z) * s with s in {ad}, a {ad} value; fp32 accumulation "
                          f"(assumed: vllm does not document it); {ad} output"), ""
    return None, f"{kernel!r} has no stated error bound in qforensics.replay.bounds"
