"""The capture (qforensics.hooks) and the guard (qforensics.guard) never import each other;
qforensics.autoattach composes them and qforensics.incidents carries the guard's incidents."""

from __future__ import annotations

import ast
from pathlib import Path

import qforensics

ROOT = Path(qforensics.__file__).resolve().parent


def _imports(package: str) -> set[tuple[str, str]]:
    found = set()
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module:
                found.add((path.name, node.module))
            elif isinstance(node, ast.Import):
                found.update((path.name, a.name) for a in node.names)
    return found


def test_guard_does_not_import_hooks():
    bad = sorted((f, m) for f, m in _imports("guard") if m.startswith("qforensics.hooks"))
    assert bad == []


def test_hooks_do_not_import_guard():
    bad = sorted((f, m) for f, m in _imports("hooks") if m.startswith("qforensics.guard"))
    assert bad == []


def test_autoattach_composes_both():
    mods = {m for _, m in _imports(".")}
    text = (ROOT / "autoattach.py").read_text()
    assert "qforensics.guard" in text and "qforensics.hooks.capture" in text
    assert "qforensics.incidents" in mods


def test_incident_sinks_reach_every_registered_sink_and_unregister():
    from qforensics.incidents import register_sink, report_incident, sinks_for

    model, got = object(), []
    h = register_sink(model, lambda module, action, **kw: got.append((module, action, kw)))
    assert report_incident(model, "m.0", "fallback", nan_count=3, detail="d") == 1
    assert got == [("m.0", "fallback", {"nan_count": 3, "inf_count": 0, "detail": "d"})]
    h.remove()
    h.remove()  # idempotent
    assert sinks_for(model) == []
    assert report_incident(model, "m.0", "fallback") == 0


def test_a_failing_sink_never_raises(caplog):
    from qforensics.incidents import register_sink, report_incident

    model = object()

    def broken(*a, **k):
        raise OSError("disk full")

    h = register_sink(model, broken)
    try:
        assert report_incident(model, "m", "fallback") == 0
    finally:
        h.remove()
    assert "disk full" in caplog.text
