"""The reader's numpy views: `Table` itself, `record_table` / `record_columns` / `step_table`
against plain h5py reads of the same file, the arrays it shares being read-only, and reading a
trace without importing pandas."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import h5py
import numpy as np
import pytest

from qforensics.trace import schema
from qforensics.trace.reader import open_trace
from qforensics.trace.table import Table

from hostile import FAILING, PASSING, sample


def _text(values: list[str]) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def test_table_selects_rows_by_mask_positions_and_slice():
    t = Table({"a": np.array([10, 11, 12, 13]), "b": np.arange(8).reshape(4, 2),
               "name": _text(["w", "x", "y", "z"])})
    assert len(t) == 4 and t.columns == ["a", "b", "name"] and "b" in t and "c" not in t
    m = t.take(np.array([True, False, True, False]))
    assert m["a"].tolist() == [10, 12] and m["b"].tolist() == [[0, 1], [4, 5]]
    p = t.take([3, 0])
    assert p["name"].tolist() == ["z", "w"] and len(p) == 2
    s = t.take(slice(1, 3))
    assert s["a"].tolist() == [11, 12] and len(s) == 2
    assert t.take(slice(4, 4)).empty and t.take(np.zeros(4, bool)).empty
    row = t.row(2)
    assert row["a"] == 12 and row["name"] == "y" and row["b"].tolist() == [4, 5]
    w = t.with_columns(a=np.array([0, 0, 0, 0]))
    assert w["a"].tolist() == [0, 0, 0, 0] and t["a"].tolist() == [10, 11, 12, 13]


def test_table_refuses_unequal_columns_and_masks_of_another_length():
    with pytest.raises(ValueError, match="unequal length"):
        Table({"a": np.zeros(3), "b": np.zeros(2)})
    with pytest.raises(ValueError, match="mask"):
        Table({"a": np.zeros(3)}).take(np.ones(2, bool))


def test_table_to_frame_matches_a_frame_built_from_lists():
    import pandas as pd

    t = Table({"i": np.array([1, 2], np.int32), "v": np.zeros((2, 3)),
               "s": _text(["p", "q"])})
    df = t.to_frame()
    assert list(df.columns) == ["i", "s", "v"]  # trailing-dimension columns come last
    assert df["i"].dtype == np.int32 and df["s"].tolist() == ["p", "q"]
    assert df["s"].dtype == pd.DataFrame({"s": ["p", "q"]})["s"].dtype
    assert [list(v) for v in df["v"]] == [[0, 0, 0], [0, 0, 0]]
    empty = Table({"s": _text([])}).to_frame()  # as pandas types an empty list
    assert empty["s"].dtype == pd.DataFrame({"s": []})["s"].dtype


@pytest.mark.parametrize("name", [PASSING, FAILING])
def test_record_and_step_tables_match_plain_h5py(name):
    path = sample(name)
    with h5py.File(path, "r") as f:
        steps = {c: f[f"steps/{c}"][:] for c, _, _ in schema.STEP_COLUMNS}
        recs = {c: f[f"records/{c}"][:] for c, _, _ in schema.RECORD_COLUMNS}
        names = [v.decode() if isinstance(v, bytes) else str(v) for v in f["modules/name"][:]]
    plain = [c for c, _, _ in schema.RECORD_COLUMNS if c != "chan_offset"]  # ring-resolved
    with open_trace(path) as tr:
        st = tr.step_table
        for c in steps:
            assert np.array_equal(st[c], steps[c], equal_nan=True), c
        for i in (0, len(st) // 2, len(st) - 1):
            lo, n = int(steps["record_offset"][i]), int(steps["record_count"][i])
            t = tr.record_table(int(steps["step"][i]))
            assert t["row"].tolist() == list(range(lo, lo + n))
            for c in plain:
                assert np.array_equal(t[c], recs[c][lo:lo + n], equal_nan=True), c
            assert t["module"].tolist() == [names[m] for m in recs["module_id"][lo:lo + n]]
            df = tr.records(int(steps["step"][i]))
            assert df["row"].tolist() == t["row"].tolist()
            assert df["module"].tolist() == t["module"].tolist()
        end = int((steps["record_offset"] + steps["record_count"]).max())
        cols = tr.record_columns(["absmax", "step", "dtype"])
        for c in ("absmax", "step", "dtype"):
            assert np.array_equal(cols[c], recs[c][:end], equal_nan=True), c


def test_shared_arrays_are_read_only():
    with open_trace(sample(FAILING)) as tr:
        cols = tr.record_columns(["absmax", "nan_count"])
        step = int(tr.step_table["step"][0])
        for a in (cols["absmax"], cols["nan_count"], tr.step_table["logits_nan"],
                  tr.record_table(step)["nan_count"], tr.module_names):
            with pytest.raises(ValueError, match="read-only"):
                a[0] = a[0]
        before = int(tr.record_table(step)["nan_count"][0])
        df = tr.records(step)  # the pandas views are copies the caller may change
        df.loc[0, "nan_count"] = before + 7
        assert int(tr.record_table(step)["nan_count"][0]) == before
        assert int(tr.records(step)["nan_count"].iloc[0]) == before


def test_analysis_and_report_never_import_pandas(tmp_path):
    code = textwrap.dedent(f"""
        import sys
        from qforensics.analyze import analyze_trace
        from qforensics.reports import write_report
        for name in ({PASSING!r}, {FAILING!r}):
            path = {str(sample(PASSING).parent)!r} + "/" + name + ".h5"
            analyze_trace(path)
            write_report(path, {str(tmp_path)!r} + "/" + name + ".html")
        print("pandas" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"
