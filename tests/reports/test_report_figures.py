"""The figures' last steps: the PNG writer (decoded by Pillow, an independent decoder, to the
same pixels) and log-axis tick labels drawn as plain text (no mathtext)."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from PIL import Image

from qforensics.reports import plots
from qforensics.reports.png import encode_png


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


def test_report_figure_is_the_canvas_pixels():
    fig = plots.plot_channels(np.array([0.5, 2.0, 900.0, 1.0]), "t", [(2, 900.0)],
                              ("fp8-e4m3", 448.0), 10.0)
    assert fig is not None and fig.data_uri.startswith("data:image/png;base64,")
    img = Image.open(io.BytesIO(base64.b64decode(fig.data_uri.split(",", 1)[1])))
    assert img.size == (fig.width, fig.height) and img.mode == "RGB"


def test_log_axis_labels_are_plain_text_powers_of_ten():
    fig = Figure(figsize=(4, 3), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot([0, 1], [0.05, 5000])
    plots._log_y(ax)
    ax.set_ylim(0.05, 5000)
    fig.canvas.draw()
    shown = zip(ax.yaxis.get_majorticklocs(), ax.get_yticklabels())
    labels = [t.get_text() for loc, t in shown if 0.05 <= loc <= 5000]
    assert labels == ["10\u207b\u00b9", "10\u2070", "10\u00b9", "10\u00b2", "10\u00b3"]
    assert not any("$" in s for s in labels)  # nothing for mathtext to parse
