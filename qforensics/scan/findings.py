"""What a scan reports: findings, skipped items, per-file summaries, and their JSON form.

The JSON form (`ScanReport.to_dict`) is the documented, versioned schema of docs/scan.md:
`{"schema": "qforensics.scan", "version": SCHEMA_VERSION, ...}`. Bump the major version on any
change that renames or removes a key; adding keys is a minor change. Written by
qforensics.jsondoc: a non-finite `example` is the string "nan", "inf" or "-inf".
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from qforensics.jsondoc import SCHEMAS, document, jsonable

__all__ = [
    "SCHEMA_NAME",
    "SCHEMA_VERSION",
    "SEVERITIES",
    "CHECKS",
    "Finding",
    "Skipped",
    "FileSummary",
    "ScanReport",
]

SCHEMA_NAME = "qforensics.scan"
SCHEMA_VERSION = SCHEMAS[SCHEMA_NAME]

# Ordered from worst to mildest.
SEVERITIES = ("error", "warning")

# check name -> (severity, one-line meaning). docs/scan.md lists the same table.
CHECKS: dict[str, tuple[str, str]] = {
    "nan": ("error", "NaN values in a float tensor or a quantized-block scale"),
    "inf": ("error", "+/-Inf values in a float tensor or a quantized-block scale"),
    "zero_scale": ("warning", "scale values equal to zero (the group dequantizes to 0 or 0/0)"),
    "subnormal_scale": ("warning", "nonzero scale values below the format's smallest normal"),
    "fp16_overflow": ("error", "float32/bf16 scales with |s| > 65504 (inf once cast to FP16)"),
    "g_idx_range": ("error", "GPTQ g_idx values outside [0, number of groups)"),
    "shape": ("error", "a packed tensor's shape does not match packing or group size"),
    "dtype": ("error", "a packed tensor has the wrong element type"),
    "zero_point_wrap": ("warning", "GPTQ v1 qzeros nibble 2**bits-1: a zero point of 0 wrapped"),
    "zero_point_sym": ("warning", "symmetric GPTQ qzeros nibble differs from the fixed midpoint"),
    "missing_tensor": ("error", "a quantized module lacks a companion tensor (scales, ...)"),
    "missing_file": ("error", "a shard named in model.safetensors.index.json is absent"),
    "duplicate_tensor": ("error", "the same tensor name appears in two files of one checkpoint"),
}


@dataclass(frozen=True)
class Finding:
    """One problem in one tensor (or one packed module, named by its primary tensor).

    `first_index` is the flat (row-major) element index of the first offending element; for
    GGUF block scales it is the index of the block's first element and `block_index` is the
    flat block index within the tensor. `count` of `total` elements (or blocks) offend.
    """

    file: str
    tensor: str
    check: str
    severity: str
    count: int
    first_index: int | None = None
    block_index: int | None = None
    example: float | int | None = None
    total: int | None = None
    message: str = ""

    def to_dict(self) -> dict[str, Any]:
        return jsonable(asdict(self))  # a NaN example: "nan" (qforensics.jsondoc)


@dataclass(frozen=True)
class Skipped:
    """A file or tensor the scanner deliberately did not check, and why."""

    file: str
    tensor: str | None
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class FileSummary:
    """One scanned file: its format, detected quantization layout and tensor count."""

    file: str
    format: str  # "safetensors" | "gguf"
    layout: str  # "plain" | "awq" | "gptq" | "fp8" | "compressed-tensors" | "gguf" | ...
    tensors: int = 0
    bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ScanReport:
    """Everything one scan found. Paths in it are relative to `root`."""

    path: str
    root: str
    files: list[FileSummary] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)

    @property
    def tensors_scanned(self) -> int:
        return sum(f.tensors for f in self.files)

    @property
    def files_scanned(self) -> int:
        return len(self.files)

    def count(self, severity: str) -> int:
        return sum(1 for f in self.findings if f.severity == severity)

    def failing(self, fail_on: str = "warning") -> list[Finding]:
        """Findings at or above `fail_on` ("error" or "warning")."""
        if fail_on not in SEVERITIES:
            raise ValueError(f"fail_on must be one of {SEVERITIES}, not {fail_on!r}")
        allowed = SEVERITIES[: SEVERITIES.index(fail_on) + 1]
        return [f for f in self.findings if f.severity in allowed]

    def verdict(self, fail_on: str = "warning") -> str:
        """"failed" (findings at or above fail_on), "passed", or "nothing_scanned"."""
        if self.failing(fail_on):
            return "failed"
        if self.tensors_scanned == 0:
            return "nothing_scanned"
        return "passed"

    def to_dict(self, fail_on: str = "warning") -> dict[str, Any]:
        return document(SCHEMA_NAME, {
            "path": self.path,
            "root": self.root,
            "verdict": self.verdict(fail_on),
            "fail_on": fail_on,
            "files_scanned": self.files_scanned,
            "tensors_scanned": self.tensors_scanned,
            "counts": {s: self.count(s) for s in SEVERITIES},
            "files": [f.to_dict() for f in self.files],
            "findings": [f.to_dict() for f in self.findings],
            "skipped": [s.to_dict() for s in self.skipped],
        })
