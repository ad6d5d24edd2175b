"""hooks/prebuild.py: the native kernels built at install time, where a run then finds them."""

from __future__ import annotations

from pathlib import Path

from qforensics.hooks import extension, fused, opcall, prebuild, statsnative


def test_prebuild_puts_the_kernels_where_runs_look_for_them(capsys):
    assert prebuild.main() == 0
    out = capsys.readouterr().out
    built = {line.split(": ", 1)[0]: Path(line.split(": ", 1)[1]) for line in out.splitlines()}
    assert built["fused_reduce.c"] == fused.library_path()
    assert "fast_take.c" not in built  # the older eager hooks' takes are gone
    assert built["opcall.c"] == fused.library_path(
        source=opcall.SOURCE, flags=extension.build_flags(), libs=())
    assert built["statsop_cpu.cpp"] == fused.library_path(
        statsnative.compiler(), source=statsnative.SOURCE, flags=statsnative.build_flags(),
        libs=statsnative.build_libs())
    for path in built.values():
        assert path.exists() and fused.trusted(path)
