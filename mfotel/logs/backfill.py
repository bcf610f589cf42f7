"""Write logged runs as OpenMetrics for `promtool tsdb create-blocks-from openmetrics`.

Names, label keys and histogram buckets are those of the live exposition (mfotel.contract),
so a past run lands in the same dashboards as a live one:

    mindformers_train_loss{job_name="exp1",rank="0"} 2.345 1764671400.123

As live, the loss and the gradient norm are written as they are (`NaN`, `+Inf`, `-Inf`), beside
`loss_finite` (0 for such a loss) and `nonfinite_total{metric}`; the other gauges (learning
rate, throughput, ...) repeat their last finite value, as the live ones do. Counters count
logged steps (live ones count every step); `steps_total` is the logged step (steps completed
assuming the run started at step 0). Timestamps are the row's time, else
`start + step * step_seconds`.

The job_name label is the one the lines carry (mfotel's JSON lines name their job), so backfilled
history joins the live series of the same job; lines that carry none (text lines, info.log)
take the job name of their run's JSON lines, else the run's name; `job_names` forces one per
run (`--job-name`). `BackfillStats.job_names` says which it was for each run.

A (job_name, rank) logged by several sources (mfotel's monitor file and mindformers' info.log
of the same run) is backfilled from one of them, the first of `parse.SOURCES` present, because
the live series hold one value per step; the others are reported in `BackfillStats.left_out`.

    stats = write_openmetrics(rows, Path("out/backfill.om"), job_names={"exp1": "exp1"})
    stats.job_names        # {("exp1", "exp1"): "--job-name"}: (run, job_name) -> where from
    create_blocks(Path("out/backfill.om"), Path("out/data"))   # runs promtool
"""
from __future__ import annotations

import math
import shutil
import subprocess
import tempfile
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from ..contract import CONTRACT, STEP_TIME_BUCKETS, MetricSpec, spec
from .parse import MAX_TIME, SOURCES, Row

# Contract keys written from a row, in output order (the contract's order).
_ROW_GAUGES = {"loss": "loss", "learning_rate": "learning_rate", "grad_norm": "grad_norm",
               "throughput": "throughput", "loss_scale": "loss_scale", "epoch": "epoch"}
_NONFINITE_METRICS = ("loss", "grad_norm")   # as mfotel.instruments.NONFINITE_METRICS
#: Gauges written as they are, NaN/Inf included (as the live /metrics exposes them).
_AS_IS = frozenset(_NONFINITE_METRICS)
_BUCKET_LABELS = tuple(repr(float(bound)) for bound in STEP_TIME_BUCKETS) + ("+Inf",)


_Series = tuple[str, int, str]     # (job_name, rank, source)
# where a run's job_name label came from (BackfillStats.job_names)
JOB_FROM_OPTION, JOB_FROM_LINES, JOB_FROM_RUN = "--job-name", "the lines' job_name", "run name"


class BackfillError(ValueError):
    """The rows cannot be placed in time (no timestamp and no start given, or a time outside
    1970..9999)."""


@dataclass
class BackfillStats:
    """What was written: counts over the chosen source of each (job_name, rank)."""
    rows: int = 0
    samples: int = 0
    skipped_out_of_order: int = 0
    series: set[tuple[str, int]] = field(default_factory=set)
    min_time: float | None = None
    max_time: float | None = None
    sources: dict[tuple[str, int], str] = field(default_factory=dict)
    # (job_name, rank, source, rows) of the sources not written
    left_out: list[tuple[str, int, str, int]] = field(default_factory=list)
    # (run, job_name) -> JOB_FROM_*: where each run's job_name label came from
    job_names: dict[tuple[str, str], str] = field(default_factory=dict)

    def _merge(self, state: _SeriesState) -> None:
        self.rows += state.rows
        self.samples += state.samples
        self.skipped_out_of_order += state.skipped_out_of_order
        times = [t for t in (self.min_time, self.max_time, state.min_time, state.max_time)
                 if t is not None]
        if times:
            self.min_time, self.max_time = min(times), max(times)


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _value(value: float) -> str:
    if math.isfinite(value):
        return repr(float(value))
    return "NaN" if math.isnan(value) else ("+Inf" if value > 0 else "-Inf")


@dataclass
class _SeriesState:
    """Cumulative values of one (job_name, rank, source): counters, the step-time histogram,
    and what was written."""
    rows: int = 0
    samples: int = 0
    skipped_out_of_order: int = 0
    min_time: float | None = None
    max_time: float | None = None
    last_ms: int | None = None
    last_finite: dict[str, float] = field(default_factory=dict)
    nonfinite: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_NONFINITE_METRICS, 0))
    overflow: int = 0
    first_nonfinite_step: int | None = None
    buckets: list[int] = field(default_factory=lambda: [0] * (len(STEP_TIME_BUCKETS) + 1))
    duration_sum: float = 0.0


class OpenMetricsWriter:
    """Streams rows into one temporary file per (metric family, label set), then concatenates
    them into `path` with `# EOF`: OpenMetrics wants a family's samples together and, within
    it, each label set's samples together, while a log may interleave ranks."""

    MAX_OPEN = 128      # temporary files kept open at once (least recently used are closed)

    def __init__(self, path: Path, start: float | None = None, step_seconds: float = 1.0) -> None:
        self.path = Path(path)
        self.start = start
        self.step_seconds = step_seconds
        self._tmp = Path(tempfile.mkdtemp(prefix=".backfill-", dir=self.path.parent))
        # (family key, label set, (job_name, rank, source)) -> file
        self._parts: dict[tuple[str, str, _Series], Path] = {}
        self._open: OrderedDict[tuple[str, str, _Series], IO[str]] = OrderedDict()
        self._series: dict[tuple[str, int, str], _SeriesState] = {}

    # -- placing a row in time
    def timestamp_ms(self, row: Row) -> int:
        if row.time is not None:
            seconds = row.time
        elif self.start is None:
            raise BackfillError(
                f"{row.path}:{row.line}: step {row.step} has no timestamp (text lines of older "
                f"mfotel versions carry none); pass --start (unix seconds or ISO 8601) and "
                f"--step-seconds")
        else:
            seconds = self.start + row.step * self.step_seconds
        if not (math.isfinite(seconds) and 0.0 <= seconds <= MAX_TIME):
            raise BackfillError(
                f"{row.path}:{row.line}: step {row.step} would be at time {seconds!r}, outside "
                f"the years 1970..9999"
                + ("" if row.time is not None else "; check --start and --step-seconds"))
        return round(seconds * 1000)

    def _out(self, family: str, labels: str, series: _Series) -> IO[str]:
        key = (family, labels, series)
        handle = self._open.get(key)
        if handle is not None:
            self._open.move_to_end(key)
            return handle
        path = self._parts.get(key)
        if path is None:
            path = self._parts[key] = self._tmp / str(len(self._parts))
        if len(self._open) >= self.MAX_OPEN:
            self._open.popitem(last=False)[1].close()
        handle = self._open[key] = open(path, "a", encoding="utf-8")
        return handle

    def add(self, row: Row, job_name: str) -> None:
        ms = self.timestamp_ms(row)
        key = (job_name, row.rank, row.source)
        state = self._series.get(key)
        if state is None:
            state = self._series[key] = _SeriesState()
        if state.last_ms is not None and ms <= state.last_ms:
            # Prometheus rejects out-of-order and duplicate-timestamp samples of a series.
            state.skipped_out_of_order += 1
            return
        state.last_ms = ms
        seconds = ms / 1000.0
        state.rows += 1
        state.min_time = seconds if state.min_time is None else min(state.min_time, seconds)
        state.max_time = seconds if state.max_time is None else max(state.max_time, seconds)
        labels = f'job_name="{_escape_label(job_name)}",rank="{row.rank}"'
        suffix = f" {ms // 1000}.{ms % 1000:03d}\n"
        samples: list[tuple[str, str, float]] = []   # (family key, labels, value)

        def put(key_: str, value: float, extra: str = "") -> None:
            samples.append((key_, labels + extra, value))

        for attr, contract_key in _ROW_GAUGES.items():
            value = getattr(row, attr)
            if value is None:
                continue
            if math.isfinite(value):
                state.last_finite[attr] = value
            if math.isfinite(value) or attr in _AS_IS:
                put(contract_key, value)
            elif attr in state.last_finite:      # as live: the last finite value stays
                put(contract_key, state.last_finite[attr])
        put("step", row.step)
        put("steps", row.step)
        put("last_step_timestamp", seconds)
        if row.loss is not None:
            put("loss_finite", 1.0 if math.isfinite(row.loss) else 0.0)
        for metric in _NONFINITE_METRICS:
            value = getattr(row, metric)
            if value is not None and not math.isfinite(value):
                state.nonfinite[metric] += 1
            put("nonfinite", state.nonfinite[metric], f',metric="{metric}"')
        loss_nonfinite = row.loss is not None and not math.isfinite(row.loss)
        if loss_nonfinite and state.first_nonfinite_step is None:
            state.first_nonfinite_step = row.step
        if state.first_nonfinite_step is not None:
            put("first_nonfinite_step", state.first_nonfinite_step)
        if row.overflow is not None:
            state.overflow += int(row.overflow)
            put("overflow", state.overflow)
        for key_, label_text, value in samples:
            self._out(key_, label_text, key).write(
                f"{spec(key_).sample_name}{{{label_text}}} {_value(value)}{suffix}")
        state.samples += len(samples)
        if row.step_time is not None and math.isfinite(row.step_time):
            self._histogram(state, labels, key, row.step_time, suffix)

    def _histogram(self, state: _SeriesState, labels: str, series: _Series, seconds: float,
                   suffix: str) -> None:
        for index, bound in enumerate(STEP_TIME_BUCKETS):
            if seconds <= bound:
                state.buckets[index] += 1
                break
        else:
            state.buckets[-1] += 1
        state.duration_sum += seconds
        name = spec("step_duration").prometheus_name
        out = self._out("step_duration", labels, series)
        cumulative = 0
        for le, count in zip(_BUCKET_LABELS, state.buckets, strict=True):
            cumulative += count
            out.write(f'{name}_bucket{{{labels},le="{le}"}} {cumulative}{suffix}')
        out.write(f"{name}_count{{{labels}}} {cumulative}{suffix}")
        out.write(f"{name}_sum{{{labels}}} {_value(state.duration_sum)}{suffix}")
        state.samples += len(_BUCKET_LABELS) + 2

    def _choose_sources(self) -> BackfillStats:
        """The first of SOURCES per (job_name, rank) that has rows; the rest left out."""
        stats = BackfillStats()
        by_series: dict[tuple[str, int], dict[str, _SeriesState]] = {}
        for (job_name, rank, source), state in self._series.items():
            by_series.setdefault((job_name, rank), {})[source] = state
        order = {source: index for index, source in enumerate(SOURCES)}
        for series, states in by_series.items():
            present = sorted((s for s in states if states[s].rows),
                             key=lambda s: (order.get(s, len(order)), s))
            if not present:
                continue
            stats.series.add(series)
            stats.sources[series] = present[0]
            stats._merge(states[present[0]])
            stats.left_out += [(*series, s, states[s].rows) for s in present[1:]]
        return stats

    def close(self) -> BackfillStats:
        """Assemble `path` (HELP/TYPE per family, samples, `# EOF`) from the chosen source of
        each series; remove the temp files."""
        try:
            self._close_handles()
            stats = self._choose_sources()
            with open(self.path, "w", encoding="utf-8") as out:
                for metric_spec in CONTRACT:
                    parts = [path for (family, _, (job_name, rank, source)), path
                             in self._parts.items() if family == metric_spec.key
                             and stats.sources.get((job_name, rank)) == source]
                    if not parts:
                        continue
                    out.write(_header(metric_spec))
                    for part in parts:
                        with open(part, encoding="utf-8") as handle:
                            shutil.copyfileobj(handle, out, 1 << 20)
                out.write("# EOF\n")
        finally:
            self.discard()
        return stats

    def _close_handles(self) -> None:
        while self._open:
            self._open.popitem()[1].close()

    def discard(self) -> None:
        self._close_handles()
        shutil.rmtree(self._tmp, ignore_errors=True)


def _header(metric_spec: MetricSpec) -> str:
    return (f"# HELP {metric_spec.prometheus_name} {_escape_help(metric_spec.description)}\n"
            f"# TYPE {metric_spec.prometheus_name} {metric_spec.kind}\n")


def write_openmetrics(rows: Iterable[Row], path: Path, job_names: Mapping[str, str] | None = None,
                      start: float | None = None, step_seconds: float = 1.0,
                      run_job_names: Mapping[str, str] | None = None) -> BackfillStats:
    """Write `rows` to `path` as OpenMetrics. The job_name label: `job_names[run]` (forced),
    else the row's own job_name, else `run_job_names[run]` (the one its run's lines name,
    see `parse.line_job_names`), else the run's name."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = OpenMetricsWriter(path, start=start, step_seconds=step_seconds)
    forced, of_run = job_names or {}, run_job_names or {}
    origins: dict[tuple[str, str], str] = {}
    try:
        for row in rows:
            if row.run in forced:
                job_name, origin = forced[row.run], JOB_FROM_OPTION
            elif row.job_name:
                job_name, origin = row.job_name, JOB_FROM_LINES
            elif row.run in of_run:
                job_name, origin = of_run[row.run], JOB_FROM_LINES
            else:
                job_name, origin = row.run, JOB_FROM_RUN
            origins.setdefault((row.run, job_name), origin)
            writer.add(row, job_name)
    except BaseException:
        writer.discard()
        raise
    stats = writer.close()
    written = {job_name for job_name, _ in stats.series}
    stats.job_names = {key: origin for key, origin in origins.items() if key[1] in written}
    return stats


def find_promtool() -> str | None:
    from ..localstack.servers import find_binary
    return find_binary(("promtool",))


def create_blocks(openmetrics_path: Path, data_dir: Path, promtool: str | None = None,
                  timeout: float = 600.0) -> str:
    """Run `promtool tsdb create-blocks-from openmetrics FILE DIR`; its output, or raise."""
    promtool = promtool or find_promtool()
    if promtool is None:
        raise FileNotFoundError("promtool not found on PATH; install it: "
                                "apt-get install prometheus")
    data_dir.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        [promtool, "tsdb", "create-blocks-from", "openmetrics", str(openmetrics_path),
         str(data_dir)], capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"promtool failed ({result.returncode}):\n{result.stderr[-3000:]}"
                           f"{result.stdout[-2000:]}")
    return result.stdout + result.stderr
