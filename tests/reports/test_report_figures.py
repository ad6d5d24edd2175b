"""The figures: the PNG writer (decoded by Pillow, an independent decoder, to the same pixels),
the drawing surface's ticks and colours, and every figure on edge-case data (no finite value,
one step, one channel) coming out as a PNG of its stated size."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from qforensics.analyze.grid import bin_heatmap
from qforensics.reports import plots
from qforensics.reports.png import encode_png
from qforensics.reports.raster import log_ticks, nice_ticks, tick_label, viridis


@pytest.mark.parametrize("channels, mode", [(3, "RGB"), (4, "RGBA")])
def test_png_decodes_to_the_same_pixels(channels, mode):
    rng = np.random.default_rng(3)
    px = rng.integers(0, 256, size=(37, 53, channels), dtype=np.uint8)
    px[5:9, :] = 255  # flat runs too, as in a plot
    data = encode_png(px, dpi=100)
    img = Image.open(io.BytesIO(data))
    img.load()  # Pillow checks every chunk's CRC and the zlib stream while decoding
    assert img.mode == mode and img.size == (53, 37)
    assert np.array_equal(np.asarray(img), px)
    assert img.info["dpi"] == pytest.approx((100, 100), abs=0.01)


def test_png_refuses_what_it_cannot_encode():
    for bad in (np.zeros((4, 4, 3), np.float32), np.zeros((4, 4), np.uint8),
                np.zeros((4, 4, 2), np.uint8), np.zeros((0, 4, 3), np.uint8)):
        with pytest.raises(ValueError):
            encode_png(bad)


def test_linear_ticks_are_round_numbers_inside_the_limits():
    t = nice_ticks(-29.0, 25.0, 6)
    assert t.tolist() == [-20, -10, 0, 10, 20]
    assert [tick_label(v, t) for v in t] == ["\u221220", "\u221210", "0", "10", "20"]
    assert nice_ticks(-0.5, 1535.5, 9, integer=True).tolist() == [0, 200, 400, 600, 800, 1000,
                                                                  1200, 1400]
    assert nice_ticks(-0.6, 0.6, 16, integer=True).tolist() == [0]  # one step: one tick
    t = nice_ticks(0.0, 1.0, 4)
    assert [tick_label(v, t) for v in t] == ["0.00", "0.25", "0.50", "0.75", "1.00"]
    assert nice_ticks(1.0, 1.0, 5).size == 0 and nice_ticks(0, float("nan"), 5).size == 0


def test_log_ticks_label_decades_as_powers_of_ten():
    major, minor = log_ticks(0.05, 5000)
    assert [s for _, s in major] == ["10\u207b\u00b9", "10\u2070", "10\u00b9", "10\u00b2",
                                     "10\u00b3"]
    assert [v for v, _ in major] == pytest.approx([0.1, 1, 10, 100, 1000])
    assert 0.05 in minor and 5000 in minor and 2 in minor and 10 not in minor
    major, _ = log_ticks(3, 30)  # less than two decades inside: 2..9 x 10^k labelled too
    assert (10.0, "10\u00b9") in major and (20.0, "2\u00d710\u00b9") in major
    assert log_ticks(0, 10) == ([], [])


def test_viridis_ends_and_middle():
    c = viridis(np.array([0.0, 0.5, 1.0, -3.0, 7.0]))
    assert c[0].tolist() == [0x44, 0x01, 0x54] and c[2].tolist() == [0xFD, 0xE7, 0x25]
    assert c[3].tolist() == c[0].tolist() and c[4].tolist() == c[2].tolist()  # clipped
    assert c[1].tolist() == [0x21, 0x91, 0x8C]  # viridis(0.5), #21918c


def _png(fig: plots.Figure) -> Image.Image:
    assert fig.data_uri.startswith("data:image/png;base64,")
    img = Image.open(io.BytesIO(base64.b64decode(fig.data_uri.split(",", 1)[1])))
    img.load()
    assert img.size == (fig.width, fig.height) and img.mode == "RGB"
    return img


def test_figures_on_edge_cases():
    nan = np.full(3, np.nan)
    _png(plots.plot_logits(np.arange(3), nan, nan, nan, np.ones(3, bool), 0))
    _png(plots.plot_logits(np.array([0]), np.array([-1.0]), np.array([2.0]), np.array([0.5]),
                           np.zeros(1, bool), None))
    hm = bin_heatmap(np.full((4, 2), np.nan), np.zeros((4, 2), bool), ["a", "b", "c", "d"])
    _png(plots.plot_heatmap(hm, mark=(1, 1)))
    _png(plots.plot_channels(np.zeros(5), "t", [], None, None))
    _png(plots.plot_channels(np.array([0.5, np.inf, 900.0]), "t", [(2, 900.0)],
                             ("fp8-e4m3", 448.0), 10.0))
    _png(plots.plot_divergence(["a", "b"], np.array([np.nan, 0.2]), np.array([True, False]),
                               0, 0))
    assert plots.plot_logits(np.zeros(0), *(np.zeros(0),) * 3, np.zeros(0, bool), None) is None
    assert plots.plot_channels(np.zeros(0), "t", [], None, None) is None


def test_figures_draw_their_data():
    """The heatmap's cells carry the colour map: a cell at the maximum is viridis(1) yellow,
    one at the minimum viridis(0) purple, a non-finite one red."""
    vals = np.array([[0.0, 3.0], [3.0, 0.0]])
    bad = np.array([[False, False], [False, True]])
    img = np.asarray(_png(plots.plot_heatmap(bin_heatmap(vals, bad, ["a", "b"]))))
    colours = {tuple(int(v) for v in p) for p in img.reshape(-1, 3)}
    assert (0xFD, 0xE7, 0x25) in colours and (0x44, 0x01, 0x54) in colours
    assert plots.RED in colours


def test_figures_without_dejavu_fall_back_to_pillows_font(monkeypatch):
    """A machine without DejaVu Sans: the labels come from Pillow's built-in font, and the figure
    still renders with text drawn (pixels that are neither white nor the single line colour)."""
    from PIL import ImageFont

    from qforensics.reports import raster

    real = ImageFont.truetype

    def missing(font=None, *a, **k):
        if isinstance(font, str):  # a font file looked up by name: not installed
            raise OSError("cannot open resource")
        return real(font, *a, **k)  # Pillow's built-in font, loaded from bytes

    monkeypatch.setattr(ImageFont, "truetype", missing)
    raster._font.cache_clear()
    try:
        img = _png(plots.plot_channels(np.array([0.5, 3.0, 900.0]), "fallback", [(2, 900.0)],
                                       ("fp8-e4m3", 448.0), 10.0))
        px = np.asarray(img)
        assert (px.min(axis=2) < 128).sum() > 50  # dark pixels: tick labels and the title
    finally:
        raster._font.cache_clear()
