"""compute-sanitizer text output -> `SanitizerReport` (pure; no I/O).

Accepts the wordings of memcheck from cuda-memcheck through tool version 2026.x: "of size N
bytes" and "of size N", "Address"/"Access at"/"Access to", "out of bounds"/"misaligned",
"before"/"after"/"inside" the nearest allocation, direction "?", numbers with thousands
separators, API-error aftershocks, "Target application returned an error", the ERROR SUMMARY
line, and the tool's own "Error: ..." lines. Lines without the prefix are the target's own
output and are kept in `host_lines`.
"""

from __future__ import annotations

import re

from qforensics.replay.records import (
    AccessRecord,
    ApiError,
    OtherError,
    SanitizerReport,
)

DEFAULT_PREFIX = "========="

_NUM = r"\d[\d,]*"
_HEX = r"0x[0-9a-fA-F]+"

_INVALID = re.compile(
    rf"^Invalid (?P<space>__\w+__|\w+) (?P<kind>\S+) of size (?P<size>{_NUM})(?: bytes?)?\s*$"
)
_AT_OLD = re.compile(rf"^at (?P<pc>{_HEX}) in (?P<fn>.+?)\s*$")
_AT = re.compile(
    rf"^at (?P<fn>.+?)(?:\+(?P<pc>{_HEX}))?(?: in (?P<src>[^\s:]+):(?P<line>\d+))?\s*$"
)
_THREAD = re.compile(r"^by thread \((\d+),(\d+),(\d+)\) in block \((\d+),(\d+),(\d+)\)")
_ADDRESS = re.compile(rf"^(?:Address|Access at|Access to) (?P<addr>{_HEX}) is (?P<what>.+?)\s*$")
_NEAREST = re.compile(
    rf"^and is (?P<dist>{_NUM}) bytes? (?P<rel>before|after) the nearest allocation at (?P<alloc>{_HEX})"
    rf" of size (?P<size>{_NUM})(?: bytes?)?"
)
_INSIDE = re.compile(
    rf"^and is inside the nearest allocation at (?P<alloc>{_HEX}) of size (?P<size>{_NUM})(?: bytes?)?"
)
_FRAME = re.compile(
    rf"^Device Frame: ?(?P<fn>.+?)(?:\+(?P<pc>{_HEX}))?(?: in (?P<src>[^\s:]+):(?P<line>\d+))?\s*$"
)
_API = re.compile(
    r'^Program hit (?P<name>\w+) \(error (?P<num>\d+)\) due to "(?P<desc>[^"]*)"'
    r"(?: on (?:CUDA )?API call to (?P<call>\w+))?"
)
_SUMMARY = re.compile(rf"^ERROR SUMMARY: (?P<n>{_NUM}) errors?(?P<rest>.*)$")
_NOT_DISPLAYED = re.compile(rf"(?P<n>{_NUM}) errors? (?:were )?not displayed")


def _int(text: str) -> int:
    return int(text.replace(",", ""))


def _strip_prefix(line: str, prefix: str) -> tuple[int, str] | None:
    """(indent, text) for a sanitizer line, None for a target-output line."""
    if not line.startswith(prefix):
        return None
    rest = line[len(prefix):]
    stripped = rest.lstrip(" ")
    return len(rest) - len(stripped), stripped.rstrip()


def parse_sanitizer_output(text: str, prefix: str = DEFAULT_PREFIX) -> SanitizerReport:
    """Parse a whole compute-sanitizer transcript. Unknown sanitizer lines are never fatal."""
    report = SanitizerReport()
    current: AccessRecord | OtherError | ApiError | None = None
    for raw in text.splitlines():
        got = _strip_prefix(raw, prefix)
        if got is None:
            report.host_lines.append(raw)
            continue
        indent, body = got
        if not body or body.startswith("#"):
            continue
        if indent <= 1:  # a top-level line starts a new report (or is a standalone line)
            current = None
            m = _INVALID.match(body)
            if m:
                current = AccessRecord(
                    kind=m["kind"], size=_int(m["size"]), space=m["space"], message=body
                )
                report.records.append(current)
                continue
            m = _API.match(body)
            if m:
                current = ApiError(m["name"], int(m["num"]), m["desc"], m["call"], body)
                report.api_errors.append(current)
                continue
            m = _SUMMARY.match(body)
            if m:
                report.error_summary = _int(m["n"])
                nd = _NOT_DISPLAYED.search(m["rest"])
                if nd:
                    report.not_displayed = _int(nd["n"])
                continue
            if body.startswith("Target application returned an error"):
                report.target_returned_error = True
                continue
            if body.startswith("COMPUTE-SANITIZER"):
                continue
            if body.startswith("Error:"):
                report.tool_errors.append(body)
                if "terminated before first instrumented API call" in body:
                    report.terminated_before_instrumentation = True
                continue
            if body.startswith("Warning:"):
                report.tool_errors.append(body)
                continue
            current = OtherError(body)
            report.other_errors.append(current)
            continue
        # indented detail line
        if isinstance(current, AccessRecord):
            _detail(current, body)
        elif isinstance(current, OtherError):
            current.details.append(body)
    return report


def _detail(rec: AccessRecord, body: str) -> None:
    m = _AT_OLD.match(body)
    if m and rec.function is None:
        rec.pc, rec.function = m["pc"], m["fn"]
        rec.kernel = rec.kernel or rec.function
        return
    m = _FRAME.match(body)
    if m:
        rec.frames.append(body)
        rec.kernel = m["fn"]  # the last device frame is the launched kernel
        return
    if body.startswith("at ") and rec.function is None:
        m = _AT.match(body)
        if m:
            rec.function, rec.pc = m["fn"], m["pc"]
            rec.kernel = rec.kernel or rec.function
            if m["src"]:
                rec.source, rec.line = m["src"], int(m["line"])
        return
    m = _THREAD.match(body)
    if m:
        v = [int(x) for x in m.groups()]
        rec.thread, rec.block = (v[0], v[1], v[2]), (v[3], v[4], v[5])
        return
    m = _ADDRESS.match(body)
    if m:
        rec.address = int(m["addr"], 16)
        what = m["what"]
        rec.error = {"out of bounds": "out_of_bounds", "misaligned": "misaligned"}.get(what, what)
        return
    m = _NEAREST.match(body)
    if m:
        rec.relation, rec.distance = m["rel"], _int(m["dist"])
        rec.alloc_address, rec.alloc_size = int(m["alloc"], 16), _int(m["size"])
        return
    m = _INSIDE.match(body)
    if m:
        rec.relation, rec.distance = "inside", 0
        rec.alloc_address, rec.alloc_size = int(m["alloc"], 16), _int(m["size"])
        return
    if body.startswith(("Host Frame", "Saved host backtrace")):
        rec.frames.append(body)


_ALLOC_LINE = re.compile(rf"^qforensics-replay: alloc (?P<name>\w+) (?P<addr>{_HEX}) (?P<size>\d+)")


def parse_host_allocations(lines: list[str]) -> dict[str, tuple[int, int]]:
    """The host program's 'qforensics-replay: alloc NAME 0xADDR BYTES' lines -> {name: (addr, bytes)}."""
    out: dict[str, tuple[int, int]] = {}
    for line in lines:
        m = _ALLOC_LINE.match(line.strip())
        if m:
            out[m["name"]] = (int(m["addr"], 16), int(m["size"]))
    return out


def attribute_buffers(report: SanitizerReport, allocations: dict[str, tuple[int, int]]) -> None:
    """Name the tensor of each record whose nearest allocation is one the host program made."""
    by_addr = {addr: name for name, (addr, _size) in allocations.items()}
    for rec in report.records:
        if rec.alloc_address is not None and rec.alloc_address in by_addr:
            rec.buffer = by_addr[rec.alloc_address]
        elif rec.address is not None:
            for name, (addr, size) in allocations.items():
                if addr <= rec.address < addr + size:
                    rec.buffer = name
