"""Axes on a `raster.Canvas`: data drawn in data coordinates and clipped to the axes box, then
spines, ticks, tick labels, axis labels, free text and a legend around it (matplotlib's default
geometry: 0.8 pt spines, 3.5 pt ticks and pads, 4 pt label pad). Artists are kept and drawn by
`finish()`, so limits may be set after the data, as in matplotlib. No torch import.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
from PIL import Image, ImageDraw

from qforensics.reports.raster import PT, SS, WHITE, Canvas, Scale

__all__ = ["Axes"]

BLACK = (0, 0, 0)
GRID = (229, 229, 229)
_TICK, _MINOR, _PAD, _LABELPAD = 3.5, 2.0, 3.5, 4.0  # points


def _rgba(color: tuple[int, int, int], alpha: float) -> tuple[int, int, int, int]:
    return (*color, max(0, min(255, round(alpha * 255))))


def _runs(ok: np.ndarray) -> list[tuple[int, int]]:
    d = np.diff(np.concatenate([[0], ok.astype(np.int8), [0]]))
    return list(zip(np.nonzero(d == 1)[0].tolist(), np.nonzero(d == -1)[0].tolist()))


class Axes:
    """An axes box at figure fractions (left, bottom, right, top)."""

    def __init__(self, canvas: Canvas, left: float, bottom: float, right: float,
                 top: float) -> None:
        self.c = canvas
        W, H = canvas.img.size
        self.x0, self.x1 = round(left * W), round(right * W)
        self.y0, self.y1 = round((1 - top) * H), round((1 - bottom) * H)
        self.w, self.h = self.x1 - self.x0, self.y1 - self.y0
        self.xs, self.ys = Scale(), Scale()
        self.spines = ["left", "bottom", "right", "top"]
        self.xticks: list[tuple[float, str]] = []
        self.yticks: list[tuple[float, str]] = []
        self.xminor: list[float] = []
        self.yminor: list[float] = []
        self.xtick_size = self.ytick_size = 10.0
        self.yticks_right = False
        self.grid_y = False
        self.xlabel = self.ylabel = ""
        self._artists: list[Callable[[ImageDraw.ImageDraw], None]] = []
        self._after: list[Callable[[], None]] = []
        self._layer = Image.new("RGB", (1, 1), WHITE)  # the clipped drawing, made by finish()

    # -- coordinates ------------------------------------------------------------------------
    def lx(self, x: Any) -> np.ndarray:
        """Data x -> pixels from the box's left edge."""
        return self.xs.unit(x) * self.w

    def ly(self, y: Any) -> np.ndarray:
        """Data y -> pixels from the box's top edge."""
        return (1 - self.ys.unit(y)) * self.h

    def _point(self, x: float, y: float, coords: tuple[str, str]) -> tuple[float, float]:
        """(x, y) in canvas pixels; each coordinate 'data' or 'axes' (fraction of the box)."""
        px = self.x0 + (x * self.w if coords[0] == "axes" else float(self.lx(x)))
        py = self.y0 + ((1 - y) * self.h if coords[1] == "axes" else float(self.ly(y)))
        return px, py

    # -- data (clipped to the box) ----------------------------------------------------------
    def line(self, x: Any, y: Any, color: tuple[int, int, int], lw: float,
             marker_size: float = 0.0, alpha: float = 1.0) -> None:
        """A polyline broken at non-finite points; round markers of `marker_size` points."""
        def draw(d: ImageDraw.ImageDraw) -> None:
            px, py = self.lx(x), self.ly(y)
            ok = np.isfinite(px) & np.isfinite(py)
            fill = _rgba(color, alpha)
            for a, b in _runs(ok):
                if b - a > 1:
                    d.line(list(zip(px[a:b].tolist(), py[a:b].tolist())), fill=fill,
                           width=max(1, round(lw * PT)), joint="curve")
            r = marker_size * PT / 2
            if r > 0:
                for u, v in zip(px[ok].tolist(), py[ok].tolist()):
                    d.ellipse((u - r, v - r, u + r, v + r), fill=fill)
        self._artists.append(draw)

    def fill_between(self, x: Any, y0: Any, y1: Any, color: tuple[int, int, int],
                     alpha: float) -> None:
        def draw(d: ImageDraw.ImageDraw) -> None:
            px, p0, p1 = self.lx(x), self.ly(y0), self.ly(y1)
            ok = np.isfinite(px) & np.isfinite(p0) & np.isfinite(p1)
            for a, b in _runs(ok):
                if b - a > 1:
                    top = list(zip(px[a:b].tolist(), p1[a:b].tolist()))
                    bottom = list(zip(px[a:b][::-1].tolist(), p0[a:b][::-1].tolist()))
                    d.polygon(top + bottom, fill=_rgba(color, alpha))
        self._artists.append(draw)

    def axvspan(self, x0: float, x1: float, color: tuple[int, int, int], alpha: float) -> None:
        self._artists.append(lambda d: d.rectangle(
            (float(self.lx(x0)), 0, float(self.lx(x1)), self.h), fill=_rgba(color, alpha)))

    def _dashed(self, d: ImageDraw.ImageDraw, a: tuple[float, float], b: tuple[float, float],
                color: tuple[int, int, int], lw: float, dash: tuple[float, float] | None) -> None:
        width = max(1, round(lw * PT))
        if dash is None:
            d.line([a, b], fill=color, width=width)
            return
        length = math.hypot(b[0] - a[0], b[1] - a[1])
        on, off = dash[0] * lw * PT, dash[1] * lw * PT
        ux, uy = (b[0] - a[0]) / max(length, 1e-9), (b[1] - a[1]) / max(length, 1e-9)
        t = 0.0
        while t < length:
            e = min(t + on, length)
            d.line([(a[0] + ux * t, a[1] + uy * t), (a[0] + ux * e, a[1] + uy * e)], fill=color,
                   width=width)
            t = e + off

    def axhline(self, y: float, color: tuple[int, int, int], lw: float,
                dash: tuple[float, float] | None = None) -> None:
        self._artists.append(lambda d: self._dashed(
            d, (0, float(self.ly(y))), (self.w, float(self.ly(y))), color, lw, dash))

    def axvline(self, x: float, color: tuple[int, int, int], lw: float,
                dash: tuple[float, float] | None = None) -> None:
        self._artists.append(lambda d: self._dashed(
            d, (float(self.lx(x)), 0), (float(self.lx(x)), self.h), color, lw, dash))

    def vlines(self, x: Any, lo: Any, hi: Any, color: tuple[int, int, int], lw: float,
               alpha: float = 1.0) -> None:
        """Vertical segments from lo to hi at each x (one rectangle each)."""
        def draw(d: ImageDraw.ImageDraw) -> None:
            px = self.lx(x)
            p0, p1 = np.broadcast_to(self.ly(lo), px.shape), np.broadcast_to(self.ly(hi), px.shape)
            half = max(lw * PT, 1.0) / 2
            fill = _rgba(color, alpha)
            for u, a, b in zip(px.tolist(), p0.tolist(), p1.tolist()):
                if math.isfinite(u) and math.isfinite(a) and math.isfinite(b):
                    d.rectangle((u - half, min(a, b), u + half, max(a, b)), fill=fill)
        self._artists.append(draw)

    def bars(self, x: Any, lo: float, hi: Any, width: float,
             colors: list[tuple[int, int, int]]) -> None:
        def draw(d: ImageDraw.ImageDraw) -> None:
            left, right = self.lx(np.asarray(x) - width / 2), self.lx(np.asarray(x) + width / 2)
            # edges snapped to whole output pixels (as matplotlib snaps bars): gaps stay crisp
            snap = lambda v: np.round((v + self.x0) / SS) * SS - self.x0  # noqa: E731
            left, right = snap(left), snap(right) - 1
            base, top = float(self.ly(lo)), self.ly(hi)
            for a, b, t, col in zip(left.tolist(), right.tolist(), top.tolist(), colors):
                if math.isfinite(t):
                    d.rectangle((a, min(t, base), max(a, b), max(t, base)), fill=col)
        self._artists.append(draw)

    def image(self, pixels: np.ndarray) -> None:
        """(rows, cols, 3) uint8 cells filling the box, row 0 at the top (nearest-neighbour)."""
        img = Image.fromarray(np.ascontiguousarray(pixels, np.uint8), "RGB")
        self._artists.append(lambda d: self._layer.paste(
            img.resize((self.w, self.h), Image.NEAREST), (0, 0)))

    def circle(self, x: float, y: float, size: float, edge: tuple[int, int, int],
               edge_width: float) -> None:
        """An unfilled circle marker of `size` points (matplotlib's marker size)."""
        def draw(d: ImageDraw.ImageDraw) -> None:
            u, v, r = float(self.lx(x)), float(self.ly(y)), size * PT / 2
            d.ellipse((u - r, v - r, u + r, v + r), outline=edge,
                      width=max(1, round(edge_width * PT)))
        self._artists.append(draw)

    # -- around the box (not clipped) -------------------------------------------------------
    def text(self, x: float, y: float, s: str, coords: tuple[str, str] = ("data", "data"),
             **kw: Any) -> None:
        self._after.append(lambda: self.c.text(*self._point(x, y, coords), s, **kw))

    def dot(self, x: float, y: float, color: tuple[int, int, int], size: float) -> None:
        def draw() -> None:
            u, v = self._point(x, y, ("data", "data"))
            r = size * PT / 2
            self.c.draw.ellipse((u - r, v - r, u + r, v + r), fill=color)
        self._after.append(draw)

    def legend(self, entries: list[tuple[str, dict[str, Any]]], *, loc: str = "upper right",
               anchor: tuple[float, float] = (1.0, 1.0), size: float = 8) -> None:
        """One row of entries (label, {kind: line|patch, color, lw, marker, alpha}), its
        upper-right (or lower-right) corner at `anchor` (axes fractions), as matplotlib lays
        out a frameless legend."""
        self._after.append(lambda: self._draw_legend(entries, loc, anchor, size))

    def _draw_legend(self, entries: list[tuple[str, dict[str, Any]]], loc: str,
                     anchor: tuple[float, float], size: float) -> None:
        f = size * PT
        widths = [self.c.text_box(label, size)[0] for label, _ in entries]
        th = self.c.text_box("Ag", size)[1]
        total = sum(2.8 * f + w for w in widths) + 2.0 * f * (len(entries) - 1) + 0.8 * f
        ax, ay = self._point(anchor[0], anchor[1], ("axes", "axes"))
        right = ax - 0.5 * f
        top = ay + 0.5 * f if loc.startswith("upper") else ay - 0.5 * f - (th + 0.8 * f)
        x, yc = right - total + 0.4 * f, top + 0.4 * f + th / 2
        d = self.c.draw
        for (label, h), w in zip(entries, widths):
            color = h["color"]
            if h.get("kind") == "patch":
                d.rectangle((x, yc - 0.35 * f, x + 2 * f, yc + 0.35 * f),
                            fill=_rgba(color, h.get("alpha", 1.0)))
            else:
                d.line([(x, yc), (x + 2 * f, yc)], fill=color, width=max(1, round(h["lw"] * PT)))
                r = h.get("marker", 0.0) * PT / 2
                if r:
                    d.ellipse((x + f - r, yc - r, x + f + r, yc + r), fill=color)
            self.c.text(x + 2.8 * f, yc, label, size=size, va="center")
            x += 2.8 * f + w + 2.0 * f

    # -- drawing ----------------------------------------------------------------------------
    def finish(self) -> None:
        layer = self._layer = Image.new("RGB", (self.w, self.h), WHITE)
        d = ImageDraw.Draw(layer, "RGBA")
        if self.grid_y:
            for pos, _ in self.yticks:
                v = float(self.ly(pos))
                if 0 <= v <= self.h:
                    d.line([(0, v), (self.w, v)], fill=GRID, width=max(1, round(0.8 * PT)))
        for draw in self._artists:
            draw(d)
        self.c.img.paste(layer, (self.x0, self.y0))
        self._frame()
        for after in self._after:
            after()

    def _frame(self) -> None:
        c, d = self.c, self.c.draw
        sw = max(1, round(0.8 * PT))
        edges = {"left": [(self.x0, self.y0), (self.x0, self.y1)],
                 "right": [(self.x1, self.y0), (self.x1, self.y1)],
                 "top": [(self.x0, self.y0), (self.x1, self.y0)],
                 "bottom": [(self.x0, self.y1), (self.x1, self.y1)]}
        for s in self.spines:
            d.line(edges[s], fill=BLACK, width=sw)
        tick, pad = _TICK * PT, _PAD * PT
        tall = 0
        for pos in self.xminor:
            u = self.x0 + float(self.lx(pos))
            if self.x0 - 1 <= u <= self.x1 + 1:
                d.line([(u, self.y1), (u, self.y1 + _MINOR * PT)], fill=BLACK,
                       width=max(1, round(0.6 * PT)))
        for pos, label in self.xticks:
            u = self.x0 + float(self.lx(pos))
            if self.x0 - 1 <= u <= self.x1 + 1:
                d.line([(u, self.y1), (u, self.y1 + tick)], fill=BLACK, width=sw)
                c.text(u, self.y1 + tick + pad, label, size=self.xtick_size, ha="center",
                       va="top")
                tall = max(tall, c.text_box(label, self.xtick_size)[1])
        if self.xlabel:
            c.text((self.x0 + self.x1) / 2, self.y1 + tick + pad + tall + _LABELPAD * PT,
                   self.xlabel, size=10, ha="center", va="top")
        side = 1 if self.yticks_right else -1
        x = self.x1 if self.yticks_right else self.x0
        wide = 0
        for pos in self.yminor:
            v = self.y0 + float(self.ly(pos))
            if self.y0 - 1 <= v <= self.y1 + 1:
                d.line([(x, v), (x + side * _MINOR * PT, v)], fill=BLACK,
                       width=max(1, round(0.6 * PT)))
        for pos, label in self.yticks:
            v = self.y0 + float(self.ly(pos))
            if self.y0 - 1 <= v <= self.y1 + 1:
                d.line([(x, v), (x + side * tick, v)], fill=BLACK, width=sw)
                c.text(x + side * (tick + pad), v, label, size=self.ytick_size,
                       ha="left" if self.yticks_right else "right", va="center")
                wide = max(wide, c.text_box(label, self.ytick_size)[0])
        if self.ylabel:
            c.text(x + side * (tick + pad + wide + _LABELPAD * PT), (self.y0 + self.y1) / 2,
                   self.ylabel, size=10, ha="left" if self.yticks_right else "right",
                   va="center", rotation=90)
