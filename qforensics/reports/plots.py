"""The report's figures, drawn on `reports.raster` (Pillow) and encoded as base64 PNG data URIs.

PNG, not SVG: trace strings (module names in tick labels and titles) end up as pixels, never as
markup, and nothing parses them (no math text); control characters are replaced and lengths
bounded. Each function takes plain numpy data (prepared by `qforensics.reports.report`) and
returns a `Figure` record, or None when there is nothing to draw. No torch import.
"""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass

import numpy as np

from qforensics.analyze.grid import Heatmap
from qforensics.reports.axes import Axes
from qforensics.reports.raster import PT, Canvas, log_ticks, nice_ticks, rgb, tick_label, viridis

__all__ = [
    "Figure",
    "plot_channels",
    "plot_divergence",
    "plot_heatmap",
    "plot_logits",
]

WIDTH_IN = 10.0

RED = rgb("#c62828")
ORANGE = rgb("#ef6c00")
BLUE = rgb("#1f5fa8")
LIGHT_BLUE = rgb("#6a9bd1")
DARK = rgb("#444444")
NOT_RECORDED = rgb("#f0f0f0")
DASHED, DOTTED = (3.7, 1.6), (1.0, 1.65)  # matplotlib's "--" and ":" (multiples of the width)


@dataclass(frozen=True)
class Figure:
    """One rendered figure: a PNG data URI, its alt text and a caption (plain text)."""

    id: str
    title: str
    data_uri: str
    alt: str
    caption: str
    width: int
    height: int


def _label(s: object, n: int = 60) -> str:
    """Trace text made safe to draw: no control characters, bounded length."""
    t = "".join(ch if ch.isprintable() else "?" for ch in str(s))
    return t if len(t) <= n else t[: n - 3] + "..."


def _new(height: float, left: float = 0.07, right: float = 0.98, bottom: float = 0.16,
         top: float = 0.88) -> tuple[Canvas, Axes]:
    c = Canvas(WIDTH_IN, height)
    return c, Axes(c, left, bottom, right, top)


def _render(c: Canvas, axes: list[Axes], fid: str, title: str, alt: str,
            caption: str) -> Figure:
    for ax in axes:
        ax.finish()
    uri = "data:image/png;base64," + base64.b64encode(c.png()).decode("ascii")
    return Figure(fid, title, uri, alt, caption, c.width, c.height)


def _style(ax: Axes) -> None:
    ax.spines = ["left", "bottom"]
    ax.grid_y = True


def _linear_y(ax: Axes, lo: float, hi: float) -> None:
    ax.ys.lo, ax.ys.hi, ax.ys.log = lo, hi, False
    nbins = max(1, min(9, int(ax.h / PT / (2 * ax.ytick_size))))  # as matplotlib's AutoLocator
    t = nice_ticks(lo, hi, nbins)
    ax.yticks = [(float(v), tick_label(v, t)) for v in t]


def _log_y(ax: Axes, lo: float, hi: float) -> None:
    ax.ys.lo, ax.ys.hi, ax.ys.log = lo, hi, True
    ax.yticks, ax.yminor = log_ticks(lo, hi)



def _fmt(v: float) -> str:
    if not math.isfinite(v):
        return str(v)
    a = abs(v)
    if a >= 100:
        return f"{v:,.0f}"
    if a >= 1:
        return f"{v:.2f}"
    return f"{v:.3g}"


def _autoscale(*arrays: np.ndarray) -> tuple[float, float] | None:
    """matplotlib's data limits with 5% margins, over the finite values."""
    vals = np.concatenate([np.asarray(a, np.float64).ravel() for a in arrays])
    vals = vals[np.isfinite(vals)]
    if not vals.size:
        return None
    lo, hi = float(vals.min()), float(vals.max())
    if hi == lo:
        pad = abs(lo) * 0.05 or 0.05
        return lo - pad, hi + pad
    return lo - 0.05 * (hi - lo), hi + 0.05 * (hi - lo)


# -- logits per step -------------------------------------------------------------------------------
def plot_logits(steps: np.ndarray, lmin: np.ndarray, lmax: np.ndarray, lmean: np.ndarray,
                nonfinite: np.ndarray, first_bad_step: int | None) -> Figure | None:
    """Logits min/max/mean per step; steps whose logits hold NaN/Inf shaded red, the first
    non-finite step of the trace (any record) marked with a dashed line."""
    if len(steps) == 0:
        return None
    c, ax = _new(3.0, bottom=0.17, top=0.86)
    x = steps.astype(float)
    fin = np.isfinite(lmin) & np.isfinite(lmax)
    ax.xs.lo, ax.xs.hi = float(x.min()) - 0.6, float(x.max()) + 0.6
    bad = np.nonzero(nonfinite)[0]
    for i in bad:
        ax.axvspan(x[i] - 0.5, x[i] + 0.5, RED, 0.18)
    ax.fill_between(x, np.where(fin, lmin, np.nan), np.where(fin, lmax, np.nan), BLUE, 0.12)
    ax.line(x, lmax, BLUE, 1.6, marker_size=3 + 1)
    ax.line(x, lmean, DARK, 1.2, marker_size=1.5 + 1)
    ax.line(x, lmin, LIGHT_BLUE, 1.6, marker_size=3 + 1)
    ax.xtick_size = ax.ytick_size = 8
    lim = _autoscale(lmin, lmax, lmean) if fin.any() else None
    if lim is None:
        ax.ys.lo, ax.ys.hi = -1.0, 1.0
        ax.text(0.5, 0.5, f"no finite logits in any of the {len(steps)} steps", ("axes", "axes"),
                color=RED, size=12, ha="center", va="center")
    else:
        _linear_y(ax, *lim)
    if first_bad_step is not None:
        ax.axvline(first_bad_step, RED, 1.5, DASHED)
        ax.text(first_bad_step, 1.0, f" first NaN/Inf: step {first_bad_step}", ("data", "axes"),
                color=RED, va="top", size=9, bold=True)
    entries = [("max", {"color": BLUE, "lw": 1.6, "marker": 4}),
               ("mean", {"color": DARK, "lw": 1.2, "marker": 2.5}),
               ("min", {"color": LIGHT_BLUE, "lw": 1.6, "marker": 4})]
    if len(bad):
        entries.append(("logits hold NaN/Inf", {"kind": "patch", "color": RED, "alpha": 0.25}))
    ax.legend(entries, anchor=(1.0, 1.16))
    ax.xlabel, ax.ylabel = "step (0 = prefill)", "logit value"
    xt = nice_ticks(ax.xs.lo, ax.xs.hi, 16, integer=True)
    ax.xticks = [(float(v), str(int(v))) for v in xt]
    _style(ax)
    caption = (f"Logits of each step's last position: min, mean and max over the finite values. "
               f"{len(bad)} of {len(steps)} steps have NaN/Inf logits (shaded).")
    return _render(c, [ax], "plot-logits", "Logits per step",
                   f"line plot of logits min, mean and max over {len(steps)} steps", caption)


# -- module x step heatmap -------------------------------------------------------------------------
def plot_heatmap(hm: Heatmap, mark: tuple[int, int] | None = None) -> Figure | None:
    """Module-by-step heatmap of log10 absmax; cells with NaN/Inf drawn red. `mark` = (module
    index, step index) of the first non-finite record, circled."""
    if hm.values.size == 0:
        return None
    n_rows, n_cols = hm.values.shape
    height = min(11.0, max(3.5, 0.045 * n_rows + 1.6))
    bottom, top = 0.9 / height, 1 - 0.45 / height
    c, ax = _new(height, left=0.27, right=0.9, bottom=bottom, top=top)
    cax = Axes(c, 0.915, bottom, 0.93, top)
    vals = hm.values
    fin = vals[np.isfinite(vals)]
    vmin = float(np.floor(fin.min())) if fin.size else 0.0
    vmax = float(np.ceil(fin.max())) if fin.size else 1.0
    if vmax <= vmin:
        vmax = vmin + 1
    px = viridis((np.where(np.isfinite(vals), vals, vmin) - vmin) / (vmax - vmin))
    px[~np.isfinite(vals)] = NOT_RECORDED
    px[hm.bad] = RED
    ax.xs.lo, ax.xs.hi = -0.5, n_cols - 0.5
    ax.ys.lo, ax.ys.hi = n_rows - 0.5, -0.5  # row 0 at the top
    ax.image(px)
    if mark is not None:
        r = int(np.searchsorted(hm.row_starts, mark[0], side="right") - 1)
        col = int(np.searchsorted(hm.col_starts, mark[1], side="right") - 1)
        ax.circle(col, r, 14, (0, 0, 0), 2)
        ax.circle(col, r, 14, (255, 255, 255), 0.8)
    cax.image(viridis(np.linspace(1, 0, 256))[:, None, :])
    cax.ys.lo, cax.ys.hi = vmin, vmax
    ct = nice_ticks(vmin, vmax, max(1, min(9, int(cax.h / PT / 20))))
    cax.yticks = [(float(v), tick_label(v, ct)) for v in ct]
    cax.yticks_right = True
    cax.ylabel = "log10 absmax of output"
    # y ticks: at most ~30 labels
    step = max(1, math.ceil(n_rows / 30))
    ax.yticks = [(float(i), _label(hm.row_labels[i], 48)) for i in range(0, n_rows, step)]
    ax.ytick_size = 6.5
    xstep = max(1, math.ceil(n_cols / 16))
    ax.xticks = [(float(i), str(int(hm.col_starts[i]))) for i in range(0, n_cols, xstep)]
    ax.xtick_size = 7
    ax.xlabel = "step" + (" (binned: max per bin)" if n_cols != hm.n_steps else "")
    ax.ylabel = "module (call order)" + (" (binned)" if n_rows != hm.n_modules else "")
    if hm.bad.any():
        ax.legend([("NaN/Inf in output", {"kind": "patch", "color": RED})], loc="lower right",
                  anchor=(1.0, 1.0))
    caption = (f"{hm.n_modules} modules x {hm.n_steps} steps: largest |value| of each module's "
               f"output per step (log10). Red: the output held NaN/Inf. Grey: not recorded.")
    if hm.binned:
        caption += (f" Binned to {n_rows} x {n_cols} cells (max per bin) to keep the figure "
                    f"readable.")
    return _render(c, [ax, cax], "plot-heatmap", "Module-by-step activation range",
                   f"heatmap of log10 absmax, {hm.n_modules} modules by {hm.n_steps} steps",
                   caption)


# -- producer's per-channel absmax -----------------------------------------------------------------
def plot_channels(absmax: np.ndarray, title: str, labelled: list[tuple[int, float]],
                  limit: tuple[str, float] | None, int4_half_scale: float | None) -> Figure | None:
    """Per-channel absmax of one module's input, log scale, labelled outliers, a line at the
    format's overflow limit and one at half the per-tensor INT4 scale (values below round to 0)."""
    a = np.asarray(absmax, dtype=np.float64)
    if a.size == 0:
        return None
    c, ax = _new(3.6, bottom=0.15, top=0.9)
    x = np.arange(a.size)
    pos = np.where(np.isfinite(a) & (a > 0), a, np.nan)
    floor = float(np.nanmin(pos)) if np.isfinite(pos).any() else 1e-3
    ax.vlines(x, floor * 0.5, np.where(np.isfinite(pos), pos, floor * 0.5), BLUE, 0.6, 0.8)
    top = float(np.nanmax(pos)) if np.isfinite(pos).any() else 1.0
    if limit is not None:
        name, val = limit
        ax.axhline(val, RED, 1.3, DASHED)
        ax.text(1.0, val, f"{_label(name, 20)} overflow: {_fmt(val)} ", ("axes", "data"),
                color=RED, ha="right", va="bottom", size=8)
        top = max(top, val)
    if int4_half_scale is not None and int4_half_scale > 0:
        ax.axhline(int4_half_scale, ORANGE, 1.5, DOTTED)
        n_zero = int(np.sum(np.nan_to_num(a, nan=np.inf) < int4_half_scale))
        ax.text(0.0, int4_half_scale, f" half the INT4 per-tensor scale: {_fmt(int4_half_scale)} "
                f"({n_zero} of {a.size} channels below round to 0)", ("axes", "data"),
                color=ORANGE, ha="left", va="top", size=8)
    for ch, val in labelled[:8]:
        if 0 <= ch < a.size and math.isfinite(val) and val > 0:
            ax.dot(ch, val, RED, 5)
            ax.text(ch, val * 1.25, f"ch {ch}: {_fmt(val)}", color=RED, size=8, ha="center",
                    va="bottom", bold=True)
            top = max(top, val)
    _log_y(ax, floor * 0.5, top * 4)
    ax.xs.lo, ax.xs.hi = -0.5, a.size - 0.5
    xt = nice_ticks(ax.xs.lo, ax.xs.hi, 9, integer=True)
    ax.xticks = [(float(v), str(int(v))) for v in xt]
    ax.xlabel, ax.ylabel = "input channel (last dimension)", "channel absmax"
    _style(ax)
    caption = ("Largest |value| of each input channel (max over tokens). Red dashed: the format's "
               "largest finite value; orange dotted: half the scale a per-tensor INT4 scheme "
               "would use, below which a channel rounds to 0.")
    return _render(c, [ax], "plot-channels", title,
                   f"per-channel absmax of {a.size} input channels", caption)


# -- divergence per module -------------------------------------------------------------------------
def plot_divergence(labels: list[str], scores: np.ndarray, nonfinite: np.ndarray,
                    first_jump: int | None, step: int | None) -> Figure | None:
    """Divergence score per module (call order) against a reference; the first jump marked."""
    s = np.asarray(scores, dtype=np.float64)
    if s.size == 0:
        return None
    c, ax = _new(3.4, bottom=0.15, top=0.86)
    x = np.arange(s.size)
    fin = np.isfinite(s)
    pos = np.where(fin & (s > 0), s, np.nan)
    floor = float(np.nanmin(pos)) * 0.5 if np.isfinite(pos).any() else 1e-6
    top = float(np.nanmax(pos)) if np.isfinite(pos).any() else 1.0
    colors = [RED if nf else BLUE for nf in nonfinite]
    heights = np.where(np.isfinite(pos), pos, floor)
    heights = np.where(nonfinite | ~fin, top * 2, heights)
    ax.bars(x, floor, heights, 0.9, colors)
    _log_y(ax, floor, top * 6)
    if first_jump is not None and 0 <= first_jump < s.size:
        ax.axvline(first_jump, (0, 0, 0), 1.2, DASHED)
        ax.text(first_jump, 1.0, f" first jump: {_label(labels[first_jump], 50)}",
                ("data", "axes"), va="top", size=8, bold=True)
    ax.xs.lo, ax.xs.hi = -0.6, s.size - 0.4
    xt = nice_ticks(ax.xs.lo, ax.xs.hi, 9, integer=True)
    ax.xticks = [(float(v), str(int(v))) for v in xt]
    ax.xlabel = "module (call order" + (f", step {step}" if step is not None else "") + ")"
    ax.ylabel = "divergence score"
    ax.legend([("finite", {"kind": "patch", "color": BLUE}),
               ("NaN/Inf only in this trace", {"kind": "patch", "color": RED})],
              anchor=(1.0, 1.14))
    _style(ax)
    caption = ("How far each module's statistics moved from the reference trace (largest score "
               "over the aligned records of the module). The dashed line marks the first module "
               "where the divergence jumps.")
    return _render(c, [ax], "plot-divergence", "Divergence from the reference, per module",
                   f"bar chart of divergence scores of {s.size} modules", caption)
