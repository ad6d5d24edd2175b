"""The figures, drawn by matplotlib: each is a PNG (decoded by Pillow) of its stated size with
something drawn, on edge cases too; the pixels carry the data (colour map ends, the shaded
non-finite step, the labelled channel where it is); trace labels are drawn as text, never as
math; matplotlib is imported only when a figure is drawn."""

from __future__ import annotations

import base64
import io
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image
from synth import bad_module_index, write_synthetic_trace

from qforensics.analyze.grid import bin_heatmap
from qforensics.analyze.views import ChannelView, DivergenceSeries, LogitsSeries
from qforensics.reports import plots, render_report

WHITE = 250  # a pixel with every channel above this is background
VIRIDIS_LOW, VIRIDIS_HIGH = (0x44, 0x01, 0x54), (0xFD, 0xE7, 0x25)  # viridis' published ends
RED = (0xC6, 0x28, 0x28)
MATH = r"$\frac{a}{b}$"


def _pixels(fig: plots.Figure) -> np.ndarray:
    assert fig.data_uri.startswith("data:image/png;base64,")
    img = Image.open(io.BytesIO(base64.b64decode(fig.data_uri.split(",", 1)[1])))
    img.load()  # Pillow checks every chunk's CRC and the zlib stream while decoding
    assert img.size == (fig.width, fig.height)
    px = np.asarray(img.convert("RGB"))
    drawn = (px < WHITE).any(axis=2).mean()
    assert 0.01 < drawn < 0.99, f"{fig.id}: {drawn:.3f} of the pixels drawn"
    return px


def _logits(nonfinite, lo=-1.0, hi=2.0, first=None) -> LogitsSeries:
    n = len(nonfinite)
    return LogitsSeries(np.arange(n), np.full(n, lo), np.full(n, hi), np.full(n, (lo + hi) / 2),
                        np.asarray(nonfinite, bool), first)


def _channels(absmax, labelled=(), half=None) -> ChannelView:
    a = np.asarray(absmax, np.float64)
    return ChannelView("m", 0, 3, "producer", a, list(labelled), ("FP8 e4m3", 448.0), half,
                       int((a < (half or 0)).sum()))


def test_figures_are_pngs_of_their_size_on_edge_cases():
    nan = np.full(3, np.nan)
    figs = [
        plots.plot_logits(LogitsSeries(np.arange(3), nan, nan, nan, np.ones(3, bool), 0)),
        plots.plot_logits(_logits([False])),
        plots.plot_heatmap(bin_heatmap(np.full((4, 2), np.nan), np.zeros((4, 2), bool),
                                       list("abcd"), mark=(1, 1))),
        plots.plot_channels(_channels(np.zeros(5))),
        plots.plot_channels(_channels([0.5, 0.0, 900.0], [(2, 900.0)], 10.0)),
        plots.plot_divergence(DivergenceSeries(["a", "b"], np.array([np.inf, 0.2]),
                                               np.array([True, False]), 0, 0)),
    ]
    for fig, height_in in zip(figs, (3.0, 3.0, 3.5, 3.6, 3.6, 3.4)):
        assert (fig.width, fig.height) == (1000, round(height_in * 100))
        _pixels(fig)
    assert plots.plot_logits(None) is None and plots.plot_channels(None) is None
    assert plots.plot_logits(_logits([])) is None
    assert plots.plot_channels(_channels(np.zeros(0))) is None


def test_heatmap_cells_carry_the_colour_map():
    """A cell at the maximum is viridis' top colour, one at the minimum its bottom colour, a
    non-finite one red; the binned cell of a mark is the bin that holds it."""
    vals = np.array([[0.0, 3.0], [3.0, 0.0]])
    bad = np.array([[False, False], [False, True]])
    px = _pixels(plots.plot_heatmap(bin_heatmap(vals, bad, ["a", "b"]))).astype(int)
    for colour in (VIRIDIS_HIGH, VIRIDIS_LOW, RED):  # within rounding to 8 bits
        assert (np.abs(px - colour).max(axis=2) <= 1).sum() > 1000, colour
    hm = bin_heatmap(np.zeros((600, 500)), np.zeros((600, 500), bool), [str(i) for i in range(600)],
                     mark=(333, 499))
    assert hm.binned and hm.mark == (333 // 3, 499 // 3)


def _column(fig: plots.Figure, x: float, lo: float, hi: float) -> float:
    """Pixel column of data x on an axes spanning 0.07..0.98 of the width, x limits lo..hi."""
    return fig.width * (0.07 + 0.91 * (x - lo) / (hi - lo))


def test_logits_shade_exactly_the_non_finite_steps():
    fig = plots.plot_logits(_logits([False] * 4 + [True] + [False] * 5))
    px = _pixels(fig).astype(int)
    row = int(fig.height * (1 - 0.86)) + 4  # just inside the top of the axes, above the data
    def pink(step):
        c = px[row, int(_column(fig, step, -0.6, 9.6))]
        return c[0] - c[1] > 15 and c[0] > 200
    assert pink(4) and not pink(2) and not pink(8)


def test_labelled_channel_is_drawn_at_its_channel():
    """The label and dot of channel 90 of 100 change pixels around its x position only."""
    a = np.full(100, 0.5)
    a[90] = 900.0
    plain = _pixels(plots.plot_channels(_channels(a)))
    fig = plots.plot_channels(_channels(a, [(90, 900.0)]))
    diff = np.abs(_pixels(fig).astype(int) - plain.astype(int)).sum(axis=2) > 60
    cols = np.nonzero(diff.any(axis=0))[0]
    assert cols.size and abs(cols.mean() - _column(fig, 90, -0.5, 99.5)) < 40


def _drawn_figures(monkeypatch) -> list:
    seen = []
    real = plots._render

    def keep(fig, *a):
        seen.append(fig)
        return real(fig, *a)

    monkeypatch.setattr(plots, "_render", keep)
    return seen


def _math_labels(figs: list) -> int:
    """Check every drawn text holding MATH: as wide as the raw string laid out with math parsing
    off, and much wider than its math rendering. Returns how many there were."""
    from matplotlib.text import Text

    checked = 0
    for fig in figs:
        renderer = fig.canvas.get_renderer()
        for t in fig.findobj(Text):
            if "frac" not in t.get_text() or not t.get_visible():
                continue
            shown = t.get_text().replace(r"\$", "$")  # what matplotlib draws for an escaped $
            assert MATH in shown
            width = t.get_window_extent(renderer).width
            props = t.get_fontproperties()
            literal = fig.text(0, 0, shown, fontproperties=props, parse_math=False)
            math = fig.text(0, 0, MATH, fontproperties=props)
            assert width == pytest.approx(literal.get_window_extent(renderer).width, rel=0.02)
            assert width > 2 * math.get_window_extent(renderer).width
            checked += 1
    return checked


def test_trace_labels_are_text_never_math(monkeypatch):
    """A module named like TeX is drawn as its characters, in the heat map's tick labels and
    the divergence plot's first jump."""
    seen = _drawn_figures(monkeypatch)
    plots.plot_heatmap(bin_heatmap(np.ones((2, 2)), np.zeros((2, 2), bool), [MATH, "<script>"]))
    plots.plot_divergence(DivergenceSeries([MATH, "b"], np.array([0.1, 0.3]),
                                           np.zeros(2, bool), 0, None))
    assert _math_labels(seen) == 2


def test_tex_and_script_in_a_module_name(monkeypatch, tmp_path):
    """The producer named `$\\frac{a}{b}$<script>...`: its heat-map label is text, the page shows
    the name escaped (the channel figure's title) and runs nothing of it."""
    name = MATH + "<script>window.__pwned=7</script>"
    path = write_synthetic_trace(tmp_path / "tex.h5", names={bad_module_index(): name})
    seen = _drawn_figures(monkeypatch)
    html, f = render_report(path)
    assert f.first_nonfinite is not None and f.first_nonfinite.module == name
    assert _math_labels(seen) >= 1
    assert "<script>window.__pwned=7" not in html
    assert MATH + "&lt;script&gt;window.__pwned=7&lt;/script&gt;" in html


def test_matplotlib_is_imported_only_to_draw(tmp_path, failing_trace):
    code = ("import sys; import qforensics, qforensics.reports; "
            "print('matplotlib' in sys.modules); "
            "from qforensics.reports import write_report; "
            f"write_report({str(failing_trace)!r}, {str(tmp_path / 'r.html')!r}); "
            "import matplotlib; print('matplotlib.pyplot' in sys.modules, "
            "matplotlib.rcParams['text.usetex'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False", "False"]
