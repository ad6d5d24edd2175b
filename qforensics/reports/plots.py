"""The report's figures: drawn by matplotlib (Agg), encoded by `reports.png` as base64 PNG data
URIs. Log axes are labelled 10\u00b2 in plain text (no mathtext parse per figure).

PNG, not SVG: trace strings (module names in tick labels and titles) end up as pixels, never as
markup. Trace strings are also passed with math parsing off and control characters removed, so a
module name with `$` cannot make matplotlib's mathtext fail. Each function takes plain numpy data
(prepared by `qforensics.reports.context`) and returns a `Figure` record, or None when there is
nothing to draw. No torch import.
"""

from __future__ import annotations

import base64
import math
import re
from dataclasses import dataclass

import matplotlib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import LineCollection
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure as MplFigure
from matplotlib.patches import Patch
from matplotlib.ticker import LogFormatterSciNotation, MaxNLocator, NullFormatter

from qforensics.analyze.grid import Heatmap
from qforensics.reports.png import encode_png

__all__ = [
    "Figure",
    "plot_channels",
    "plot_divergence",
    "plot_heatmap",
    "plot_logits",
]

# The heatmap is binned (max over each bin) above these sizes.
DPI = 100
WIDTH_IN = 10.0

RED = "#c62828"
ORANGE = "#ef6c00"
BLUE = "#1f5fa8"
GREY = "#777777"


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
    """Trace text made safe for matplotlib: no control characters, bounded length."""
    t = "".join(ch if ch.isprintable() else "?" for ch in str(s))
    return t if len(t) <= n else t[: n - 3] + "..."


def _text(ax, *args, **kw):
    return ax.text(*args, parse_math=False, **kw)


def _new(height: float, left: float = 0.07, right: float = 0.98, bottom: float = 0.16,
         top: float = 0.88):
    """A figure on the Agg canvas (no pyplot, no global state) with fixed margins."""
    fig = MplFigure(figsize=(WIDTH_IN, height), dpi=DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    fig.subplots_adjust(left=left, right=right, bottom=bottom, top=top)
    return fig, ax


def _render(fig: MplFigure, fid: str, title: str, alt: str, caption: str) -> Figure:
    fig.canvas.draw()
    rgba = np.asarray(fig.canvas.buffer_rgba())
    # the pixels savefig would write; an opaque figure is encoded as RGB (a quarter smaller)
    png = encode_png(rgba[..., :3] if rgba[..., 3].min() == 255 else rgba, dpi=DPI)
    w, h = fig.get_size_inches() * DPI
    uri = "data:image/png;base64," + base64.b64encode(png).decode("ascii")
    return Figure(fid, title, uri, alt, caption, round(w), round(h))


_SUPERSCRIPT = str.maketrans("-0123456789", "\u207b\u2070\u00b9\u00b2\u00b3\u2074\u2075\u2076"
                              "\u2077\u2078\u2079")
_MATHTEXT_LABEL = re.compile(r"\$\\mathdefault\{(.*)\}\$")


class _PlainLogFormatter(LogFormatterSciNotation):
    """matplotlib's log-axis labels (10\u00b2, 2\u00d710\u00b3) as plain text with Unicode
    superscripts: the same ticks and labels, drawn without mathtext, whose parser costs about
    50 ms per figure."""

    def __call__(self, x: float, pos: int | None = None) -> str:
        s = super().__call__(x, pos)
        m = _MATHTEXT_LABEL.fullmatch(s)
        if m is None:
            return s
        body = m.group(1).replace("\\times", "\u00d7")
        return re.sub(r"\^\{(-?\d+)\}", lambda g: g.group(1).translate(_SUPERSCRIPT), body)


def _log_y(ax) -> None:
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(_PlainLogFormatter())
    ax.yaxis.set_minor_formatter(NullFormatter())


def _vlines(ax, x: np.ndarray, lo: float, hi: np.ndarray, **kw) -> None:
    """`ax.vlines(x, lo, hi, **kw)` from one (N, 2, 2) array of plain segments: the same lines
    without the per-segment masked arrays vlines builds (the limits are set by the caller)."""
    seg = np.empty((len(x), 2, 2))
    seg[:, :, 0] = np.asarray(x, float)[:, None]
    seg[:, 0, 1] = lo
    seg[:, 1, 1] = hi
    ax.add_collection(LineCollection(seg, **kw), autolim=False)


def _style(ax) -> None:
    ax.spines[["top", "right"]].set_visible(False)
    ax.grid(True, axis="y", color="#e5e5e5", linewidth=0.8)
    ax.set_axisbelow(True)


def _fmt(v: float) -> str:
    if not math.isfinite(v):
        return str(v)
    a = abs(v)
    if a >= 100:
        return f"{v:,.0f}"
    if a >= 1:
        return f"{v:.2f}"
    return f"{v:.3g}"


# -- logits per step -------------------------------------------------------------------------------
def plot_logits(steps: np.ndarray, lmin: np.ndarray, lmax: np.ndarray, lmean: np.ndarray,
                nonfinite: np.ndarray, first_bad_step: int | None) -> Figure | None:
    """Logits min/max/mean per step; steps whose logits hold NaN/Inf shaded red, the first
    non-finite step of the trace (any record) marked with a dashed line."""
    if len(steps) == 0:
        return None
    fig, ax = _new(3.0, bottom=0.17, top=0.86)
    x = steps.astype(float)
    fin = np.isfinite(lmin) & np.isfinite(lmax)
    ax.fill_between(x, np.where(fin, lmin, np.nan), np.where(fin, lmax, np.nan),
                    color=BLUE, alpha=0.12, linewidth=0)
    ax.plot(x, lmax, color=BLUE, lw=1.6, marker="o", ms=3, label="max")
    ax.plot(x, lmean, color="#444444", lw=1.2, ls="-", marker=".", ms=3, label="mean")
    ax.plot(x, lmin, color="#6a9bd1", lw=1.6, marker="o", ms=3, label="min")
    bad = np.nonzero(nonfinite)[0]
    for i in bad:
        ax.axvspan(x[i] - 0.5, x[i] + 0.5, color=RED, alpha=0.18, linewidth=0)
    if not fin.any():
        ax.set_ylim(-1, 1)
        ax.set_yticks([])
        _text(ax, 0.5, 0.5, f"no finite logits in any of the {len(steps)} steps",
              transform=ax.transAxes, ha="center", va="center", color=RED, fontsize=12)
    if first_bad_step is not None:
        ax.axvline(first_bad_step, color=RED, ls="--", lw=1.5)
        _text(ax, first_bad_step, 1.0, f" first NaN/Inf: step {first_bad_step}",
              transform=ax.get_xaxis_transform(), color=RED, va="top", ha="left", fontsize=9,
              fontweight="bold")
    handles, labels = ax.get_legend_handles_labels()
    if len(bad):
        handles.append(Patch(color=RED, alpha=0.25))
        labels.append("logits hold NaN/Inf")
    ax.legend(handles, labels, loc="upper right", fontsize=8, ncols=4, frameon=False,
              bbox_to_anchor=(1.0, 1.16))
    ax.set_xlabel("step (0 = prefill)")
    ax.set_ylabel("logit value")
    ax.set_xlim(x.min() - 0.6, x.max() + 0.6)
    ax.xaxis.set_major_locator(MaxNLocator(nbins=16, integer=True))
    ax.tick_params(labelsize=8)
    _style(ax)
    n_bad = len(bad)
    caption = (f"Logits of each step's last position: min, mean and max over the finite values. "
               f"{n_bad} of {len(steps)} steps have NaN/Inf logits (shaded).")
    return _render(fig, "plot-logits", "Logits per step",
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
    fig, ax = _new(height, left=0.27, right=0.9, bottom=bottom, top=top)
    cax = fig.add_axes((0.915, bottom, 0.015, top - bottom))
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#f0f0f0")
    vals = np.ma.masked_invalid(hm.values)
    fin = vals.compressed()
    vmin = float(np.floor(fin.min())) if fin.size else 0.0
    vmax = float(np.ceil(fin.max())) if fin.size else 1.0
    if vmax <= vmin:
        vmax = vmin + 1
    im = ax.imshow(vals, aspect="auto", interpolation="nearest", cmap=cmap, vmin=vmin, vmax=vmax)
    if hm.bad.any():
        overlay = np.ma.masked_where(~hm.bad, np.ones_like(hm.values))
        ax.imshow(overlay, aspect="auto", interpolation="nearest",
                  cmap=ListedColormap([RED]), vmin=0, vmax=1)
    if mark is not None:
        r = int(np.searchsorted(hm.row_starts, mark[0], side="right") - 1)
        c = int(np.searchsorted(hm.col_starts, mark[1], side="right") - 1)
        ax.plot([c], [r], marker="o", ms=14, mfc="none", mec="black", mew=2)
        ax.plot([c], [r], marker="o", ms=14, mfc="none", mec="white", mew=0.8)
    cb = fig.colorbar(im, cax=cax)
    cb.set_label("log10 absmax of output")
    # y ticks: at most ~30 labels (tick labels are expensive to lay out)
    step = max(1, math.ceil(n_rows / 30))
    ticks = np.arange(0, n_rows, step)
    ax.set_yticks(ticks, [_label(hm.row_labels[i], 48) for i in ticks], fontsize=6.5,
                  parse_math=False)
    xstep = max(1, math.ceil(n_cols / 16))
    xt = np.arange(0, n_cols, xstep)
    ax.set_xticks(xt, [str(int(hm.col_starts[i])) for i in xt], fontsize=7)
    ax.set_xlabel("step" + (" (binned: max per bin)" if n_cols != hm.n_steps else ""))
    ax.set_ylabel("module (call order)" + (" (binned)" if n_rows != hm.n_modules else ""))
    if hm.bad.any():
        ax.legend([Patch(color=RED)], ["NaN/Inf in output"], loc="lower right", fontsize=8,
                  bbox_to_anchor=(1.0, 1.0), frameon=False, borderaxespad=0.2)
    caption = (f"{hm.n_modules} modules x {hm.n_steps} steps: largest |value| of each module's "
               f"output per step (log10). Red: the output held NaN/Inf. Grey: not recorded.")
    if hm.binned:
        caption += (f" Binned to {n_rows} x {n_cols} cells (max per bin) to keep the figure "
                    f"readable.")
    return _render(fig, "plot-heatmap", "Module-by-step activation range",
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
    fig, ax = _new(3.6, bottom=0.15, top=0.9)
    x = np.arange(a.size)
    pos = np.where(np.isfinite(a) & (a > 0), a, np.nan)
    floor = np.nanmin(pos) if np.isfinite(pos).any() else 1e-3
    _vlines(ax, x, floor * 0.5, np.where(np.isfinite(pos), pos, floor * 0.5), colors=BLUE,
            linewidths=0.6, alpha=0.8)
    _log_y(ax)
    top = np.nanmax(pos) if np.isfinite(pos).any() else 1.0
    if limit is not None:
        name, val = limit
        ax.axhline(val, color=RED, ls="--", lw=1.3)
        _text(ax, 1.0, val, f"{_label(name, 20)} overflow: {_fmt(val)} ", color=RED,
              transform=ax.get_yaxis_transform(), ha="right", va="bottom", fontsize=8)
        top = max(top, val)
    if int4_half_scale is not None and int4_half_scale > 0:
        ax.axhline(int4_half_scale, color=ORANGE, ls=":", lw=1.5)
        n_zero = int(np.sum(np.nan_to_num(a, nan=np.inf) < int4_half_scale))
        _text(ax, 0.0, int4_half_scale,
              f" half the INT4 per-tensor scale: {_fmt(int4_half_scale)} "
              f"({n_zero} of {a.size} channels below round to 0)",
              color=ORANGE, transform=ax.get_yaxis_transform(), ha="left", va="top",
              fontsize=8)
    for ch, val in labelled[:8]:
        if 0 <= ch < a.size and math.isfinite(val) and val > 0:
            ax.plot([ch], [val], "o", color=RED, ms=5)
            _text(ax, ch, val * 1.25, f"ch {ch}: {_fmt(val)}", color=RED, fontsize=8,
                  ha="center", va="bottom", fontweight="bold")
            top = max(top, val)
    ax.set_ylim(floor * 0.5, top * 4)
    ax.set_xlim(-0.5, a.size - 0.5)
    ax.set_xlabel("input channel (last dimension)")
    ax.set_ylabel("channel absmax")
    _style(ax)
    caption = ("Largest |value| of each input channel (max over tokens). Red dashed: the format's "
               "largest finite value; orange dotted: half the scale a per-tensor INT4 scheme "
               "would use, below which a channel rounds to 0.")
    return _render(fig, "plot-channels", title,
                   f"per-channel absmax of {a.size} input channels", caption)


# -- divergence per module -------------------------------------------------------------------------
def plot_divergence(labels: list[str], scores: np.ndarray, nonfinite: np.ndarray,
                    first_jump: int | None, step: int | None) -> Figure | None:
    """Divergence score per module (call order) against a reference; the first jump marked."""
    s = np.asarray(scores, dtype=np.float64)
    if s.size == 0:
        return None
    fig, ax = _new(3.4, bottom=0.15, top=0.86)
    x = np.arange(s.size)
    fin = np.isfinite(s)
    pos = np.where(fin & (s > 0), s, np.nan)
    floor = np.nanmin(pos) * 0.5 if np.isfinite(pos).any() else 1e-6
    top = np.nanmax(pos) if np.isfinite(pos).any() else 1.0
    colors = [RED if nf else BLUE for nf in nonfinite]
    heights = np.where(np.isfinite(pos), pos, floor)
    heights = np.where(nonfinite | ~fin, top * 2, heights)
    ax.bar(x, heights - floor, bottom=floor, color=colors, width=0.9, linewidth=0)
    _log_y(ax)
    if first_jump is not None and 0 <= first_jump < s.size:
        ax.axvline(first_jump, color="black", ls="--", lw=1.2)
        _text(ax, first_jump, 1.0, f" first jump: {_label(labels[first_jump], 50)}",
              transform=ax.get_xaxis_transform(), va="top", ha="left", fontsize=8,
              fontweight="bold")
    ax.set_xlim(-0.6, s.size - 0.4)
    ax.set_ylim(floor, top * 6)
    ax.set_xlabel("module (call order" + (f", step {step}" if step is not None else "") + ")")
    ax.set_ylabel("divergence score")
    handles = [Patch(color=BLUE), Patch(color=RED)]
    ax.legend(handles, ["finite", "NaN/Inf only in this trace"], loc="upper right", fontsize=8,
              frameon=False, bbox_to_anchor=(1.0, 1.14), ncols=2)
    _style(ax)
    caption = ("How far each module's statistics moved from the reference trace (largest score "
               "over the aligned records of the module). The dashed line marks the first module "
               "where the divergence jumps.")
    return _render(fig, "plot-divergence", "Divergence from the reference, per module",
                   f"bar chart of divergence scores of {s.size} modules", caption)
