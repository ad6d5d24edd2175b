"""`qforensics record -o trace.h5 -- python script.py ...`: capture an unmodified program."""

from __future__ import annotations

import glob
import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import click

from qforensics.cli.options import capture_kwargs, capture_options
from qforensics.errors import QForensicsError

BOOTSTRAP = Path(__file__).resolve().parent.parent / "_bootstrap"


def _env(out: str, opts: dict[str, Any], attach: str, guard: str | None,
         eager: bool = False) -> dict[str, str]:
    env = {
        "QFORENSICS_TRACE": os.path.abspath(out),
        "QFORENSICS_OPTIONS": json.dumps(opts),
        "QFORENSICS_ATTACH": attach,
        "PYTHONPATH": os.pathsep.join([str(BOOTSTRAP)] + (
            [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])),
    }
    if guard:
        env["QFORENSICS_GUARD"] = guard
    if eager:
        env["QFORENSICS_VLLM_EAGER"] = "1"
    return env


def _summarize(pattern: str) -> list[str]:
    from qforensics.trace.reader import open_trace

    paths = _trace_paths(pattern)
    lines = []
    for p in paths:
        try:
            with open_trace(p) as t:
                lines.append(f"  {p}: {t.n_steps} steps; {t.end.reason}")
        except QForensicsError as exc:
            lines.append(f"  {p}: unreadable ({exc})")
    return lines


def _become_subreaper() -> bool:
    """Linux: orphaned descendants (a server's engine processes, still sealing their traces
    after the server itself exited on SIGTERM) are re-parented to us, so that we can wait for
    them before reading the traces."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except Exception:
        return False


def _trace_paths(pattern: str) -> list[str]:
    root, ext = os.path.splitext(pattern.replace("{rank}", "*"))
    return sorted(set(glob.glob(pattern.replace("{rank}", "*")) + glob.glob(f"{root}-*{ext}")))


def _sealed(path: str) -> bool:
    from qforensics.trace.reader import open_trace

    try:
        with open_trace(path) as t:
            return t.end.complete and not t.cut_short and bool(t.meta.get("status"))
    except QForensicsError:
        return False


def _wait_for_writers(pattern: str, timeout: float = 30.0) -> None:
    """After the program exited: wait (at most `timeout` s) while a descendant of ours still
    runs and a trace is not sealed yet: a killed writer never seals, so the wait also ends
    when no descendant is left."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return  # no descendant left: every writer has ended, sealed or not
        if pid:
            continue
        if all(_sealed(p) for p in _trace_paths(pattern)):
            return
        time.sleep(0.2)


@click.command(context_settings={"ignore_unknown_options": True})
@click.option("-o", "--output", "out", default="trace.h5", show_default=True,
              help='Trace path; "{rank}" becomes the rank (one file per rank).')
@capture_options
@click.option("--attach", type=click.Choice(["first", "all"]), default="first",
              show_default=True, help="Capture the first model the program runs, or every one.")
@click.option("--guard", "guard_on", is_flag=True,
              help="Also run the runtime NaN/Inf guard (rerun + per-layer dense fallback + "
                   "breaker); its trips are written into the trace as incidents. In vLLM it runs "
                   "in each worker: a per-request check of the logits, the tripped layer "
                   "dequantized from vLLM's own weights, one incident per affected request.")
@click.option("--guard-check", type=click.Choice(["logits", "modules"]), default="logits",
              show_default=True, help="Guard: check only the logits (one sync per step) or "
                                      "every quantized linear.")
@click.option("--eager", is_flag=True,
              help="vLLM: run the model without torch.compile and CUDA graphs (enforce_eager). "
                   "Not needed to record the layers (compiled mode records them from inside "
                   "the graph); eager mode also keeps snapshots for replay and gives the "
                   "guard its layer fallbacks.")
@click.option("--print-env", is_flag=True,
              help="Print the environment variables that attach capture (for launchers that "
                   "cannot be wrapped) and exit.")
@click.argument("cmd", nargs=-1, type=click.UNPROCESSED)
def command(out: str, attach: str, guard_on: bool, guard_check: str, eager: bool,
            print_env: bool, cmd: tuple[str, ...], **capture: Any) -> None:
    """Run an unmodified program with capture hooks on the first torch model it runs.

    Works for any Python program started by CMD (also through shell scripts and
    launchers such as torchrun, which pass the environment on). In vLLM, capture attaches
    in each worker process that runs the model, one file per rank. The exit code is the
    program's own. A crash or kill keeps every step flushed before it.

    \b
    Example:
        qforensics record -o trace.h5 -- python serve_once.py --prompt "hi"
        qforensics record -o 'trace-{rank}.h5' -- torchrun --nproc-per-node 2 run.py
        qforensics record --eager -o 't-{rank}.h5' -- python serve_with_vllm.py
        qforensics record --guard -o guarded.h5 -- python serve_once.py
        qforensics record --guard -o 'g-{rank}.h5' -- python serve_with_vllm.py
        eval "$(qforensics record -o trace.h5 --print-env)"   # then start your launcher
    """
    opts = capture_kwargs(**capture)
    env = _env(out, opts, attach, json.dumps({"check": guard_check}) if guard_on else None,
               eager)
    if print_env:
        for k, v in env.items():
            click.echo(f"export {k}={shlex.quote(v)}")
        return
    if not cmd:
        raise click.UsageError("give the program to run after --, e.g. "
                               "qforensics record -o trace.h5 -- python run.py")
    full_env = {**os.environ, **env}
    click.echo(f"qforensics: recording {shlex.join(cmd)} -> {out}", err=True)
    reaper = _become_subreaper()
    try:
        proc = subprocess.Popen(list(cmd), env=full_env)
    except FileNotFoundError:
        raise click.UsageError(f"command not found: {cmd[0]}") from None

    def forward(signum: int, frame: Any) -> None:
        proc.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        rc = proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if reaper:
        _wait_for_writers(os.path.abspath(out))
    lines = _summarize(os.path.abspath(out))
    if lines:
        click.echo("qforensics: trace written:", err=True)
        for line in lines:
            click.echo(line, err=True)
        click.echo(f"qforensics: next: qforensics analyze {shlex.quote(out)}", err=True)
    else:
        click.echo("qforensics: no trace was written (the program never ran a torch model "
                   "with Linear layers)", err=True)
    sys.exit(rc if rc >= 0 else 128 - rc)
