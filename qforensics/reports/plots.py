"""The report's figures, drawn by matplotlib (Agg, imported when the first figure is drawn) from
the analysis's views (qforensics.analyze.views, analyze.grid) and returned as PNG data URIs.

PNG, not SVG: trace strings (module names in tick labels, the first jump's label) end up as
pixels, never as markup. matplotlib never reads them as math: TeX is off and every `$` is
escaped (`_label`); control characters are replaced and lengths bounded. No torch import.
"""

from __future__ import annotations

import base64
import io
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from qforensics.analyze.grid import Heatmap
from qforensics.analyze.views import ChannelView, DivergenceSeries, LogitsSeries

__all__ = ["Figure", "plot_channels", "plot_divergence", "plot_heatmap", "plot_logits"]

WIDTH_IN, DPI = 10.0, 100
RED, ORANGE, BLUE, LIGHT_BLUE, DARK = "#c62828", "#ef6c00", "#1f5fa8", "#6a9bd1", "#444444"
NOT_RECORDED = "#f0f0f0"
# TeX off (trace labels are never math), glyphs unhinted (cheaper to draw)
RC = {"text.usetex": False, "text.hinting": "no_hinting",
      "axes.spines.top": False, "axes.spines.right": False, "font.family": "DejaVu Sans",
      "savefig.dpi": DPI, "figure.dpi": DPI}


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
    """Trace text made safe to draw: printable, bounded, and every `$` escaped so that
    matplotlib draws it as a dollar sign, never as the start of math text."""
    t = "".join(ch if ch.isprintable() else "?" for ch in str(s))
    t = t if len(t) <= n else t[: n - 3] + "..."
    return t.replace("$", r"\$")


def _fmt(v: float) -> str:
    if not math.isfinite(v):
        return str(v)
    a = abs(v)
    if a >= 100:
        return f"{v:,.0f}"
    return f"{v:.2f}" if a >= 1 else f"{v:.3g}"


def _new(height: float, rect: tuple[float, float, float, float]) -> tuple[Any, Any]:
    """A figure WIDTH_IN wide with one axes at (left, bottom, right, top), y grid on."""
    from matplotlib.figure import Figure as MplFigure

    fig = MplFigure(figsize=(WIDTH_IN, height), dpi=DPI)
    left, bottom, right, top = rect
    fig.subplots_adjust(left=left, bottom=bottom, right=right, top=top)
    ax = fig.add_subplot()
    ax.set_axisbelow(True)
    return fig, ax


def _render(fig: Any, fid: str, title: str, alt: str, caption: str) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    buf = io.BytesIO()
    canvas.print_png(buf, pil_kwargs={"compress_level": 1})
    w, h = (int(round(v)) for v in canvas.get_width_height())
    uri = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")
    return Figure(fid, title, uri, alt, caption, w, h)


def _draw(build: Any, *args: Any) -> Any:
    """Run a figure builder under the report's rc settings (TeX off, matplotlib's defaults)."""
    import matplotlib

    with matplotlib.rc_context(RC):
        return build(*args)


_SUPERSCRIPT = str.maketrans("-0123456789", "\u207b\u2070\u00b9\u00b2\u00b3\u2074\u2075\u2076\u2077"
                             "\u2078\u2079")


def _power_of_ten(v: float, _pos: object = None) -> str:
    """A log axis' tick label as plain text ('10\u00b3', '2\u00d710\u00b3'): matplotlib's
    default formatter writes math text, and parsing it costs more than drawing a figure."""
    if not (v > 0 and math.isfinite(v)):
        return ""
    e = math.floor(math.log10(v) + 1e-9)
    m = v / 10.0 ** e
    power = "10" + str(e).translate(_SUPERSCRIPT)
    return power if abs(m - 1) < 1e-6 else f"{m:g}\u00d7{power}"


def _log_y(ax: Any, lo: float, hi: float) -> None:
    """Log y axis from lo to hi: decades labelled, 2 and 5 x each decade too when the axis
    spans less than two decades; no minor ticks (each tick costs as much as a label)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

    ax.set_yscale("log")
    ax.set_ylim(lo, hi)
    subs = (1.0, 2.0, 5.0) if hi < 100 * lo else (1.0,)
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=subs, numticks=12))
    ax.yaxis.set_major_formatter(FuncFormatter(_power_of_ten))
    ax.yaxis.set_minor_locator(NullLocator())


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """(first, last) index of each run of True."""
    idx = np.flatnonzero(mask)
    if not idx.size:
        return []
    cut = np.flatnonzero(np.diff(idx) > 1)
    return list(zip(idx[np.r_[0, cut + 1]].tolist(), idx[np.r_[cut, idx.size - 1]].tolist()))


def _patch(color: str, label: str, alpha: float = 1.0) -> Any:
    from matplotlib.patches import Patch

    return Patch(facecolor=color, alpha=alpha, label=label)


# -- logits per step -------------------------------------------------------------------------------
def plot_logits(s: LogitsSeries | None) -> Figure | None:
    """Logits min/max/mean per step; steps whose logits hold NaN/Inf shaded red, the first
    non-finite step of the trace (any record) marked with a dashed line."""
    if s is None or len(s.steps) == 0:
        return None
    return _draw(_logits, s)


def _logits(s: LogitsSeries) -> Figure:
    from matplotlib.ticker import MaxNLocator

    fig, ax = _new(3.0, (0.07, 0.17, 0.98, 0.86))
    x = s.steps.astype(float)
    fin = np.isfinite(s.lmin) & np.isfinite(s.lmax)
    for a, b in _runs(s.nonfinite):
        ax.axvspan(x[a] - 0.5, x[b] + 0.5, color=RED, alpha=0.18, lw=0)
    ax.fill_between(x, np.where(fin, s.lmin, np.nan), np.where(fin, s.lmax, np.nan),
                    color=BLUE, alpha=0.12, lw=0)
    ax.plot(x, s.lmax, color=BLUE, lw=1.6, marker="o", ms=4, label="max")
    ax.plot(x, s.lmean, color=DARK, lw=1.2, marker="o", ms=2.5, label="mean")
    ax.plot(x, s.lmin, color=LIGHT_BLUE, lw=1.6, marker="o", ms=4, label="min")
    ax.set_xlim(float(x.min()) - 0.6, float(x.max()) + 0.6)
    if not fin.any():
        ax.set_ylim(-1.0, 1.0)
        ax.text(0.5, 0.5, f"no finite logits in any of the {len(x)} steps", color=RED,
                fontsize=12, ha="center", va="center", transform=ax.transAxes)
    if s.first_bad_step is not None:
        ax.axvline(s.first_bad_step, color=RED, lw=1.5, ls="--")
        ax.text(s.first_bad_step, 1.0, f" first NaN/Inf: step {s.first_bad_step}", color=RED,
                va="top", fontsize=9, fontweight="bold", transform=ax.get_xaxis_transform())
    handles, _ = ax.get_legend_handles_labels()
    bad = int(np.count_nonzero(s.nonfinite))
    if bad:
        handles.append(_patch(RED, "logits hold NaN/Inf", 0.25))
    ax.legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=len(handles),
              fontsize=8, frameon=False)
    ax.xaxis.set_major_locator(MaxNLocator(nbins=16, integer=True))
    ax.tick_params(labelsize=8)
    ax.grid(axis="y", alpha=0.3)
    ax.set_xlabel("step (0 = prefill)")
    ax.set_ylabel("logit value")
    caption = (f"Logits of each step's last position: min, mean and max over the finite values. "
               f"{bad} of {len(x)} steps have NaN/Inf logits (shaded).")
    return _render(fig, "plot-logits", "Logits per step",
                   f"line plot of logits min, mean and max over {len(x)} steps", caption)


# -- module x step heatmap -------------------------------------------------------------------------
def plot_heatmap(hm: Heatmap | None) -> Figure | None:
    """Module-by-step heatmap of log10 absmax; cells with NaN/Inf red, unrecorded ones grey; the
    first non-finite record's cell (`hm.mark`) circled."""
    if hm is None or hm.values.size == 0:
        return None
    return _draw(_heatmap, hm)


def _heatmap(hm: Heatmap) -> Figure:
    from matplotlib import colormaps
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize, to_rgba

    n_rows, n_cols = hm.values.shape
    height = min(11.0, max(3.5, 0.045 * n_rows + 1.6))
    bottom, top = 0.9 / height, 1 - 0.45 / height
    fig, ax = _new(height, (0.27, bottom, 0.9, top))
    cax = fig.add_axes((0.915, bottom, 0.015, top - bottom))
    vals = hm.values
    finite = np.isfinite(vals)
    vmin = float(np.floor(vals[finite].min())) if finite.any() else 0.0
    vmax = float(np.ceil(vals[finite].max())) if finite.any() else 1.0
    vmax = vmax if vmax > vmin else vmin + 1
    norm, cmap = Normalize(vmin, vmax), colormaps["viridis"]
    px = cmap(norm(np.where(finite, vals, vmin)))
    px[~finite] = to_rgba(NOT_RECORDED)
    px[hm.bad] = to_rgba(RED)
    ax.imshow(px, aspect="auto", interpolation="nearest")
    if hm.mark is not None:
        row, col = hm.mark
        ax.plot([col], [row], "o", ms=20, mfc="none", mec="black", mew=2)
        ax.plot([col], [row], "o", ms=20, mfc="none", mec="white", mew=0.8)
    fig.colorbar(ScalarMappable(norm, cmap), cax=cax).set_label("log10 absmax of output")
    step = max(1, math.ceil(n_rows / 30))  # at most ~30 module labels
    rows = range(0, n_rows, step)
    ax.set_yticks(list(rows), [_label(hm.row_labels[i], 48) for i in rows], fontsize=6.5)
    cols = range(0, n_cols, max(1, math.ceil(n_cols / 16)))
    ax.set_xticks(list(cols), [str(int(hm.col_starts[i])) for i in cols], fontsize=7)
    ax.set_xlabel("step" + (" (binned: max per bin)" if n_cols != hm.n_steps else ""))
    ax.set_ylabel("module (call order)" + (" (binned)" if n_rows != hm.n_modules else ""))
    if hm.bad.any():
        ax.legend(handles=[_patch(RED, "NaN/Inf in output")], loc="lower right",
                  bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    caption = (f"{hm.n_modules} modules x {hm.n_steps} steps: largest |value| of each module's "
               f"output per step (log10). Red: the output held NaN/Inf. Grey: not recorded.")
    if hm.binned:
        caption += (f" Binned to {n_rows} x {n_cols} cells (max per bin) to keep the figure "
                    f"readable.")
    return _render(fig, "plot-heatmap", "Module-by-step activation range",
                   f"heatmap of log10 absmax, {hm.n_modules} modules by {hm.n_steps} steps",
                   caption)


# -- the responsible module's per-channel absmax ---------------------------------------------------
def plot_channels(v: ChannelView | None) -> Figure | None:
    """Per-channel absmax of one module's input, log scale, labelled outliers, a line at the
    format's overflow limit and one at half the per-tensor INT4 scale (values below round to 0)."""
    if v is None or v.absmax.size == 0:
        return None
    return _draw(_channels, v)


def _channels(v: ChannelView) -> Figure:
    from matplotlib.ticker import MaxNLocator

    fig, ax = _new(3.6, (0.07, 0.15, 0.98, 0.9))
    a = np.asarray(v.absmax, np.float64)
    x = np.arange(a.size)
    pos = np.where(np.isfinite(a) & (a > 0), a, np.nan)
    any_pos = bool(np.isfinite(pos).any())
    floor = float(np.nanmin(pos)) if any_pos else 1e-3
    top = float(np.nanmax(pos)) if any_pos else 1.0
    ax.vlines(x, floor * 0.5, np.where(np.isfinite(pos), pos, floor * 0.5), color=BLUE, lw=0.6,
              alpha=0.8)
    blend = ax.get_yaxis_transform()  # x in axes, y in data
    name, limit = v.limit
    ax.axhline(limit, color=RED, lw=1.3, ls="--")
    ax.text(1.0, limit, f"{_label(name, 20)} overflow: {_fmt(limit)} ", color=RED, ha="right",
            va="bottom", fontsize=8, transform=blend)
    top = max(top, limit)
    half = v.int4_half_scale
    if half is not None and half > 0:
        ax.axhline(half, color=ORANGE, lw=1.5, ls=":")
        ax.text(0.0, half, f" half the INT4 per-tensor scale: {_fmt(half)} ({v.int4_zeroed} of "
                f"{a.size} channels below round to 0)", color=ORANGE, ha="left", va="top",
                fontsize=8, transform=blend)
    for ch, val in v.labelled[:8]:
        if 0 <= ch < a.size and math.isfinite(val) and val > 0:
            ax.plot([ch], [val], "o", color=RED, ms=5)
            ax.text(ch, val * 1.25, f"ch {ch}: {_fmt(val)}", color=RED, fontsize=8, ha="center",
                    va="bottom", fontweight="bold")
            top = max(top, val)
    _log_y(ax, floor * 0.5, top * 4)
    ax.set_xlim(-0.5, a.size - 0.5)
    ax.xaxis.set_major_locator(MaxNLocator(nbins=9, integer=True))
    ax.grid(axis="y", alpha=0.3)
    ax.set_xlabel("input channel (last dimension)")
    ax.set_ylabel("channel absmax")
    who = {"producer": "producer", "outlier": "largest outlier"}.get(v.why, v.why)
    title = (f"Input channels of {v.module} ({who}), step {v.step}"
             + (f", call {v.call_index}" if v.call_index >= 0 else ""))
    caption = ("Largest |value| of each input channel (max over tokens). Red dashed: the format's "
               "largest finite value; orange dotted: half the scale a per-tensor INT4 scheme "
               "would use, below which a channel rounds to 0.")
    return _render(fig, "plot-channels", title, f"per-channel absmax of {a.size} input channels",
                   caption)


# -- divergence per module -------------------------------------------------------------------------
def plot_divergence(d: DivergenceSeries | None) -> Figure | None:
    """Divergence score per module (call order) against a reference; the first jump marked."""
    if d is None or d.scores.size == 0:
        return None
    return _draw(_divergence, d)


def _divergence(d: DivergenceSeries) -> Figure:
    from matplotlib.ticker import MaxNLocator

    fig, ax = _new(3.4, (0.07, 0.15, 0.98, 0.86))
    s = d.scores
    x = np.arange(s.size)
    fin = np.isfinite(s)
    pos = np.where(fin & (s > 0), s, np.nan)
    any_pos = bool(np.isfinite(pos).any())
    floor = float(np.nanmin(pos)) * 0.5 if any_pos else 1e-6
    top = float(np.nanmax(pos)) if any_pos else 1.0
    heights = np.where(d.nonfinite | ~fin, top * 2, np.where(np.isfinite(pos), pos, floor))
    ax.bar(x, heights - floor, bottom=floor, width=0.9,
           color=[RED if nf else BLUE for nf in d.nonfinite])
    _log_y(ax, floor, top * 6)
    if d.first_jump is not None and 0 <= d.first_jump < s.size:
        ax.axvline(d.first_jump, color="black", lw=1.2, ls="--")
        ax.text(d.first_jump, 1.0, f" first jump: {_label(d.modules[d.first_jump], 50)}",
                va="top", fontsize=8, fontweight="bold", transform=ax.get_xaxis_transform())
    ax.set_xlim(-0.6, s.size - 0.4)
    ax.xaxis.set_major_locator(MaxNLocator(nbins=9, integer=True))
    ax.grid(axis="y", alpha=0.3)
    ax.set_xlabel("module (call order" + (f", step {d.step}" if d.step is not None else "") + ")")
    ax.set_ylabel("divergence score")
    ax.legend(handles=[_patch(BLUE, "finite"), _patch(RED, "NaN/Inf only in this trace")],
              loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=2, fontsize=8, frameon=False)
    caption = ("How far each module's statistics moved from the reference trace (largest score "
               "over the aligned records of the module). The dashed line marks the first module "
               "where the divergence jumps.")
    return _render(fig, "plot-divergence", "Divergence from the reference, per module",
                   f"bar chart of divergence scores of {s.size} modules", caption)
