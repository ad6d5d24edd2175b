"""The commands' text layout (qforensics/cli/text.py), shared by analyze, diff and triage."""

from __future__ import annotations

from qforensics.cli.text import WIDTH, figure, wrap


def test_figures_read_short():
    assert figure(None) == "-"
    assert figure(float("nan")) == "nan"
    assert figure(0.0) == "0"
    assert figure(3.14159) == "3.142"  # below 100: 4 significant digits
    assert figure(-42.0) == "-42"
    assert figure(1234.56) == "1,234.6"  # from 100: one decimal, thousands separated
    assert figure(2_500_000.0) == "2.5e+06"  # from a million: 3 significant digits
    assert figure(0.000123456) == "0.000123"  # below 1e-3 likewise
    assert figure(float("inf")) == "inf"


def test_wrap_keeps_names_whole_and_indents():
    name = "model.layers.17.self_attn.q-proj-with-a-long-hyphenated-name"
    text = ("producer: " + name + " - its input is finite, its output is not; ") * 4
    out = wrap(text)
    lines = out.split("\n")
    assert len(lines) > 1 and all(len(ln) <= WIDTH for ln in lines)
    assert lines[0].startswith("  producer:") and all(ln.startswith("      ") for ln in lines[1:])
    assert out.count(name) == 4  # never broken at a hyphen
    assert " ".join(out.split()) == " ".join(text.split())
    assert wrap("x " * 80, "", "    ").split("\n")[1].startswith("    x")
