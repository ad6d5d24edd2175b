"""Child processes that do not outlive the qforensics process that started them.

`whatif` starts vLLM (``qforensics.demo.vllm_serve``) and llmcompressor
(``qforensics.whatif.llmc_worker``) in sessions of their own, so that their whole process group
(vLLM's engine and worker processes included) can be killed when they are done. A parent that
ends normally, or by Ctrl-C, does that itself (``whatif.through_vllm.wait_group``); one that is
SIGKILLed (an OOM kill, a CI timeout) cannot, and without this module its children would go on
serving or calibrating, holding memory and CPU, with nobody to read what they write.

The parent adds ``QFORENSICS_PARENT_PID`` to the child's environment (`child_env`); the child
calls `watch_parent` first thing. A daemon thread then checks once per `interval` whether the
child was re-parented (its parent is gone) and, when it was, kills the child's process group
(the child leads it: it was started with ``start_new_session=True``), or only the child itself
when it does not lead its group. Standard library only: the llmc venv imports it too.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Mapping

ENV = "QFORENSICS_PARENT_PID"


def child_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` plus this process's pid, for a child that is to call `watch_parent`."""
    return {**env, ENV: str(os.getpid())}


def watch_parent(interval: float = 1.0) -> bool:
    """In a child started with `child_env`: end this process (and the process group it leads)
    once its parent is gone. Returns whether it watches (False without a valid pid in the
    environment). The variable is removed, so that this process's own children do not
    inherit it."""
    raw = os.environ.pop(ENV, "")
    try:
        parent = int(raw)
    except ValueError:
        return False
    if parent <= 1:
        return False

    def gone() -> None:
        if os.getpgrp() == os.getpid():
            os.killpg(os.getpid(), signal.SIGKILL)  # vLLM's engine and workers, and this
        os.kill(os.getpid(), signal.SIGKILL)

    if os.getppid() != parent:  # already orphaned before it could start watching
        gone()

    def watch() -> None:
        while True:
            time.sleep(interval)
            if os.getppid() != parent:
                gone()

    threading.Thread(target=watch, name="qforensics-lifeline", daemon=True).start()
    return True
