"""One non-finite policy for JSON, inside traces and out (jsondoc's): NaN, Infinity and
-Infinity are written as the strings "nan", "inf", "-inf" and read back as floats; traces
written before (bare NaN / Infinity constants) still read, Infinity as inf; a non-finite number
where an integer belongs is refused with the field's path."""

from __future__ import annotations

import json
import math
import os
import sys

import h5py
import numpy as np
import pytest

from qforensics import jsondoc
from qforensics.errors import TraceFormatError
from qforensics.trace import schema
from qforensics.trace.layout import json_attr, set_meta
from qforensics.trace.reader import open_trace
from qforensics.trace.validate import parse_json
from qforensics.trace.writer import StepBatch, TraceWriter

sys.path.insert(0, os.path.dirname(__file__))
from budget_batches import batch  # noqa: E402

NONFINITE = {"pos": math.inf, "neg": -math.inf, "nan": math.nan}


def _same(got, want) -> bool:
    if isinstance(want, float) and math.isnan(want):
        return isinstance(got, float) and math.isnan(got)
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(
            _same(got[k], want[k]) for k in want)
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(
            _same(g, w) for g, w in zip(got, want))
    return type(got) is type(want) and got == want


def _trace(path, env, info) -> None:
    mods = [{"name": "layers.0.proj", "type": "Linear", "kind": "linear",
             "info": json_attr(info)},
            {"name": "", "type": "Model", "kind": "root", "info": "{}"}]
    w = TraceWriter(path, modules=mods, environment=env, capture_options={"note": math.inf},
                    flush_interval=0.05)
    b = batch(0)
    b.records = b.records[(b.records["module_id"] < 2)]
    b.records["module_id"] = np.arange(len(b.records)) % 2
    b.steps["record_count"] = len(b.records)
    w.submit(b)
    w.close()


def test_infinity_and_nan_survive_a_round_trip_through_a_trace(tmp_path):
    p = tmp_path / "t.h5"
    env = {"python": "3", "limits": dict(NONFINITE), "spread": [math.inf, 1.5, -math.inf],
           "text": "a string stays a string", "np": np.float32("inf")}
    info = {"health": {"weight": {"numel": 4, "absmax": math.inf, "mean": math.nan}}}
    _trace(p, env, info)
    set_meta(p, "outcome", {"worst": -math.inf})
    with h5py.File(p, "r") as f:  # never a bare constant on disk: the strings of jsondoc
        for key in ("environment", "capture_options", "outcome"):
            raw = f["meta"].attrs[key]
            raw = raw.decode() if isinstance(raw, bytes) else str(raw)
            assert "Infinity" not in raw and "NaN" not in raw, raw
            assert '"inf"' in raw or '"-inf"' in raw, raw
        cell = f["modules/info"][0]
        cell = cell.decode() if isinstance(cell, bytes) else str(cell)
        assert json.loads(cell) == {"health": {"weight": {"numel": 4, "absmax": "inf",
                                                          "mean": "nan"}}}
    want_env = dict(env, np=math.inf)
    with open_trace(p) as t:
        meta = t.meta
        got_env = {k: meta["environment"][k] for k in want_env}
        assert _same(got_env, want_env), got_env
        assert meta["capture_options"]["note"] == math.inf
        assert meta["outcome"] == {"worst": -math.inf}
        assert _same(t.module_info(0), info)
    # the same policy as every document jsondoc writes
    assert json.loads(json_attr(NONFINITE)) == json.loads(jsondoc.dumps(NONFINITE))


def test_a_trace_written_with_bare_constants_still_reads(tmp_path):
    """Before the one policy the writer wrote bare NaN / Infinity / -Infinity."""
    p = tmp_path / "old.h5"
    _trace(p, {"python": "3"}, {})
    old = '{"limits": {"neg": -Infinity, "nan": NaN, "pos": Infinity}, "python": "3"}'
    with h5py.File(p, "r+") as f:
        f["meta"].attrs["environment"] = old
        f["modules/info"][0] = '{"health": {"weight": {"absmax": Infinity, "numel": 4}}}'
    with open_trace(p) as t:
        assert _same(t.meta["environment"]["limits"], NONFINITE)
        assert t.module_info(0)["health"]["weight"]["absmax"] == math.inf


@pytest.mark.parametrize("shape", [b"[Infinity, 2]", b"[NaN]", b'["inf", 2]', b'[2, "nan"]'])
def test_a_non_finite_number_where_an_integer_belongs_is_refused_with_its_path(tmp_path, shape):
    p = tmp_path / "t.h5"
    w = TraceWriter(p, modules=[{"name": "", "type": "Model", "kind": "root"}],
                    environment={"python": "3"}, capture_options={}, flush_interval=0.05)
    row = np.zeros(1, schema.snapshot_dtype())
    row["call_index"], row["reason"] = 1, b"first_nonfinite_output"
    row["name"], row["dtype"], row["shape"], row["nbytes"] = b"input.0", b"float32", shape, 16
    w.submit(StepBatch(steps=np.zeros(0, schema.step_dtype()),
                       records=np.zeros(0, schema.record_dtype()), chan_min=np.zeros(0),
                       chan_max=np.zeros(0), tok_absmax=np.zeros(0),
                       input_ids=np.zeros(0, np.int64), snapshots=row,
                       snapshot_bytes=np.zeros(16, np.uint8)))
    w.close()
    with open_trace(p) as t:
        with pytest.raises(TraceFormatError, match=r"snapshot 'input.0' of call 1: bad shape"):
            t.snapshot_tensors(1)


def test_parse_json_reads_both_spellings():
    assert _same(parse_json('[Infinity, -Infinity, NaN, "inf", "-inf", "nan", "x"]', "w"),
                 [math.inf, -math.inf, math.nan, math.inf, -math.inf, math.nan, "x"])
    assert parse_json('{"inf": 1}', "w") == {"inf": 1}  # keys stay text
