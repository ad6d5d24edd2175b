"""`--json [PATH]`, the same in every command that writes JSON, and where the JSON goes.

    --json             the JSON on stdout, alone: the text report is left out
    --json -           the same
    --json out.json    the JSON in out.json, the text report on stdout as usual
    --json=PATH        the JSON in PATH, whatever its name

A word after a bare `--json` is its PATH only when it is `-` or ends in `.json`; any other word
stays an argument, so `qforensics analyze --json trace.h5` reads trace.h5 and prints JSON. Every
other name needs the `=` form. A PATH that is one of the command's inputs, or a directory, is
refused before any work (exit 2). Messages and progress go to stderr either way; the JSON itself
is written by qforensics.jsondoc.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import click

from qforensics.errors import UsageError
from qforensics.jsondoc import dumps
from qforensics.jsondoc import write as write_doc

__all__ = ["STDOUT", "JsonCommand", "JsonOut", "json_option", "json_out", "split_json_args"]

STDOUT = "-"
F = Callable[..., Any]


def split_json_args(args: list[str]) -> list[str]:
    """`--json WORD` -> `--json=WORD` when WORD is `-` or ends in .json, a bare `--json` ->
    `--json=-`; everything after `--` is left alone."""
    out: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            out.extend(args[i:])
            break
        if a == "--json":
            nxt = args[i + 1] if i + 1 < len(args) else None
            if nxt is not None and (nxt == STDOUT or nxt.lower().endswith(".json")):
                out.append(f"--json={nxt}")
                i += 2
                continue
            out.append(f"--json={STDOUT}")
        else:
            out.append(a)
        i += 1
    return out


class JsonCommand(click.Command):
    """A click command whose `--json` takes an optional PATH (see the module docstring)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, split_json_args(list(args)))


def json_option(what: str) -> Callable[[F], F]:
    """The `--json [PATH]` option (parameter `json_path`); `what` names the document."""
    return click.option(
        "--json", "json_path", metavar="[PATH]", default=None,
        help=f"Write {what} as JSON: on stdout with --json alone (or --json -; the text report "
             "is then left out), in PATH with --json out.json (a name ending in .json) or "
             "--json=PATH (any name).")


@dataclass(frozen=True)
class JsonOut:
    """Where a command's JSON goes (`path`: None for none, "-" for stdout), and so where its
    text goes: the report on stdout unless the JSON is there, notes on stderr then."""

    path: str | None

    @property
    def to_stdout(self) -> bool:
        return self.path == STDOUT

    def text(self, line: str) -> None:
        """A line of the text report: left out when stdout carries the JSON."""
        if not self.to_stdout:
            click.echo(line)

    def note(self, line: str) -> None:
        """A line saying what was done (a file written): stdout, or stderr beside JSON."""
        click.echo(line, err=self.to_stdout)

    def write(self, doc: Any) -> None:
        if self.path is None:
            return
        if self.to_stdout:
            click.echo(dumps(doc))
            return
        try:
            write_doc(doc, self.path)
        except OSError as exc:
            raise UsageError(f"{self.path}: cannot write the JSON ({exc.strerror or exc}); "
                             "give a writable path with --json=PATH") from None
        click.echo(f"wrote {self.path}", err=True)


def json_out(path: str | None, inputs: Iterable[str | os.PathLike[str] | None] = ()) -> JsonOut:
    """Check `--json`'s PATH before any work: not empty, not a directory, not an input."""
    if path is None or path == STDOUT:
        return JsonOut(path)
    if not path:
        raise UsageError("--json= needs a PATH (or give --json alone for stdout)")
    if os.path.isdir(path):
        raise UsageError(f"--json {path}: is a directory; give a file path, e.g. "
                         f"--json={os.path.join(path, 'out.json')}")
    for src in inputs:
        if src is not None and os.path.exists(src) and os.path.exists(path) \
                and os.path.samefile(src, path):
            raise UsageError(f"--json {path}: is an input of this command; the JSON would "
                             "overwrite it. Give another path")
    return JsonOut(path)
