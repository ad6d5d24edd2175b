"""Structured findings shared by the compute-sanitizer parser and the CPU emulation.

One `AccessRecord` is one faulty memory access, whether compute-sanitizer printed it or the
emulation computed it; the fields follow memcheck's wording (see docs/replay.md).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class AccessRecord:
    """One invalid access. Fields a source does not know stay None."""

    kind: str | None = None  # "read" | "write" | "?" | other verb the tool printed
    size: int | None = None  # bytes
    space: str | None = None  # "__global__" | "__shared__" | "__local__" | ...
    error: str | None = None  # "out_of_bounds" | "misaligned" | "int32_overflow" | other wording
    function: str | None = None  # function the faulting instruction is in
    kernel: str | None = None  # the launched kernel (outermost device frame)
    pc: str | None = None  # "+0xb0" offset or old-style absolute pc
    source: str | None = None  # file name
    line: int | None = None
    thread: tuple[int, int, int] | None = None
    block: tuple[int, int, int] | None = None
    address: int | None = None
    relation: str | None = None  # "before" | "after" | "inside" the nearest allocation
    distance: int | None = None  # bytes, as memcheck counts them
    alloc_address: int | None = None
    alloc_size: int | None = None
    buffer: str | None = None  # tensor name, when known (emulation, or the host's alloc lines)
    origin: str = "sanitizer"  # "sanitizer" | "emulation"
    overflow: bool = False  # the offset wrapped in int32 arithmetic (emulation only)
    message: str | None = None  # the header line as printed
    frames: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for key in ("thread", "block"):
            if d[key] is not None:
                d[key] = list(d[key])
        for key in ("address", "alloc_address"):
            if d[key] is not None:
                d[key] = hex(d[key])
        return d

    def describe(self) -> str:
        """One human line: 'kernel K, block (b), thread (t), reads 4 bytes 1 bytes past the end of `scales`'."""
        verb = {"read": "reads", "write": "writes"}.get(self.kind or "", "accesses")
        what = f"{verb} {self.size} bytes" if self.size is not None else verb
        target = f"`{self.buffer}`" if self.buffer else (
            f"the allocation at {hex(self.alloc_address)}" if self.alloc_address is not None else "memory"
        )
        if self.error == "misaligned":
            where = f"at a misaligned address in {target}" if self.buffer else "at a misaligned address"
        elif self.error == "int32_overflow":
            where = f"at a wrapped int32 offset that lands inside {target} (silent corruption)"
        elif self.relation == "after" and self.distance is not None:
            where = f"at {self.distance} bytes past the end of {target}"
        elif self.relation == "before" and self.distance is not None:
            where = f"at {self.distance} bytes before the start of {target}"
        elif self.relation == "inside":
            where = f"straddling the end of {target}"
        else:
            where = "out of bounds" if self.error in (None, "out_of_bounds") else (self.error or "")
        parts = []
        if self.kernel or self.function:
            parts.append(f"kernel {self.kernel or self.function}")
        if self.block is not None:
            parts.append("block ({},{},{})".format(*self.block))
        if self.thread is not None:
            parts.append("thread ({},{},{})".format(*self.thread))
        loc = f" at {self.source}:{self.line}" if self.source and self.line is not None else ""
        ovf = " (int32 offset wrapped)" if self.overflow and self.error != "int32_overflow" else ""
        space = f"{self.space} " if self.space and self.space != "__global__" else ""
        return ", ".join(parts + [f"{space}{what} {where}{ovf}{loc}".strip()])


@dataclass
class ApiError:
    """'Program hit cudaErrorX (error N) due to "..." on CUDA API call to cudaY.'"""

    name: str
    number: int
    description: str
    call: str | None
    message: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class OtherError:
    """A top-level report the parser does not model field by field (racecheck, initcheck, ...)."""

    message: str
    details: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class SanitizerReport:
    """Everything parsed out of one compute-sanitizer run's text output."""

    records: list[AccessRecord] = field(default_factory=list)
    api_errors: list[ApiError] = field(default_factory=list)
    other_errors: list[OtherError] = field(default_factory=list)
    error_summary: int | None = None  # "ERROR SUMMARY: N errors"; None when the line is absent
    not_displayed: int | None = None  # errors the summary says were not printed
    target_returned_error: bool = False
    terminated_before_instrumentation: bool = False
    tool_errors: list[str] = field(default_factory=list)  # "Error: ..." lines from the tool itself
    host_lines: list[str] = field(default_factory=list)  # lines without the sanitizer prefix

    @property
    def printed_errors(self) -> int:
        return len(self.records) + len(self.api_errors) + len(self.other_errors)

    def to_dict(self) -> dict[str, Any]:
        return {
            "records": [r.to_dict() for r in self.records],
            "api_errors": [e.to_dict() for e in self.api_errors],
            "other_errors": [e.to_dict() for e in self.other_errors],
            "error_summary": self.error_summary,
            "not_displayed": self.not_displayed,
            "target_returned_error": self.target_returned_error,
            "terminated_before_instrumentation": self.terminated_before_instrumentation,
            "tool_errors": list(self.tool_errors),
        }
