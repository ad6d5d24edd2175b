"""The `qforensics` command line: a click group whose subcommands live one per module here.

This package is the only place that prints or chooses exit codes. Exit codes: 0 healthy or done,
1 a FAILED or SUSPECT finding, 2 bad usage or unreadable input, 3 an internal error (a bug).
`QForensicsError` (user errors) is printed as one line; any other exception is a bug, printed as
one line too, its traceback only with QFORENSICS_DEBUG=1. No traceback reaches the user otherwise.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from typing import Any

import click

from qforensics.version import __version__
from qforensics.errors import (
    DEBUG_ENV,
    EXIT_INTERNAL,
    EXIT_USAGE,
    QForensicsError,
)

# name -> module under qforensics.cli that defines a click command called `command`.
# Imported lazily so `qforensics analyze` never pays for (or needs) torch.
COMMANDS: dict[str, str] = {
    "record": "record",
    "analyze": "analyze",
    "diff": "diff",
    "report": "report",
    "replay": "replay",
    "demo": "demo",
    "whatif": "whatif",
    "scan": "scan",
    "triage": "triage",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(name for name in COMMANDS if self._load(name) is not None)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        return self._load(name)

    def _load(self, name: str) -> click.Command | None:
        modname = COMMANDS.get(name)
        if modname is None:
            return None
        try:
            module = importlib.import_module(f"qforensics.cli.{modname}")
        except ModuleNotFoundError as exc:
            if exc.name == f"qforensics.cli.{modname}":
                return None  # command not built yet
            raise
        return getattr(module, "command", None)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise  # click's own exits and usage errors (exit 2) keep their meaning
        except QForensicsError as exc:
            click.echo(f"Error: {_one_line(exc)}", err=True)
            ctx.exit(EXIT_USAGE)
        except KeyboardInterrupt:
            click.echo("Interrupted.", err=True)
            ctx.exit(130)
        except Exception as exc:  # a bug: one line, never read as a finding
            if _debug():
                traceback.print_exc(file=sys.stderr)
            click.echo(f"Internal error: {type(exc).__name__}: {_one_line(exc)} (a bug in "
                       f"qforensics; rerun with {DEBUG_ENV}=1 for the traceback and report it)",
                       err=True)
            ctx.exit(EXIT_INTERNAL)


def _debug() -> bool:
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


def _one_line(exc: BaseException, limit: int = 400) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="qforensics")
def main() -> None:
    """Forensics for failures of quantized LLMs.

    \b
    Capture a failing run, find the first NaN and the module that produced it,
    replay the suspect kernel tile, and write an incident report.

    \b
    Exit status: 0 healthy, 1 a FAILED or SUSPECT finding, 2 bad usage or
    unreadable input, 3 an internal error (set QFORENSICS_DEBUG=1 for its
    traceback).

    \b
    Example:
        qforensics record -o trace.h5 -- python serve_once.py --prompt "hi"
        qforensics analyze trace.h5
        qforensics report trace.h5 -o incident.html
    """


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
