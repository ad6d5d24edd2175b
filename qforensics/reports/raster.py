"""A small raster plotting surface for the report's figures, drawn with Pillow.

Why not matplotlib: importing it (about 0.4 s of CPU) and drawing the report's figures with it
(0.4-0.5 s) was more than half of a `qforensics report` run. The figures need few things: lines, markers, bands,
bars, spans, a heatmap with a colour bar, linear and log axes with ticks, and legends. They are
drawn here in milliseconds, in matplotlib's default look (DejaVu Sans, 0.8 pt spines, 3.5 pt
ticks, viridis). Everything is drawn at twice the size and reduced, which anti-aliases lines
and text. Text is only ever drawn as pixels: nothing is parsed (no markup, no math). No torch
import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from qforensics.reports.png import encode_png

__all__ = ["Canvas", "Scale", "log_ticks", "nice_ticks", "rgb", "tick_label", "viridis"]

DPI = 100
SS = 2  # drawn at SS x the size, then reduced
PT = DPI / 72 * SS  # canvas pixels per point
WHITE = (255, 255, 255)
BLACK = (0, 0, 0)
MINUS = "\u2212"
_SUP = str.maketrans("-0123456789", "\u207b\u2070\u00b9\u00b2\u00b3\u2074\u2075\u2076\u2077"
                     "\u2078\u2079")
# matplotlib's viridis sampled at 33 evenly spaced points (linear interpolation between them
# stays within 2.5/255 of the 256-entry map)
_VIRIDIS = np.frombuffer(bytes.fromhex(
    "440154470d6048186a482374472d7b4537814240863e49893b528b375b8d33638d2f6b8e2c728e297a8e26828e"
    "23898e21918c1f988b1fa08822a78528ae8032b67a3fbc734ec36b5ec96270cf5784d44b98d83eaddc30c2df23"
    "d8e219ece51bfde725"), np.uint8).reshape(33, 3).astype(np.float64)


def rgb(color: str) -> tuple[int, int, int]:
    c = color.lstrip("#")
    return int(c[0:2], 16), int(c[2:4], 16), int(c[4:6], 16)


def viridis(t: np.ndarray) -> np.ndarray:
    """Colours (..., 3) uint8 of values in [0, 1] (clipped)."""
    x = np.clip(np.asarray(t, np.float64), 0, 1) * (len(_VIRIDIS) - 1)
    i = np.minimum(x.astype(np.int64), len(_VIRIDIS) - 2)
    f = (x - i)[..., None]
    return np.round(_VIRIDIS[i] * (1 - f) + _VIRIDIS[i + 1] * f).astype(np.uint8)


@lru_cache(maxsize=32)
def _font(px: int, bold: bool) -> Any:
    for name in (("DejaVuSans-Bold.ttf",) if bold else ()) + ("DejaVuSans.ttf",):
        try:
            return ImageFont.truetype(name, px)
        except OSError:
            pass
    return ImageFont.load_default(px)  # Pillow's own scalable font when DejaVu is not installed


def _fmt(v: float, decimals: int) -> str:
    s = f"{v:.{decimals}f}" if abs(v) < 1e6 else f"{v:.3g}"
    return s.replace("-", MINUS) if v < 0 else s.lstrip("-")  # no "-0"


def nice_ticks(lo: float, hi: float, nbins: int, integer: bool = False) -> np.ndarray:
    """Ticks at multiples of 1, 2, 2.5 or 5 x 10^k, at most `nbins` intervals, inside [lo, hi]
    (as matplotlib's MaxNLocator)."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return np.zeros(0)
    raw = (hi - lo) / max(nbins, 1)
    mag = 10.0 ** math.floor(math.log10(raw))
    step = 1.0 if integer else 10 * mag  # integer ticks are at least 1 apart
    for m in (1, 2, 2.5, 5, 10):
        s = m * mag
        if integer and (s < 1 or s != int(s)):
            continue
        if s >= raw * (1 - 1e-9):
            step = s
            break
    first = math.ceil(lo / step - 1e-9)
    ticks = (np.arange(first, math.floor(hi / step + 1e-9) + 1) * step)
    return ticks[(ticks >= lo - 1e-9 * step) & (ticks <= hi + 1e-9 * step)]


def tick_label(v: float, ticks: np.ndarray) -> str:
    """A linear tick's label with the fewest decimals that write every tick of the axis
    exactly (0, 0.25, 0.5 -> 0.00, 0.25, 0.50, as matplotlib)."""
    decimals = 6
    for d in range(7):
        scaled = np.asarray(ticks, np.float64) * 10.0 ** d
        if np.all(np.abs(scaled - np.round(scaled)) < 1e-6 * np.maximum(1, np.abs(scaled))):
            decimals = d
            break
    return _fmt(v, decimals)


def log_ticks(lo: float, hi: float, max_labels: int = 10) -> tuple[list[tuple[float, str]],
                                                                     list[float]]:
    """(major ticks with labels like 10\u00b3, minor ticks 2..9 x 10^k) inside [lo, hi] > 0."""
    if not (lo > 0 and hi > lo and math.isfinite(hi)):
        return [], []
    e0, e1 = math.ceil(math.log10(lo) - 1e-9), math.floor(math.log10(hi) + 1e-9)
    stride = max(1, math.ceil((e1 - e0 + 1) / max_labels))
    major = [(10.0 ** e, "10" + str(e).translate(_SUP)) for e in range(e0, e1 + 1)
             if (e - e0) % stride == 0]
    minor = [m * 10.0 ** e for e in range(e0 - 1, e1 + 1) for m in range(2, 10)
             if lo <= m * 10.0 ** e <= hi] if stride == 1 else []
    if len(major) < 2:  # less than a decade shown: label 2..9 x 10^k as well
        major += [(m, f"{m / 10.0 ** math.floor(math.log10(m)):g}\u00d710"
                   + str(math.floor(math.log10(m))).translate(_SUP)) for m in minor]
        major.sort()
        minor = []
    return major, minor


class Canvas:
    """A white figure `width_in` x `height_in` inches at 100 dpi; coordinates in canvas pixels
    (SS per figure pixel), origin top left."""

    def __init__(self, width_in: float, height_in: float) -> None:
        self.width, self.height = round(width_in * DPI), round(height_in * DPI)
        self.img = Image.new("RGB", (self.width * SS, self.height * SS), WHITE)
        self.draw = ImageDraw.Draw(self.img, "RGBA")

    def text_box(self, s: str, size: float, bold: bool = False) -> tuple[int, int]:
        """(width, height) of `s` in canvas pixels (height: ascent + descent of the font)."""
        font = _font(max(1, round(size * PT)), bold)
        w = self.draw.textlength(s, font=font)
        a, d = font.getmetrics() if hasattr(font, "getmetrics") else (size * PT, 0)
        return round(w), a + d

    def text(self, x: float, y: float, s: str, *, size: float = 10, color: Any = BLACK,
             ha: str = "left", va: str = "baseline", bold: bool = False,
             rotation: int = 0) -> None:
        """Text at (x, y) aligned by ha (left|center|right) and va (top|center|bottom|
        baseline); rotation 90 reads bottom to top, aligned by its rotated box."""
        font = _font(max(1, round(size * PT)), bold)
        if not s:
            return
        if rotation == 0:
            anchor = {"left": "l", "center": "m", "right": "r"}[ha] + \
                {"top": "a", "center": "m", "bottom": "d", "baseline": "s"}[va]
            self.draw.text((x, y), s, font=font, fill=color, anchor=anchor)
            return
        w, h = self.text_box(s, size, bold)
        tmp = Image.new("L", (w + 4, h + 4), 0)
        ImageDraw.Draw(tmp).text((2, 2), s, font=font, fill=255, anchor="la")
        rot = tmp.rotate(90, expand=True)
        rw, rh = rot.size
        x0 = x - {"left": 0, "center": rw / 2, "right": rw}[ha]
        y0 = y - {"top": 0, "center": rh / 2, "bottom": rh, "baseline": rh}[va]
        self.img.paste(Image.new("RGB", rot.size, color), (round(x0), round(y0)), rot)

    def png(self) -> bytes:
        return encode_png(np.asarray(self.img.reduce(SS)), dpi=DPI)


@dataclass
class Scale:
    lo: float = 0.0
    hi: float = 1.0
    log: bool = False

    def unit(self, v: Any) -> np.ndarray:
        """Data -> [0, 1] along the axis (outside for data beyond the limits)."""
        v = np.asarray(v, np.float64)
        if self.log:
            with np.errstate(divide="ignore", invalid="ignore"):
                lv = np.log10(np.where(v > 0, v, np.nan))
            return (lv - math.log10(self.lo)) / (math.log10(self.hi) - math.log10(self.lo))
        return (v - self.lo) / (self.hi - self.lo)
