"""Checkpoint health scan: find broken scales and packing before a model is ever loaded.

Reads safetensors files (own header parser + numpy memmap), GGUF files (`gguf.GGUFReader`) and
Hugging Face model folders (plain, AWQ, GPTQ, FP8), never imports torch and never unpickles.
The library returns a `ScanReport`; it never prints. `qforensics scan` (qforensics/cli/scan.py)
is the command-line front end; docs/scan.md documents the checks and the JSON schema.

    >>> from qforensics.scan import scan_path
    >>> report = scan_path("model-awq/")            # doctest: +SKIP
    >>> report.verdict(), [f.check for f in report.findings]   # doctest: +SKIP
"""

from __future__ import annotations

from qforensics.scan.findings import (
    CHECKS,
    SCHEMA_NAME,
    SCHEMA_VERSION,
    SEVERITIES,
    FileSummary,
    Finding,
    ScanReport,
    Skipped,
)
from qforensics.scan.scanner import DEFAULT_CHUNK_BYTES, ScanPlan, plan_scan, run_scan, scan_path

__all__ = [
    "CHECKS",
    "DEFAULT_CHUNK_BYTES",
    "SCHEMA_NAME",
    "SCHEMA_VERSION",
    "SEVERITIES",
    "FileSummary",
    "Finding",
    "ScanPlan",
    "ScanReport",
    "Skipped",
    "plan_scan",
    "run_scan",
    "scan_path",
]
