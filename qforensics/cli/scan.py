"""`qforensics scan PATH`: checkpoint health scan.

Only printing and exit codes live here; the scan itself is `qforensics.scan`.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import click

from qforensics.cli.jsonout import JsonCommand, json_option, json_out
from qforensics.errors import ScanError
from qforensics.scan import ScanReport, plan_scan, run_scan

# Below this many bytes a scan is quick enough that an automatic progress bar is noise.
PROGRESS_MIN_BYTES = 64 * 1024 * 1024


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _finding_line(f: Any) -> str:
    where = f"{f.file} | {f.tensor}" if f.tensor else f.file
    return f"{f.severity.upper()} {f.check} | {where} | {f.message}"


def _skipped_lines(report: ScanReport) -> list[str]:
    """Pickle files one per line; tensors not checked grouped by file and reason."""
    lines = []
    grouped: dict[tuple[str, str], list[str]] = defaultdict(list)
    for s in report.skipped:
        if s.tensor is None:
            lines.append(f"NOT SCANNED | {s.file} | {s.reason}")
        else:
            grouped[(s.file, s.reason)].append(s.tensor)
    for (file, reason), tensors in grouped.items():
        shown = ", ".join(tensors[:3]) + (", ..." if len(tensors) > 3 else "")
        lines.append(f"NOT CHECKED | {file} | {reason}: {_plural(len(tensors), 'tensor')} "
                     f"({shown})")
    return lines


def _verdict_line(report: ScanReport, fail_on: str) -> str:
    scanned = (f"scanned {_plural(report.tensors_scanned, 'tensor')} in "
               f"{_plural(report.files_scanned, 'file')}")
    n_pickle = sum(1 for s in report.skipped if s.tensor is None)
    n_tensor = len(report.skipped) - n_pickle
    extra = []
    if n_pickle:
        extra.append(f"{_plural(n_pickle, 'pickle file')} not scanned")
    if n_tensor:
        extra.append(f"{_plural(n_tensor, 'tensor')} not checked")
    tail = f" ({'; '.join(extra)})" if extra else ""
    failing = report.failing(fail_on)
    if failing:
        files = len({f.file for f in failing})
        counts = ", ".join(_plural(report.count(s), s) for s in ("error", "warning")
                           if report.count(s))
        return (f"FAILED | {_plural(len(failing), 'finding')} in {_plural(files, 'file')} "
                f"({counts}); {scanned}{tail}")
    if report.tensors_scanned == 0:
        return f"NOTHING SCANNED | {scanned}{tail}"
    ignored = len(report.findings)
    note = f"; {_plural(ignored, 'warning')} below --fail-on {fail_on}" if ignored else ""
    return f"PASSED | {scanned}{tail}{note}"


EXAMPLE = """\b
Example:
    qforensics scan ./Llama-3-8B-Instruct-AWQ
    qforensics scan model.Q4_1.gguf --json > scan.json
    qforensics scan ./Llama-3-8B-Instruct-AWQ --json scan.json
    qforensics scan ./fp8-model --fail-on error
"""


@click.command("scan", cls=JsonCommand, epilog=EXAMPLE)
@click.argument("path", type=click.Path(exists=True, path_type=Path))
@json_option("the report (schema qforensics.scan, see docs/scan.md)")
@click.option("--fail-on", type=click.Choice(["warning", "error"]), default="warning",
              show_default=True,
              help="Lowest severity that makes the scan fail (exit 1).")
@click.option("--progress/--no-progress", default=None,
              help="Progress bar on stderr. Default: on for large checkpoints when stderr is a "
                   "terminal.")
@click.option("--chunk-mib", type=click.IntRange(1, 65536), default=256, show_default=True,
              help="Largest slice of one tensor decoded at once, in MiB (bounds memory).")
def command(path: Path, json_path: str | None, fail_on: str, progress: bool | None,
            chunk_mib: int) -> None:
    """Check a checkpoint's scales, zero points and packing without loading the model.

    PATH is a .safetensors file, a .gguf file, or a Hugging Face model folder (plain, AWQ, GPTQ
    or FP8, from config.json and tensor names). Reports NaN/Inf/zero/subnormal scales (AWQ/GPTQ
    scales, FP8 weight_scale/input_scale, GGUF block scales), NaN/Inf weights, scales that
    overflow FP16, g_idx out of range and shapes that do not match the packing or group size.
    Pickle files (.bin/.pt/.pth/.ckpt) are listed as not scanned and never opened. Torch is not
    needed.

    Exit status: 0 clean, 1 findings at or above --fail-on, 2 unreadable input or nothing
    scannable, 3 internal error. The JSON schema and every check are described in docs/scan.md.
    """
    out = json_out(json_path, [path])
    plan = plan_scan(path)
    chunk_bytes = chunk_mib * 1024 * 1024
    total = plan.total_bytes
    show = progress if progress is not None else (
        sys.stderr.isatty() and total >= PROGRESS_MIN_BYTES)
    if show and total > 0:
        with click.progressbar(length=total, label="scanning", file=sys.stderr) as bar:
            if progress:
                bar.is_hidden = False  # asked for explicitly: draw even when not a TTY
            report = run_scan(plan, chunk_bytes=chunk_bytes, on_progress=bar.update)
    else:
        report = run_scan(plan, chunk_bytes=chunk_bytes)

    for f in report.findings:
        out.text(_finding_line(f))
    for line in _skipped_lines(report):
        out.text(line)
    out.text(_verdict_line(report, fail_on))
    out.write(report.to_dict(fail_on))
    verdict = report.verdict(fail_on)
    if verdict == "nothing_scanned":
        raise ScanError(f"{path}: nothing scanned; only pickle files or unsupported tensors "
                        f"were found. Convert the checkpoint to safetensors to scan it.")
    click.get_current_context().exit(1 if verdict == "failed" else 0)
