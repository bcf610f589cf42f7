"""A Markdown summary per run (the archive README of an experiment).

    print(summarize_markdown(discover_runs(["runs/exp1"])))

Per rank and source (mfotel's lines and mindformers' MFLossMonitor lines are kept apart: they
measure throughput differently): logged steps, first/last/min loss, the first step whose loss
or grad norm was NaN/Inf with the learning rate and grad norm of the logged step just before
it, mean throughput; per run: the log files and what each holds, the config YAML found beside
the logs.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from .parse import (
    SOURCE_JSON,
    SOURCE_MINDFORMERS,
    SOURCE_TEXT,
    SOURCES,
    ParseReport,
    Progress,
    Row,
    Run,
    is_finite,
    is_nonfinite,
    parse_file,
)

#: What each source's numbers are, for the reader of a summary.
SOURCE_NOTES = {
    SOURCE_TEXT: "mfotel `[Monitor]` lines: throughput = samples/s of this rank over the "
                 "record interval",
    SOURCE_JSON: "mfotel JSON lines: throughput = samples/s of this rank over the record "
                 "interval",
    SOURCE_MINDFORMERS: "mindformers MFLossMonitor lines (info.log): throughput = samples/s "
                        "per device (`samples/s/p`), every step",
}


@dataclass
class RankSummary:
    """Streaming aggregate of one rank's rows of one source."""
    rank: int
    source: str = ""
    rows: int = 0
    first_step: int | None = None
    last_step: int | None = None
    first_loss: float | None = None
    last_loss: float | None = None
    min_loss: float | None = None
    min_loss_step: int | None = None
    first_nonfinite_step: int | None = None
    nonfinite_metric: str | None = None
    before_step: int | None = None       # the logged step just before the first non-finite one
    lr_before: float | None = None
    grad_norm_before: float | None = None
    throughput_sum: float = 0.0
    throughput_count: int = 0
    _previous: Row | None = None

    def add(self, row: Row) -> None:
        self.rows += 1
        if self.first_step is None:
            self.first_step = row.step
        self.last_step = row.step
        if row.loss is not None:
            if self.first_loss is None:
                self.first_loss = row.loss
            self.last_loss = row.loss
            if is_finite(row.loss) and (self.min_loss is None or row.loss < self.min_loss):
                self.min_loss, self.min_loss_step = row.loss, row.step
        if self.first_nonfinite_step is None:
            bad = [name for name in ("loss", "grad_norm") if is_nonfinite(getattr(row, name))]
            if bad:
                self.first_nonfinite_step = row.step
                self.nonfinite_metric = "+".join(
                    f"{name}={getattr(row, name)}" for name in bad)
                previous = self._previous
                if previous is not None:
                    self.before_step = previous.step
                    self.lr_before = previous.learning_rate
                    self.grad_norm_before = previous.grad_norm
        if is_finite(row.throughput):
            self.throughput_sum += row.throughput
            self.throughput_count += 1
        self._previous = row

    @property
    def mean_throughput(self) -> float | None:
        return self.throughput_sum / self.throughput_count if self.throughput_count else None


@dataclass
class RunSummary:
    name: str
    files: list[Path]
    config: Path | None
    ranks: dict[tuple[int, str], RankSummary]      # (rank, source) -> summary
    problems: int = 0
    kinds: dict[Path, str] | None = None


def find_config(run: Run) -> Path | None:
    """A YAML beside the logs: in the run's directory or a log file's directory (and up to
    two levels above it), preferring names containing "config", then the first by name."""
    candidates: list[Path] = []
    directories: list[Path] = [run.root]
    for path in run.files:
        directories += [path.parent, *list(path.parents)[1:3]]
    seen: set[Path] = set()
    for directory in directories:
        directory = directory.absolute()
        if directory in seen or not directory.is_dir():
            continue
        seen.add(directory)
        found = sorted(p for p in directory.iterdir()
                       if p.suffix in (".yaml", ".yml") and p.is_file()
                       and not p.name.startswith((".", "docker-compose", "compose")))
        if found:
            candidates += found
            break
    if not candidates:
        return None
    preferred = [p for p in candidates if "config" in p.name.lower()]
    return (preferred or candidates)[0]


def summarize(runs: Iterable[Run], report: ParseReport | None = None,
              progress: Progress | None = None) -> Iterator[RunSummary]:
    """One RunSummary per run, streaming its files once."""
    report = report if report is not None else ParseReport()
    for run in runs:
        ranks: dict[tuple[int, str], RankSummary] = {}
        problems_before = report.problem_count
        for path in run.files:
            for row in parse_file(path, run=run.name, report=report, progress=progress):
                key = (row.rank, row.source)
                summary = ranks.get(key)
                if summary is None:
                    summary = ranks[key] = RankSummary(row.rank, row.source)
                summary.add(row)
        order = {source: index for index, source in enumerate(SOURCES)}
        yield RunSummary(run.name, list(run.files), find_config(run),
                         dict(sorted(ranks.items(),
                                     key=lambda item: (item[0][0], order.get(item[0][1], 9)))),
                         report.problem_count - problems_before, dict(run.kinds))


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return f"{value:.6g}"


_HEADER = ("rank", "source", "steps logged", "step range", "first loss", "last loss",
           "min loss (step)", "first non-finite step", "lr before it", "grad norm before it",
           "mean throughput (samples/s)")


def markdown(summary: RunSummary) -> str:
    """`## run`, where its logs and config are, and one table line per rank."""
    lines = [f"## {summary.name}", ""]
    kinds = summary.kinds or {}
    shown = ", ".join(f"`{path}`" + (f" ({kinds[path]})" if path in kinds else "")
                      for path in summary.files[:4])
    more = f" and {len(summary.files) - 4} more" if len(summary.files) > 4 else ""
    lines.append(f"- logs: {shown}{more}")
    lines.append(f"- config: `{summary.config}`" if summary.config else "- config: not found")
    sources = sorted({source for _, source in summary.ranks},
                     key=lambda source: SOURCES.index(source) if source in SOURCES else 9)
    lines += [f"- source {source}: {SOURCE_NOTES.get(source, '')}" for source in sources]
    if summary.problems:
        lines.append(f"- unparseable monitor lines: {summary.problems}")
    lines += ["", "| " + " | ".join(_HEADER) + " |", "|" + "---|" * len(_HEADER)]
    if not summary.ranks:
        lines.append("| " + " | ".join(["-"] * len(_HEADER)) + " |")
    for rank in summary.ranks.values():
        if rank.first_nonfinite_step is None:
            nonfinite = "none"
        else:
            nonfinite = f"{rank.first_nonfinite_step} ({rank.nonfinite_metric})"
        before = "" if rank.before_step is None else f" (step {rank.before_step})"
        cells = [str(rank.rank), rank.source, str(rank.rows),
                 f"{rank.first_step}..{rank.last_step}",
                 _fmt(rank.first_loss), _fmt(rank.last_loss),
                 "-" if rank.min_loss is None else f"{_fmt(rank.min_loss)} ({rank.min_loss_step})",
                 nonfinite,
                 "-" if rank.first_nonfinite_step is None else _fmt(rank.lr_before) + before,
                 "-" if rank.first_nonfinite_step is None else _fmt(rank.grad_norm_before),
                 _fmt(rank.mean_throughput)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def summarize_markdown(runs: Iterable[Run], report: ParseReport | None = None,
                       progress: Progress | None = None) -> str:
    return "\n".join(markdown(summary) for summary in summarize(runs, report, progress))
