"""Scan orchestration: find the checkpoint files under a path, then check each one.

`plan_scan(path)` walks the path (a file or a folder, recursively, skipping hidden folders) and
sorts what it finds: safetensors files grouped by folder (one folder = one checkpoint with its
config.json and shards), GGUF files, and pickle files (.bin/.pt/.pth/.ckpt/.pkl/.pickle), which are
listed as not scanned and never opened. `run_scan(plan)` checks everything and returns a
`ScanReport`; `scan_path` does both. Nothing here prints; progress goes to a callback that is
told how many bytes were just processed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable

from qforensics.errors import ScanError
from qforensics.scan.dtypes import FLOAT_FORMATS, INT_DTYPES
from qforensics.scan.findings import CHECKS, FileSummary, Finding, ScanReport, Skipped
from qforensics.scan.gguf_file import scan_gguf
from qforensics.scan.layout import Located, check_layout, is_scale_tensor, load_quant_config
from qforensics.scan.safetensors_file import SafetensorsFile
from qforensics.scan.values import findings_from_tallies, tally_float_chunks
from qforensics.trace.validate import check_regular_file

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "PICKLE_SUFFIXES",
    "ScanPlan",
    "plan_scan",
    "run_scan",
    "scan_path",
]

# Largest slice of one tensor decoded at once (as float32); bounds memory on huge tensors.
DEFAULT_CHUNK_BYTES = 256 * 1024 * 1024
PICKLE_SUFFIXES = frozenset({".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle"})
_SHARD_RE = re.compile(r"-\d+-of-\d+\.safetensors$")
_INDEX_NAME = "model.safetensors.index.json"

ProgressCallback = Callable[[int], None]


@dataclass
class SafetensorsGroup:
    """The safetensors files of one folder: one (possibly sharded) checkpoint."""

    folder: Path
    files: list[Path]
    complete: bool  # the whole checkpoint is here (missing companions are findings)


@dataclass
class ScanPlan:
    path: Path
    root: Path
    groups: list[SafetensorsGroup] = field(default_factory=list)
    gguf_files: list[Path] = field(default_factory=list)
    pickle_files: list[Path] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        """Bytes the scan will read (for a progress bar)."""
        files = [p for g in self.groups for p in g.files] + self.gguf_files
        return sum(p.stat().st_size for p in files)

    def display(self, p: Path) -> str:
        try:
            return p.relative_to(self.root).as_posix()
        except ValueError:
            return str(p)


def _sniff_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == b"GGUF"
    except OSError:
        return False


def plan_scan(path: str | Path) -> ScanPlan:
    """List what a scan of `path` would read. Raises ScanError if there is nothing to scan."""
    path = Path(path)
    if not path.exists():
        raise ScanError(f"{path}: no such file or folder")
    if not path.is_dir():
        check_regular_file(path, "checkpoint", ScanError)  # a FIFO or device is never opened
    if path.is_file():
        plan = ScanPlan(path=path, root=path.parent)
        suffix = path.suffix.lower()
        if suffix == ".safetensors":
            complete = not _SHARD_RE.search(path.name)
            plan.groups.append(SafetensorsGroup(path.parent, [path], complete))
        elif suffix in PICKLE_SUFFIXES:  # before sniffing: a pickle is never even opened
            plan.pickle_files.append(path)
        elif suffix == ".gguf" or _sniff_gguf(path):
            plan.gguf_files.append(path)
        else:
            raise ScanError(f"{path}: not a checkpoint this scanner reads; expected a "
                            f".safetensors or .gguf file, or a model folder")
        return plan
    plan = ScanPlan(path=path, root=path)
    by_folder: dict[Path, list[Path]] = {}
    for p in sorted(path.rglob("*")):
        rel = p.relative_to(path)
        if any(part.startswith(".") for part in rel.parts) or not p.is_file():
            continue
        suffix = p.suffix.lower()
        if suffix == ".safetensors":
            by_folder.setdefault(p.parent, []).append(p)
        elif suffix == ".gguf":
            plan.gguf_files.append(p)
        elif suffix in PICKLE_SUFFIXES:
            plan.pickle_files.append(p)
    plan.groups = [SafetensorsGroup(d, files, True) for d, files in sorted(by_folder.items())]
    if not (plan.groups or plan.gguf_files or plan.pickle_files):
        raise ScanError(f"{path}: no .safetensors, .gguf or pickle checkpoint files found in "
                        f"this folder")
    return plan


def _index_findings(plan: ScanPlan, group: SafetensorsGroup) -> list[Finding]:
    idx = group.folder / _INDEX_NAME
    if not group.complete or not idx.is_file():
        return []
    try:
        data = json.loads(idx.read_text(encoding="utf-8"))
        shards = sorted(set(data["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ScanError(f"{idx}: unreadable safetensors index ({exc}); fix or remove it") from exc
    present = {p.name for p in group.files}
    out = []
    for shard in shards:
        if shard not in present:
            out.append(Finding(file=plan.display(idx), tensor="", check="missing_file",
                               severity=CHECKS["missing_file"][0], count=1,
                               message=f"shard {shard!r} listed in {_INDEX_NAME} is missing"))
    return out


def _scan_group(plan: ScanPlan, group: SafetensorsGroup, report: ScanReport, chunk_bytes: int,
                on_progress: ProgressCallback | None) -> None:
    opened = [SafetensorsFile(p) for p in group.files]  # every header validated up front
    try:
        index: dict[str, Located] = {}
        for f in opened:
            display = plan.display(f.path)
            for name, entry in f.entries.items():
                if name in index:
                    report.findings.append(Finding(
                        file=display, tensor=name, check="duplicate_tensor",
                        severity=CHECKS["duplicate_tensor"][0], count=1,
                        message=f"also in {index[name].display}; loaders keep only one of them"))
                    continue
                index[name] = Located(f, entry, display)
        config = load_quant_config(group.folder)
        layout, struct_findings, struct_skipped = check_layout(index, config,
                                                              complete=group.complete)
        report.findings += _index_findings(plan, group)
        for f in opened:
            display = plan.display(f.path)
            summary = FileSummary(file=display, format="safetensors", layout=layout,
                                  bytes=f.size)
            report.files.append(summary)
            for entry in sorted(f.entries.values(), key=lambda e: e.begin):
                fmt = FLOAT_FORMATS.get(entry.dtype)
                if fmt is not None:
                    def tick(n: int, isz: int = fmt.itemsize) -> None:
                        if on_progress is not None:
                            on_progress(n * isz)
                    tallies = tally_float_chunks(f.chunks(entry, chunk_bytes), fmt,
                                                 scale=is_scale_tensor(entry.name),
                                                 on_chunk=tick)
                    report.findings += findings_from_tallies(tallies, file=display,
                                                             tensor=entry.name, total=entry.numel)
                elif entry.dtype in INT_DTYPES:
                    if on_progress is not None:
                        on_progress(entry.nbytes)
                else:
                    report.skipped.append(Skipped(display, entry.name,
                                                  f"not checked (dtype {entry.dtype})"))
                    if on_progress is not None:
                        on_progress(entry.nbytes)
                    continue
                summary.tensors += 1
            if on_progress is not None:
                on_progress(max(0, f.size - sum(e.nbytes for e in f.entries.values())))
        report.findings += struct_findings
        report.skipped += struct_skipped
    finally:
        for f in opened:
            f.close()


def run_scan(plan: ScanPlan, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
             on_progress: ProgressCallback | None = None) -> ScanReport:
    """Check everything in `plan`. Raises ScanError on a malformed file."""
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    report = ScanReport(path=str(plan.path), root=str(plan.root))
    for p in plan.pickle_files:
        report.skipped.append(Skipped(plan.display(p), None,
                                      "not scanned (pickle): never unpickled; convert it to "
                                      "safetensors to scan it"))
    for group in plan.groups:
        _scan_group(plan, group, report, chunk_bytes, on_progress)
    for p in plan.gguf_files:
        summary, findings, skipped = scan_gguf(p, plan.display(p), chunk_bytes=chunk_bytes,
                                               on_bytes=on_progress)
        report.files.append(summary)
        report.findings += findings
        report.skipped += skipped
    return report


def scan_path(path: str | Path, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
              on_progress: ProgressCallback | None = None) -> ScanReport:
    """Scan a .safetensors file, a .gguf file or a model folder; see the module docstring."""
    return run_scan(plan_scan(path), chunk_bytes=chunk_bytes, on_progress=on_progress)
