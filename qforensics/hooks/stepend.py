"""The end of a step on the host: one StepBatch of the step's records (read from the stats op's
ring by hooks/graphlate.py), the runtime guard's incidents noted since the last step and the
parameter watch's rows, handed to the flight recorder and the writer.

A mixin of the capture session (hooks/session.py): it reads the session's step state and
writes nothing else but the incidents it notes.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from qforensics.hooks.assemble import build_batch
from qforensics.trace import schema
from qforensics.trace.badstep import bad_steps

log = logging.getLogger("qforensics.hooks.capture")

if TYPE_CHECKING:
    from qforensics.hooks.adapter import EngineAdapter
    from qforensics.hooks.paramwatch import ParamWatch
    from qforensics.hooks.recorder import FlightRecorder
    from qforensics.hooks.snapshots import Snapshots
    from qforensics.trace.writer import TraceWriter


class StepEnd:
    _logits: torch.Tensor | None
    _step_ids: torch.Tensor | None
    _snaps: "Snapshots | None"
    _recorder: "FlightRecorder | None"
    _writer: "TraceWriter | None"
    _incidents: list[np.ndarray]
    _watch: "ParamWatch | None"
    _names: list[str]
    _step_t0: float
    _step_first_call: int
    _next_call: int
    options: dict[str, Any]
    step: int
    adapter: "EngineAdapter"

    # -- incidents (runtime guard) ---------------------------------------------------------
    def record_incident(self, module: str, action: str, *, nan_count: int = 0,
                        inf_count: int = 0, detail: str = "", call_index: int = -1) -> None:
        """Note a runtime-guard trip; it is written with the current (or next) step."""
        try:
            row = np.zeros(1, schema.incident_dtype())
            row["step"] = max(self.step, 0)
            row["call_index"] = call_index
            try:
                row["module_id"] = self._names.index(module)
            except ValueError:
                row["module_id"] = -1
            row["module"] = module.encode("utf-8", "replace")[:128]
            row["action"] = action.encode()[:24]
            row["nan_count"], row["inf_count"] = nan_count, inf_count
            row["detail"] = detail.encode("utf-8", "replace")[:160]
            self._incidents.append(row)
        except Exception as exc:  # noqa: BLE001 - never break the guard or the run
            log.warning("qforensics: could not record an incident (%s)", exc)

    def _watch_tick(self) -> None:
        """The step's interval check of the parameters, on the model's thread at the step's
        end, whenever its records are built (hooks/paramwatch.py `tick`)."""
        if self._watch is not None:
            try:
                self._watch.tick(self.step)
            except Exception as exc:  # noqa: BLE001 - never break the run: stop watching
                log.warning("qforensics: parameter watch off (%s)", exc)
                self._watch = None

    def _watch_close(self) -> np.ndarray:
        """The watch's last check at close (hooks/paramwatch.py): its /param_watch rows."""
        if self._watch is None:
            return np.zeros(0, schema.param_watch_dtype())
        try:
            return self._watch.close(self.step)
        except Exception as exc:  # noqa: BLE001 - never break the close
            log.warning("qforensics: parameter watch's last check failed (%s)", exc)
            return np.zeros(0, schema.param_watch_dtype())

    def _emit_batch(self, parts: list[dict[str, Any]], *, step: int, t0: float,
                    t_end: float | None, first_call: int, next_call: int,
                    logits_row: np.ndarray | None, ids: np.ndarray, complete: bool,
                    incidents: list[np.ndarray], kind: dict[str, Any],
                    detail: bool = True) -> None:
        """One step's batch to the flight recorder and the writer: now, or (compiled mode on
        a GPU, hooks/graphlate.py) a step late, from what the host noted at its end (`detail`
        False: only that, its ring detail spilled)."""
        assert self._writer is not None and self._snaps is not None
        snaps, data = self._snaps.take()
        batch = build_batch(
            parts, step=step, t0=t0, t_end=t_end, first_call=first_call,
            next_call=next_call, logits_row=logits_row, ids=ids, complete=complete,
            snaps=snaps, data=data,
            incidents=(np.concatenate(incidents) if incidents
                       else np.zeros(0, schema.incident_dtype())),
            channel_dtype=self.options["channel_dtype"], detail=detail)
        if self._watch is not None:  # every N steps, and at once on a non-finite step
            try:
                warm = np.full(len(batch.steps), bool(kind.get("warmup")))
                batch.params = self._watch.step_end(  # read now: labelled with the
                    step, bool(bad_steps(batch.steps, warmup=warm).any()),  # model's step
                    now=self.step)
            except Exception as exc:  # noqa: BLE001 - never break the run: stop watching
                log.warning("qforensics: parameter watch off (%s)", exc)
                self._watch = None
        if self._recorder is not None:
            self._recorder.apply(batch, **kind)
        self._writer.submit(batch)
