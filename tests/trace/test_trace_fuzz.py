"""Property-based fuzzing of the committed sample traces through the CLI, bounded in time
(about a minute in all, derandomized so CI runs the same cases).

Byte flips, truncations and structural mutations (values, deletions, resizes, dtypes, JSON
attributes, links) go through `analyze`, `analyze --json`, `report` and `diff`. Properties: the
command ends with 0, 1 or 2 (never a traceback or an internal error), within a time limit; a
link is refused; and a mutated trace reads PASSED only when its original did and plain h5py
proves the mutation left every input of the verdict unchanged (the per-step summaries, every
record column, the module kinds, the run status and outcome, the format attributes). The parts
no verdict reads (per-channel and per-token arrays, snapshots, module names) may change freely.
"""

from __future__ import annotations

import json
import signal
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from hostile import FAILING, PASSING, Ran, copy, run, sample

SUSPECT_SAMPLE = "int4-per-tensor-weights"  # no NaN, garbage text: SUSPECT
SAMPLES = [PASSING, FAILING, SUSPECT_SAMPLE]
LIMIT_S = 30  # one command on a 1.6 MB trace takes about a second

def fuzz(n: int) -> settings:
    # no shrinking: a failing run stays as short as a passing one (CI time is bounded)
    return settings(max_examples=n, derandomize=True, database=None, deadline=None,
                    print_blob=True, phases=[Phase.explicit, Phase.generate],
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@contextmanager
def _alarm(seconds: int) -> Iterator[None]:
    def hang(*_: Any) -> None:
        raise TimeoutError(f"command still running after {seconds} s")
    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _run(*args: Any) -> Ran:
    with _alarm(LIMIT_S):
        r = run(*args)
    assert r.code in (0, 1, 2), f"exit {r.code} (internal error?): {r.err[-500:]}"
    assert "Traceback" not in r.out + r.err
    if r.code == 2:
        assert r.err.startswith("Error: ") and len(r.err.strip().splitlines()) == 1, r.err
    return r


def verdict_inputs(path: Path) -> dict[str, Any]:
    """Everything a verdict can depend on, read with plain h5py (no qforensics code)."""
    out: dict[str, Any] = {}

    def grab(key: str, get: Any) -> None:
        try:
            out[key] = get()
        except Exception as exc:  # noqa: BLE001 - any failure counts as "changed"
            out[key] = f"unreadable: {type(exc).__name__}"

    try:
        f = h5py.File(path, "r")
    except Exception as exc:  # noqa: BLE001
        return {"file": f"unreadable: {type(exc).__name__}"}
    with f:
        for attr in ("format", "format_version"):
            grab(attr, lambda a=attr: str(f.attrs[a]))
        for table in ("steps", "records"):
            for name in sorted(f[table].keys()) if table in f else []:
                grab(f"{table}/{name}", lambda p=f"{table}/{name}": f[p][:].tobytes())
        grab("modules/kind", lambda: [bytes(v) if isinstance(v, bytes) else str(v)
                                      for v in f["modules/kind"][:]])
        for key in ("status", "outcome"):
            def meta(k: str = key) -> Any:
                if k not in f["meta"].attrs:
                    return None
                doc = json.loads(f["meta"].attrs[k])
                return {a: b for a, b in doc.items() if a != "text"} if isinstance(doc, dict) \
                    else doc
            grab(f"meta@{key}", meta)
    return out


def _status(r: Ran) -> str:
    return r.first.split(" | ")[0]


def no_nonfinite_evidence(path: Path) -> bool:
    """Plain h5py: no record, step summary or logits counts a NaN/Inf, and the run completed."""
    with h5py.File(path, "r") as f:
        zero = all(not np.any(f[p][:] != 0) for p in (
            "records/nan_count", "records/inf_count", "steps/n_nonfinite_records",
            "steps/logits_nan", "steps/logits_inf"))
        none = all(np.all(f[p][:] == -1) for p in ("steps/first_nonfinite_call",
                                                  "steps/first_nonfinite_record"))
        status = json.loads(f["meta"].attrs["status"])
        return zero and none and status.get("state") == "complete"


def _check_no_false_pass(name: str, mutated: Path, r: Ran, *, consistent: bool = False) -> None:
    """A PASSED needs a PASSED original and, for damage the validator cannot see (a flipped
    byte), every verdict input unchanged; a consistent edit (h5py writes a well-formed file)
    may change them but must leave no NaN/Inf evidence behind."""
    if r.code != 0:
        return
    assert name == PASSING, f"{name} mutated reads PASSED: {r.first}"
    before, after = verdict_inputs(sample(name)), verdict_inputs(mutated)
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    if consistent and changed:
        assert no_nonfinite_evidence(mutated), f"PASSED despite NaN/Inf evidence: {changed}"
        return
    assert not changed, f"PASSED although the verdict's inputs changed: {changed}"


# -- byte level ----------------------------------------------------------------------------------
@fuzz(20)
@given(name=st.sampled_from(SAMPLES), where=st.floats(0, 1, exclude_max=True),
       mask=st.integers(1, 255), as_json=st.booleans())
def test_byte_flips(name, where, mask, as_json):
    with tempfile.TemporaryDirectory() as d:
        t = copy(name, Path(d))
        data = bytearray(t.read_bytes())
        i = int(where * len(data))
        data[i] ^= mask
        t.write_bytes(bytes(data))
        r = _run("analyze", t, *(["--json"] if as_json else []))
        if as_json and r.code in (0, 1):
            doc = json.loads(r.out)
            assert (doc["verdict"]["status"] == "PASSED") == (r.code == 0)
        elif r.code in (0, 1):
            assert _status(r) in ("PASSED", "FAILED", "SUSPECT")
        _check_no_false_pass(name, t, r)


@fuzz(6)
@given(name=st.sampled_from(SAMPLES), keep=st.floats(0, 1, exclude_max=True))
def test_truncations(name, keep):
    with tempfile.TemporaryDirectory() as d:
        t = copy(name, Path(d))
        data = t.read_bytes()
        t.write_bytes(data[:int(keep * len(data))])
        r = _run("analyze", t)
        assert r.code != 0, f"a cut-short trace reads PASSED: {r.first}"
        if r.code == 1:
            assert "cut short" in r.out


# -- structural ----------------------------------------------------------------------------------
def _datasets(name: str) -> list[str]:
    paths: list[str] = []
    with h5py.File(sample(name), "r") as f:
        f.visititems(lambda p, o: paths.append(p) if isinstance(o, h5py.Dataset) else None)
    return sorted(paths)


DATASETS = _datasets(PASSING)
EXTREMES = [2**62, 2**63 - 1, -(2**63), -1, 0, 1, 7, float("nan"), float("inf"), -1e30]


def _mutate(f: h5py.File, path: str, how: str, pick: float, value: Any) -> None:
    ds = f[path]
    n = ds.shape[0]
    if how == "delete":
        del f[path]
    elif how == "shrink":
        keep = ds[: int(pick * n)]
        del f[path]
        f.create_dataset(path, data=keep, maxshape=(None, *keep.shape[1:]))
    elif how == "retype":
        data = ds[:]
        del f[path]
        f[path] = data.astype(np.float64) if data.dtype.kind in "iuf" else np.zeros(n, np.int8)
    elif how == "set" and n:
        i = int(pick * n)
        if ds.dtype.kind in "OS":
            ds[i] = "lXnear" if isinstance(value, int) and value > 0 else "\u00ff" * 300
        else:
            cell = np.asarray(value, dtype=np.float64)
            if ds.dtype.kind in "iu":
                info = np.iinfo(ds.dtype)
                v = int(np.clip(np.nan_to_num(cell, posinf=info.max, neginf=info.min),
                                info.min, info.max))
                ds[i] = v
            else:
                with np.errstate(over="ignore", invalid="ignore"):
                    ds[i] = cell.astype(ds.dtype)


@fuzz(22)
@given(name=st.sampled_from(SAMPLES), path=st.sampled_from(DATASETS),
       how=st.sampled_from(["set", "set", "set", "delete", "shrink", "retype"]),
       pick=st.floats(0, 1, exclude_max=True), value=st.sampled_from(EXTREMES))
def test_structural_mutations(name, path, how, pick, value):
    with tempfile.TemporaryDirectory() as d:
        t = copy(name, Path(d))
        with h5py.File(t, "r+") as f:
            if path not in f:
                return
            _mutate(f, path, how, pick, value)
        r = _run("analyze", t)
        _check_no_false_pass(name, t, r, consistent=True)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda kids: st.lists(kids, max_size=3)
                    | st.dictionaries(st.sampled_from(["state", "world_size", "rank",
                                                       "top1_agreement", "x"]), kids, max_size=3),
                    max_leaves=12)


@fuzz(10)
@given(name=st.sampled_from(SAMPLES),
       key=st.sampled_from(["environment", "status", "outcome", "capture_options"]),
       doc=JSON | st.text(max_size=40), depth=st.sampled_from([0, 0, 0, 5000]))
def test_meta_attributes(name, key, doc, depth):
    with tempfile.TemporaryDirectory() as d:
        t = copy(name, Path(d))
        text = doc if isinstance(doc, str) else json.dumps(doc)
        if depth:
            text = "[" * depth + text + "]" * depth
        with h5py.File(t, "r+") as f:
            f["meta"].attrs[key] = text
        r = _run("analyze", t, "--json")
        if r.code in (0, 1):
            json.loads(r.out)
        _check_no_false_pass(name, t, r, consistent=True)


@fuzz(6)
@given(group=st.sampled_from(["", "steps", "records", "meta", "channels", "snapshots/index"]),
       kind=st.sampled_from(["soft", "external", "virtual"]),
       command=st.sampled_from(["analyze", "diff"]))
def test_links_are_refused(group, kind, command):
    with tempfile.TemporaryDirectory() as d:
        t = copy(PASSING, Path(d))
        with h5py.File(t, "r+") as f:
            g = f[group] if group else f
            if kind == "soft":
                g["zz_link"] = h5py.SoftLink("/steps/step")
            elif kind == "external":
                g["zz_link"] = h5py.ExternalLink(str(sample(FAILING)), "/steps/step")
            else:
                layout = h5py.VirtualLayout(shape=(8,), dtype=np.int32)
                layout[:] = h5py.VirtualSource(str(sample(FAILING)), "steps/step", shape=(8,))
                g.create_virtual_dataset("zz_link", layout)
        args = [t] if command == "analyze" else [sample(PASSING), t]
        r = _run(command, *args)
        assert r.code == 2 and "refusing" in r.err, r


@fuzz(5)
@given(where=st.floats(0, 1, exclude_max=True), mask=st.integers(1, 255))
def test_diff_of_a_flipped_trace(where, mask):
    with tempfile.TemporaryDirectory() as d:
        t = copy(SUSPECT_SAMPLE, Path(d))
        data = bytearray(t.read_bytes())
        data[int(where * len(data))] ^= mask
        t.write_bytes(bytes(data))
        _run("diff", sample(PASSING), t)


@pytest.mark.parametrize("mutation", ["flip", "cut"])
def test_report_of_a_damaged_trace(tmp_path, mutation):
    t = copy(FAILING, tmp_path)
    data = bytearray(t.read_bytes())
    if mutation == "flip":
        from hostile import chunk_span
        off, size = chunk_span(t, "records/absmax")
        data[off + size // 2] ^= 0x5A
        t.write_bytes(bytes(data))
    else:
        t.write_bytes(bytes(data[:-1]))
    out = tmp_path / "r.html"
    r = _run("report", t, "-o", out)
    if r.code == 0:
        html = out.read_text()
        assert "could not" in html or "cut short" in html, "the report hides the damage"
