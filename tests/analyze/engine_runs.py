"""Synthetic serving-engine (vLLM-shaped) traces for the bad-request tests, written through the
real TraceWriter (no torch).

A step is one engine forward over the token rows of several requests: a prefill row per prompt
token at the request's first step, then one decode row a step. Each hooked module has an input
and an output record whose per-token maxima hold one value per token row (NaN where that row is
non-finite), and the root's records at the logits call are the logits (one row per request,
batch order) and the row flags vLLM's adapter writes (schema.ENGINE_ROW_FLAG_SLOTS). The engine
tables go in batches of their own before each step, as the adapter submits them.

`Req(name, start, prompt, steps)`: a request whose prefill runs at step `start` and that
decodes for `steps` more steps (its decode row at step start + 1 + k has position prompt + k).
`nan[(step, name)] = {position: module}`: from that module's output on, the row of that
position is non-finite (later modules' inputs and outputs too), and so is the request's logits
row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qforensics.trace import schema
from qforensics.trace.writer import StepBatch, TraceWriter

N_MOD = 6  # hooked linears; the root is module N_MOD
MODULES = [{"name": f"model.layers.{i}.proj", "type": "Linear", "kind": "linear", "info": "{}"}
           for i in range(N_MOD)] + [{"name": "", "type": "Model", "kind": "root", "info": "{}"}]
ROOT = N_MOD


@dataclass
class Req:
    name: str
    start: int
    prompt: int
    steps: int  # decode steps after the prefill

    def rows_at(self, step: int) -> tuple[list[int], int] | None:
        """(positions, phase) of its token rows at `step`, None when not scheduled."""
        if step == self.start:
            return list(range(self.prompt)), 0
        k = step - self.start - 1
        if 0 <= k < self.steps:
            return [self.prompt + k], 1
        return None

    def step_at(self, position: int) -> int:
        """The decode step whose row has `position`."""
        return self.start + 1 + position - self.prompt


def token(req: int, position: int) -> int:
    return 1000 * (req + 1) + position  # every request's tokens differ


def writer(path, max_bytes: int = 0, *, window: int = 4) -> TraceWriter:
    env = {"python": "3", "engine": {"name": "vllm", "version": "0.0-test"}}
    return TraceWriter(path, modules=MODULES, environment=env,
                       capture_options={"trigger_window": window, "snapshot_budget": 1 << 20},
                       ring_slots=8, ring_chunk=512, max_bytes=max_bytes)


def _engine(step: int, rows: list[tuple[int, int, int]], new: list[tuple[int, Req]]
            ) -> StepBatch:
    st = np.zeros(1, schema.engine_dtype("steps"))
    st["step"], st["n_rows"] = step, len(rows)
    st["n_requests"] = len({r for r, _, _ in rows})
    er = np.zeros(len(rows), schema.engine_dtype("rows"))
    er["step"], er["row"] = step, np.arange(len(rows))
    if rows:
        er["request"], er["position"], er["phase"] = zip(*rows)
    tables = {"steps": st, "rows": er}
    if new:
        rq = np.zeros(len(new), schema.engine_dtype("requests"))
        rq["request"] = [i for i, _ in new]
        rq["request_id"] = [r.name.encode() for _, r in new]
        rq["prompt_tokens"] = [r.prompt for _, r in new]
        rq["first_step"] = step
        tables["requests"] = rq
    e = np.zeros(0, np.float32)
    return StepBatch(steps=np.zeros(0, schema.step_dtype()),
                     records=np.zeros(0, schema.record_dtype()), chan_min=e, chan_max=e,
                     tok_absmax=e, input_ids=np.zeros(0, np.int64), engine=tables)


def _step(step: int, rows: list[tuple[int, int, int]], bad_from: list[int | None],
          wide: int = 0) -> StepBatch:
    """The step's records: every module's input and output over the token rows, then the
    root's logits, logits-row flags and hidden-row flags. `wide`: the first module's input
    also keeps per-channel ranges over that many channels (a step as large as a real model's)."""
    n = len(rows)
    order = list(dict.fromkeys(r for r, _, _ in rows))  # batch order = logits row order
    last = {r: i for i, (r, _, _) in enumerate(rows)}  # a request's logits: its last row
    # per-token maxima of module m's input (io 0) and output (io 1): NaN from `bad_from` on
    b = np.array([N_MOD + 1 if x is None else x for x in bad_from], np.int64)
    m = np.arange(N_MOD)[:, None]
    vals = [np.where((m > b) | ((m == b) & (io == schema.IO_OUTPUT)), np.nan, 1.0)
            for io in (schema.IO_INPUT, schema.IO_OUTPUT)]
    per = [row for mm in range(N_MOD) for row in (vals[0][mm], vals[1][mm])]
    row_bad = b <= N_MOD
    lg_bad = np.array([row_bad[last[r]] for r in order], bool)
    per += [np.where(lg_bad, np.nan, 5.0), lg_bad.astype(float), row_bad.astype(float)]
    k = len(per)
    rec = np.zeros(k, schema.record_dtype())
    rec["step"] = step
    rec["call_index"] = step * 100 + np.minimum(np.arange(k) // 2, N_MOD)
    rec["module_id"] = np.minimum(np.arange(k) // 2, ROOT)
    rec["io"] = [io for _ in range(N_MOD) for io in (0, 1)] + [1, 1, 1]
    rec["slot"][-2:] = [schema.ENGINE_ROW_FLAG_SLOTS["logits"],
                        schema.ENGINE_ROW_FLAG_SLOTS["hidden"]]
    lens = np.array([len(v) for v in per])
    rec["channels"], rec["rows"], rec["numel"] = 16, lens, 16 * lens
    rec["chan_offset"] = -1
    rec["tok_offset"] = np.concatenate([[0], np.cumsum(lens)[:-1]])
    rec["tok_count"] = lens
    for i, v in enumerate(per):
        bad = ~np.isfinite(v)
        rec["nan_count"][i] = int(bad.sum()) * 16
        rec["absmax"][i] = float(np.abs(v[~bad]).max()) if (~bad).any() else np.nan
    rec["min"], rec["max"] = -rec["absmax"], rec["absmax"]
    st = np.zeros(1, schema.step_dtype())
    st["step"], st["t_start"], st["duration"] = step, step * 0.05, 0.04
    st["complete"], st["record_count"], st["n_calls"] = 1, len(rec), N_MOD + 1
    st["first_call"] = step * 100
    st["token_count"], st["has_logits"] = n, 1
    bad_rec = np.nonzero(rec["nan_count"] > 0)[0]
    st["n_nonfinite_records"] = len(bad_rec)
    st["first_nonfinite_record"] = int(bad_rec[0]) if len(bad_rec) else -1
    st["first_nonfinite_call"] = int(rec["call_index"][bad_rec[0]]) if len(bad_rec) else -1
    st["logits_nan"] = int(lg_bad.sum()) * 16
    st["logits_min"], st["logits_max"], st["logits_mean"] = -5.0, 5.0, 0.5
    rng = np.random.default_rng(step)  # a healthy decode's logits statistics
    st["logits_std"], st["logits_entropy"] = 2.0 + rng.random(), 1.0 + rng.random()
    st["logits_argmax"] = rng.integers(100, 5000)
    st["logits_top5_ids"] = st["logits_argmax"] + np.arange(5)
    st["logits_top5_values"] = 5.0 - np.arange(5, dtype=np.float32)
    ids = np.array([token(r, p) for r, p, _ in rows], np.int64)
    e = np.zeros(wide, np.float32)
    if wide:
        rec["channels"][0], rec["chan_offset"][0] = wide, 0
        rec["numel"][0] = wide * rec["rows"][0]
    return StepBatch(steps=st, records=rec, chan_min=e - 1, chan_max=e + 1,
                     tok_absmax=np.concatenate(per).astype(np.float32), input_ids=ids)


def write_run(path, reqs: list[Req], n_steps: int,
              nan: dict[tuple[int, str], dict[int, int]] | None = None,
              stay_bad_from: int | None = 0, max_bytes: int = 0,
              rows_lost: frozenset[int] = frozenset(), wide: int = 0) -> None:
    """Write the run. A request stays bad after it went bad: from module `stay_bad_from`'s
    output on, its rows of every later step (its KV cache holds the NaN; None: it recovers).
    `rows_lost`: steps whose /engine rows are not written (their records are); `wide`: see
    `_step`."""
    nan = nan or {}
    w = writer(path, max_bytes)
    bad_since: dict[str, int] = {}
    seen: set[str] = set()
    for step in range(n_steps):
        rows, bad_from, new = [], [], []
        for i, r in enumerate(reqs):
            got = r.rows_at(step)
            if got is None:
                continue
            if r.name not in seen:
                seen.add(r.name)
                new.append((i, r))
            here = nan.get((step, r.name), {})
            for p in got[0]:
                rows.append((i, p, got[1]))
                if p in here:
                    bad_from.append(here[p])
                elif r.name in bad_since and stay_bad_from is not None:
                    bad_from.append(stay_bad_from)
                else:
                    bad_from.append(None)
            if here:
                bad_since.setdefault(r.name, step)
        w.submit(_engine(step, [] if step in rows_lost else rows, new))
        w.submit(_step(step, rows, bad_from, wide))
        if step % 64 == 63:
            w.flush()
    w.close()
