"""Training curves of one or more runs: loss, learning rate, grad norm, throughput.

    series = collect(iter_rows(discover_runs(["runs/a", "runs/b"])))
    save(build_figure(series, smooth=0.9), Path("curves.png"))   # .svg/.pdf by extension

matplotlib is imported here only, lazily, with the Agg backend (no display, no pyplot state).
Steps whose value is NaN/Inf are marked with an `x` on the top edge of their subplot, and
the first non-finite loss step of each series with a dotted vertical line on every subplot.
"""
from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Collection, Iterable

from .parse import Row

if TYPE_CHECKING:
    from matplotlib.figure import Figure

PANELS: tuple[tuple[str, str], ...] = (
    ("loss", "loss"), ("learning_rate", "learning rate"), ("grad_norm", "grad norm"),
    ("throughput", "throughput (samples/s)"))
LOG_SCALE_PANELS = ("loss", "learning_rate", "grad_norm")


@dataclass
class Series:
    """One (run, rank)'s values per metric: parallel arrays of steps and values (compact)."""
    run: str
    rank: int
    steps: dict[str, array] = field(default_factory=dict)
    values: dict[str, array] = field(default_factory=dict)

    def add(self, metric: str, step: int, value: float) -> None:
        if metric not in self.steps:
            self.steps[metric], self.values[metric] = array("q"), array("d")
        self.steps[metric].append(step)
        self.values[metric].append(value)

    def points(self, metric: str) -> tuple[list[int], list[float]]:
        return list(self.steps.get(metric, ())), list(self.values.get(metric, ()))


def collect(rows: Iterable[Row],
            ranks: Collection[int] | None = None) -> dict[tuple[str, int], Series]:
    """Series keyed by (run, rank), in first-seen order; `ranks` filters."""
    series: dict[tuple[str, int], Series] = {}
    for row in rows:
        if ranks is not None and row.rank not in ranks:
            continue
        key = (row.run, row.rank)
        target = series.get(key)
        if target is None:
            target = series[key] = Series(row.run, row.rank)
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


def _label(item: Series, multi_rank: set[str]) -> str:
    return f"{item.run} rank {item.rank}" if item.run in multi_rank else item.run


def build_figure(series: dict[tuple[str, int], Series], smooth: float | None = None,
                 log_scale: bool = False, title: str | None = None) -> "Figure":
    """A 2x2 figure; each plotted line has gid `run/rank/metric/raw` (or `/smooth`)."""
    from matplotlib.figure import Figure
    from matplotlib.transforms import blended_transform_factory

    if smooth is not None and not 0.0 <= smooth < 1.0:
        raise ValueError(f"smoothing weight must be in [0, 1), got {smooth}")
    figure = Figure(figsize=(12, 8), layout="constrained")
    axes = figure.subplots(2, 2, sharex=True).ravel()
    ranks_per_run: dict[str, set[int]] = {}
    for run, rank in series:
        ranks_per_run.setdefault(run, set()).add(rank)
    multi_rank = {run for run, ranks in ranks_per_run.items() if len(ranks) > 1}
    colors = [f"C{index % 10}" for index in range(len(series))]
    marked_nonfinite = False
    for ax, (metric, heading) in zip(axes, PANELS):
        ax.set_title(heading)
        ax.grid(True, alpha=0.3)
        top_edge = blended_transform_factory(ax.transData, ax.transAxes)
        has_data = False
        for index, (color, item) in enumerate(zip(colors, series.values())):
            steps, values = item.points(metric)
            label = _label(item, multi_rank)
            finite = [(s, v) for s, v in zip(steps, values) if math.isfinite(v)]
            if finite:
                has_data = True
                xs, ys = zip(*finite)
                smoothing = bool(smooth) and metric != "learning_rate"
                # with smoothing the faint raw line stays out of the legend
                raw = ax.plot(xs, ys, color=color, label="_raw" if smoothing else label,
                              alpha=0.3 if smoothing else 1.0, linewidth=1.0)[0]
                raw.set_gid(f"{item.run}/{item.rank}/{metric}/raw")
                if smoothing:
                    line = ax.plot(xs, ema(ys, smooth), color=color, linewidth=1.6,
                                   label=label)[0]
                    line.set_gid(f"{item.run}/{item.rank}/{metric}/smooth")
            bad = [s for s, v in zip(steps, values) if not math.isfinite(v)]
            if bad:
                has_data = True
                # on the top edge, each series a little lower so that overlaps stay visible
                edge = 1.0 - 0.03 * (index % 8)
                marker = ax.plot(bad, [edge] * len(bad), linestyle="none", marker="x",
                                 color=color, markersize=8, clip_on=False, transform=top_edge,
                                 label=None if marked_nonfinite else "NaN/Inf")[0]
                marker.set_gid(f"{item.run}/{item.rank}/{metric}/nonfinite")
                marked_nonfinite = True
        if log_scale and metric in LOG_SCALE_PANELS and has_data:
            ax.set_yscale("log")
        if not has_data:
            ax.text(0.5, 0.5, "not in the logs", transform=ax.transAxes, ha="center",
                    va="center", color="gray")
    for color, item in zip(colors, series.values()):
        steps, values = item.points("loss")
        first_bad = next((s for s, v in zip(steps, values) if not math.isfinite(v)), None)
        if first_bad is not None:
            for ax in axes:
                ax.axvline(first_bad, color=color, linestyle=":", linewidth=1.2)
    for ax in axes[2:]:
        ax.set_xlabel("step")
    handles, labels = axes[0].get_legend_handles_labels()
    for ax in axes[1:]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            if label not in labels:
                handles.append(handle)
                labels.append(label)
    if "NaN/Inf" in labels:   # a neutral marker: the series colours are in the other entries
        from matplotlib.lines import Line2D
        handles[labels.index("NaN/Inf")] = Line2D([], [], linestyle="none", marker="x",
                                                  color="0.3", markersize=8)
    if handles:
        figure.legend(handles, labels, loc="outside lower center",
                      ncol=min(len(labels), 4), frameon=False,
                      title=f"lines: EMA {smooth:g} over the faint raw values" if smooth else None)
    if title:
        figure.suptitle(title)
    return figure


def save(figure: "Figure", path: Path, dpi: int = 120) -> Path:
    """Write the figure; the format follows the extension (PNG when there is none)."""
    path = Path(path)
    if not path.suffix:
        path = path.with_suffix(".png")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=dpi)
    return path
