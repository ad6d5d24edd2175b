"""The end of a step: finish the device side of what the hooks took, bring it to the host in
one transfer per device, assemble the step's records (with the runtime guard's incidents noted
since the last step) and hand one StepBatch to the writer.

A mixin of the capture session (hooks/session.py): it reads the session's step state
(`_pending`, `_logits`, `_step_ids`, `_partial`, ...) and writes nothing else but the
incidents it notes.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from qforensics.hooks import planunpack, reduce
from qforensics.hooks.assemble import UniqueStats, assemble_records, build_batch
from qforensics.trace import schema
from qforensics.trace.badstep import bad_steps

log = logging.getLogger("qforensics.hooks.capture")

if TYPE_CHECKING:
    from qforensics.hooks.adapter import EngineAdapter
    from qforensics.hooks.paramwatch import ParamWatch
    from qforensics.hooks.pending import PendingStep
    from qforensics.hooks.recorder import FlightRecorder
    from qforensics.hooks.snapshots import Snapshots
    from qforensics.trace.writer import TraceWriter


class StepEnd:
    _pending: "PendingStep"
    _logits: torch.Tensor | None
    _step_ids: torch.Tensor | None
    _partial: list[dict[str, Any]]
    _snaps: "Snapshots | None"
    _recorder: "FlightRecorder | None"
    _writer: "TraceWriter | None"
    _incidents: list[np.ndarray]
    _watch: "ParamWatch | None"
    _names: list[str]
    _track_versions: bool
    _step_t0: float
    _step_first_call: int
    _next_call: int
    options: dict[str, Any]
    step: int
    adapter: "EngineAdapter"

    def _reduce_pending(self, final: bool = False, complete: bool = True) -> None:
        """Finish the device side of what the hooks took (see hooks/pending.py) and bring it
        to the host in ONE transfer per device.

        Fast pass (reduce.fast_group / fast_one): sums, sums of squares, per-channel and
        per-token min/max, all NaN-propagating, so a record whose stats come back finite provably
        had no NaN/Inf. Only records whose stats are not finite get the exact, finite-only pass
        (a second reduction and transfer, in failing steps only), on the tensor as its hook saw
        it."""
        p = self._pending
        p.settle()
        chan_io = self.options["channel_io"]
        plan, per_dev = p.reduce_on_device()
        logit_dev = ids_dev = None
        # on CPU the logits figures and the ids are host arrays of their own (nothing to
        # transfer): a plan's step vector then stays whole, without a concatenation
        if final and self._logits is not None:
            lp = reduce.fast_logits(self._logits)
            logit_dev = lp.device if lp.device.type != "cpu" else "cpu-logits"
            per_dev.setdefault(logit_dev, []).append(lp)
        n_ids = 0
        if final and self._step_ids is not None and self._step_ids.numel():
            ids_t = self._step_ids.reshape(-1)[:65536].to(torch.float32)  # exact < 2**24
            n_ids = ids_t.numel()
            ids_dev = ids_t.device if ids_t.device.type != "cpu" else "cpu-ids"
            per_dev.setdefault(ids_dev, []).append(ids_t)
        # ONE device->host transfer per device
        host = {dev: (torch.cat(parts) if len(parts) > 1 else parts[0]).cpu().numpy()
                for dev, parts in per_dev.items()}
        cursor = {dev: 0 for dev in host}

        meta_arr, which, versions = p.record_arrays()
        orig, seen_u = p.column(0), p.column(4)
        n_u = len(orig)
        need = np.zeros(n_u, bool)
        if chan_io == "all":
            need[:] = True
        elif chan_io == "inputs":
            need[which[meta_arr[:, 2] == schema.IO_INPUT]] = True
        st = UniqueStats(n_u, need)
        described = p.described()
        if described is not None:
            st.set_described(described)
        else:
            st.describe_all(p.column(3))
        split = p.split_out  # set by reduce_on_device on a plan
        up = (planunpack.unpacker(p.plan, plan, need, split is not None)
              if p.plan is not None else None)
        if up is not None:  # on a plan: the same layout as its first step, vectorized
            dev = plan[0][4]
            up.apply(st, host[dev])
            cursor[dev] += up.size
        else:
            st.unpack(plan, host, cursor)
        if split is not None:  # the plan's buffers, in their split layout (after the above)
            split[0].apply(st, split[1])
        logits_row = None
        ids_host = np.zeros(0, np.int64)
        if logit_dev is not None:
            c = cursor[logit_dev]
            logits_row = reduce.logits_row(host[logit_dev][c:c + 15], self._logits)
            cursor[logit_dev] = c + 15
        if ids_dev is not None:
            c = cursor[ids_dev]
            ids_host = host[ids_dev][c:c + n_ids].astype(np.int64)
            cursor[ids_dev] = c + n_ids

        bad = np.nonzero(st.computed & ~np.isfinite(st.sc).all(axis=1))[0]
        if len(bad):  # failing step: exact finite-only stats for the records that need them
            src = seen_u
            if self._track_versions:  # an original changed since its hook: not what it saw
                src = [None if x is not None and x is o and x._version != v else x
                       for x, o, v in zip(src, orig, p.column(1))]
            st.exact_pass(bad, src, p.keep, self.options["channel_limit"])

        keeper = up if up is not None else split[0] if split is not None else None
        part = assemble_records(self.step, self._track_versions, meta_arr,
                                p.record_tensors(which), versions, which, st, chan_io,
                                template=keeper.template if keeper is not None else None)
        if keeper is not None and keeper.template is None:
            keeper.template = part["records"].copy()  # before build_batch rebases offsets
        assert self._snaps is not None
        if not self._snaps.done:  # each record's tensor as its hook saw it
            self._snaps.maybe_snapshot(part, lambda: (
                [tuple(r) for r in meta_arr.tolist()], [seen_u[j] for j in which.tolist()]),
                self.step)
        if final and not self._partial:
            p.learn()  # the whole step in one reduction: its plan serves the next like it
        self._partial.append(part)
        p.clear()
        if final:
            graph = self._graph_part()  # compiled mode: the layers' figures (hooks/graphmode.py)
            if graph is not None:
                self._partial.append(graph)
            self._emit(logits_row, ids_host, complete)

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

    if TYPE_CHECKING:  # hooks/graphmode.py (a mixin of the session, like this one)
        def _graph_part(self) -> dict[str, Any] | None: ...

    def _emit(self, logits_row: np.ndarray | None, ids: np.ndarray, complete: bool) -> None:
        """The open step's batch, from the parts its reductions left (`_partial`)."""
        incidents, self._incidents = self._incidents, []
        self._emit_batch(self._partial, step=self.step, t0=self._step_t0, t_end=None,
                         first_call=self._step_first_call, next_call=self._next_call,
                         logits_row=logits_row, ids=ids, complete=complete,
                         incidents=incidents, kind=self.adapter.step_kind())

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
