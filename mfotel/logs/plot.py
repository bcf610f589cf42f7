"""Training curves of one or more runs: loss, learning rate, grad norm, throughput, step time.

    series = collect(iter_rows(discover_runs(["runs/a", "runs/b"])))
    save(build_figure(series, smooth=0.9), Path("curves.png"))   # .svg/.pdf by extension

matplotlib is imported here only, lazily, with the Agg backend (no display, no pyplot state).
Each (run, rank, source) is one series with its own colour, dash pattern and width, so equal
curves stay visible on top of each other; series with few points get markers. The loss axis
and the step-time axis are logarithmic when their values span a decade or more
(`auto_log=False` turns that off);
`log_scale=True` makes every panel logarithmic. Steps whose value is NaN/Inf are marked with
an `x` on the top edge of their subplot, and the first non-finite loss step of each series
with a dotted vertical line on every subplot.
"""
from __future__ import annotations

import math
from array import array
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .parse import Row

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

PANELS: tuple[tuple[str, str], ...] = (
    ("loss", "loss"), ("learning_rate", "learning rate"), ("grad_norm", "grad norm"),
    ("throughput", "throughput (samples/s)"), ("step_time", "step time (s)"))
AUTO_LOG_PANELS = ("loss", "step_time")   # a first step that compiles the graph, for one
AUTO_LOG_SPAN = 10.0          # max / min of the finite values: a decade or more
SPARSE_POINTS = 40            # series with at most this many points get markers
# Dash patterns and widths cycle apart from the 10 colours: a later series is drawn thinner
# and dashed over an earlier one, so two identical curves still show both colours.
LINE_STYLES: tuple[object, ...] = ("-", (0, (5, 2)), (0, (3, 1, 1, 1)),
                                   (0, (6, 1.5, 1, 1.5, 1, 1.5)))
LINE_WIDTHS = (2.4, 1.8, 1.4, 1.1)
MARKERS = ("o", "s", "^", "D", "v", "P")


@dataclass
class Series:
    """One (run, rank, source)'s values per metric: parallel arrays of steps and values."""
    run: str
    rank: int
    source: str = ""
    steps: dict[str, array] = field(default_factory=dict)
    values: dict[str, array] = field(default_factory=dict)

    def add(self, metric: str, step: int, value: float) -> None:
        if metric not in self.steps:
            self.steps[metric], self.values[metric] = array("q"), array("d")
        self.steps[metric].append(step)
        self.values[metric].append(value)

    def points(self, metric: str) -> tuple[list[int], list[float]]:
        return list(self.steps.get(metric, ())), list(self.values.get(metric, ()))

    @property
    def gid(self) -> str:
        return f"{self.run}/{self.rank}/{self.source}"


SeriesKey = tuple[str, int, str]


def collect(rows: Iterable[Row], ranks: Collection[int] | None = None) -> dict[SeriesKey, Series]:
    """Series keyed by (run, rank, source), in first-seen order; `ranks` filters."""
    series: dict[SeriesKey, Series] = {}
    for row in rows:
        if ranks is not None and row.rank not in ranks:
            continue
        key = (row.run, row.rank, row.source)
        target = series.get(key)
        if target is None:
            target = series[key] = Series(row.run, row.rank, row.source)
        for metric, _ in PANELS:
            value = getattr(row, metric)
            if value is not None:
                target.add(metric, row.step, value)
    return series


def ema(values: Iterable[float], weight: float) -> list[float]:
    """TensorBoard-style exponential moving average; NaN/Inf are left out of the average and
    come out as NaN (a gap)."""
    out: list[float] = []
    last: float | None = None
    for value in values:
        if not math.isfinite(value):
            out.append(math.nan)
            continue
        last = value if last is None else weight * last + (1.0 - weight) * value
        out.append(last)
    return out


def supported_formats() -> dict[str, str]:
    """Image formats `save` can write: extension -> description (matplotlib's list)."""
    from matplotlib.backend_bases import FigureCanvasBase
    return FigureCanvasBase.get_supported_filetypes()


def output_path(path: str | Path) -> Path:
    """The file `save` writes (`.png` when there is no extension); ValueError naming the
    supported formats for any other extension."""
    path = Path(path)
    if not path.suffix:
        return path.with_suffix(".png")
    formats = supported_formats()
    if path.suffix[1:].lower() not in formats:
        raise ValueError(f"{path}: cannot write '{path.suffix}' images; use one of "
                         + ", ".join(f".{ext}" for ext in sorted(formats)))
    return path


def _labels(series: dict[SeriesKey, Series]) -> list[str]:
    """The run name, plus the rank when the run has several, plus the source when it has
    several."""
    ranks: dict[str, set[int]] = {}
    sources: dict[str, set[str]] = {}
    for run, rank, source in series:
        ranks.setdefault(run, set()).add(rank)
        sources.setdefault(run, set()).add(source)
    labels = []
    for run, rank, source in series:
        label = f"{run} rank {rank}" if len(ranks[run]) > 1 else run
        labels.append(f"{label} ({source})" if len(sources[run]) > 1 else label)
    return labels


def _raw_values(ax: Axes) -> list[float]:
    """The y values of the panel's raw lines (not the smoothed ones, nor the NaN markers)."""
    import numpy as np  # matplotlib's own dependency

    return [float(y) for line in ax.lines
            if (gid := line.get_gid()) is not None and gid.endswith("/raw")
            for y in np.asarray(line.get_ydata(), dtype=float)]


def _spans_decades(ax: Axes) -> bool:
    values = _raw_values(ax)
    return bool(values) and min(values) > 0 and max(values) / min(values) >= AUTO_LOG_SPAN


#: Beyond this a log axis' decade ticks and margins overflow to inf (matplotlib then fails to
#: label them): such panels stay linear.
LOG_AXIS_LIMIT = 1e250


def _can_log(ax: Axes) -> bool:
    values = _raw_values(ax)
    return any(y > 0 for y in values) and all(abs(y) < LOG_AXIS_LIMIT for y in values)


def _plain_log_labels(ax: Axes) -> None:
    """`20`, `0.003` instead of `2x10^1`, `3x10^-3` on a log axis (minor ticks labelled
    when the axis spans few decades, as matplotlib decides)."""
    from matplotlib.ticker import LogFormatter

    class Plain(LogFormatter):
        def _num_to_string(self, x: float, vmin: float, vmax: float) -> str:
            return f"{x:g}"
    ax.yaxis.set_major_formatter(Plain(labelOnlyBase=False))
    ax.yaxis.set_minor_formatter(Plain(labelOnlyBase=False, minor_thresholds=(2, 0.5)))


def build_figure(series: dict[SeriesKey, Series], smooth: float | None = None,
                 log_scale: bool = False, title: str | None = None,
                 auto_log: bool = True) -> Figure:
    """A 3x2 figure of five panels; each plotted line has gid `run/rank/source/metric/raw`
    (or `/smooth`, `/nonfinite`)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator
    from matplotlib.transforms import blended_transform_factory

    if smooth is not None and not 0.0 <= smooth < 1.0:
        raise ValueError(f"smoothing weight must be in [0, 1), got {smooth}")
    figure = Figure(figsize=(12, 11), layout="constrained")
    grid = figure.subplots(3, 2, sharex=True).ravel()
    figure.delaxes(grid[-1])
    axes = list(grid[:len(PANELS)])
    axes[-2].xaxis.set_tick_params(labelbottom=True)   # nothing below it any more
    labels = _labels(series)
    marked_nonfinite = False
    for ax, (metric, heading) in zip(axes, PANELS, strict=True):
        ax.set_title(heading)
        ax.grid(True, alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        top_edge = blended_transform_factory(ax.transData, ax.transAxes)
        has_data = False
        for index, (label, item) in enumerate(zip(labels, series.values(), strict=True)):
            steps, values = item.points(metric)
            style = dict(color=f"C{index % 10}", linestyle=LINE_STYLES[index % len(LINE_STYLES)],
                         linewidth=LINE_WIDTHS[index % len(LINE_WIDTHS)])
            finite = [(s, v) for s, v in zip(steps, values, strict=True) if math.isfinite(v)]
            if finite:
                has_data = True
                xs, ys = zip(*finite, strict=True)
                if len(xs) <= SPARSE_POINTS:
                    style.update(marker=MARKERS[index % len(MARKERS)], markersize=4)
                weight = smooth if metric != "learning_rate" else None
                # with smoothing the faint raw line stays out of the legend
                if weight:
                    raw = ax.plot(xs, ys, label="_raw", alpha=0.3,
                                  **{**style, "marker": None})[0]
                    line = ax.plot(xs, ema(ys, weight), label=label, **style)[0]
                    line.set_gid(f"{item.gid}/{metric}/smooth")
                else:
                    raw = ax.plot(xs, ys, label=label, **style)[0]
                raw.set_gid(f"{item.gid}/{metric}/raw")
            bad = [s for s, v in zip(steps, values, strict=True) if not math.isfinite(v)]
            if bad:
                has_data = True
                # on the top edge, each series a little lower so that overlaps stay visible
                edge = 1.0 - 0.03 * (index % 8)
                marker = ax.plot(bad, [edge] * len(bad), linestyle="none", marker="x",
                                 color=style["color"], markersize=8, clip_on=False,
                                 transform=top_edge,
                                 label=None if marked_nonfinite else "NaN/Inf")[0]
                marker.set_gid(f"{item.gid}/{metric}/nonfinite")
                marked_nonfinite = True
        if has_data and _can_log(ax) and (
                log_scale or (auto_log and metric in AUTO_LOG_PANELS and _spans_decades(ax))):
            ax.set_yscale("log")
            _plain_log_labels(ax)
        if not has_data:
            ax.text(0.5, 0.5, "not in the logs", transform=ax.transAxes, ha="center",
                    va="center", color="gray")
    for index, item in enumerate(series.values()):
        steps, values = item.points("loss")
        first_bad = next((s for s, v in zip(steps, values, strict=True)
                          if not math.isfinite(v)), None)
        if first_bad is not None:
            for ax in axes:
                ax.axvline(first_bad, color=f"C{index % 10}", linestyle=":", linewidth=1.2)
    for ax in axes[-2:]:
        ax.set_xlabel("step")
    handles, legend_labels = axes[0].get_legend_handles_labels()
    for ax in axes[1:]:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            if label not in legend_labels:
                handles.append(handle)
                legend_labels.append(label)
    if "NaN/Inf" in legend_labels:   # a neutral marker: the series colours are in the others
        from matplotlib.lines import Line2D
        handles[legend_labels.index("NaN/Inf")] = Line2D([], [], linestyle="none", marker="x",
                                                         color="0.3", markersize=8)
    if handles:
        figure.legend(handles, legend_labels, loc="outside lower center",
                      ncol=min(len(legend_labels), 4), frameon=False,
                      title=f"lines: EMA {smooth:g} over the faint raw values" if smooth else None)
    if title:
        figure.suptitle(title)
    return figure


def save(figure: Figure, path: Path, dpi: int = 120) -> Path:
    """Write the figure; the format follows the extension (PNG when there is none)."""
    path = output_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=dpi)
    return path
