"""The vocabulary of the dashboard modules: targets, panels, rows, and the PromQL helpers
that keep a panel readable from 1 rank to thousands.

Panel modules (`overview.py`, `cluster.py`, `params.py`) only declare `Row`s of `Panel`s of
`Target`s; `render.py` turns them into Grafana JSON.

    Row("Loss", (Panel("Loss", "none", rank_lines(sel("mindformers_train_loss"))),))
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..contract import STATUS_FAILED, finite_samples

PanelKind = Literal["timeseries", "stat", "bargauge", "table", "state-timeline"]
#: How a time series panel draws its series: lines, or bars (one per query step).
DrawStyle = Literal["line", "bars"]
#: How a time series target is drawn: a value line, red bars marking NaN/Inf steps, or the
#: global step, shown in the tooltip only (the x axis is time; the tooltip says which step).
TargetRole = Literal["value", "nonfinite", "step"]
#: A threshold step: (from value, colour); the first step's value is None (-Infinity).
Step = tuple[float | None, str]

#: Every dashboard carries this tag; the dashboards link to each other through it.
TAG = "mfotel"
#: The metric the `$job_name`/`$rank` variables read their values from (always on).
VARIABLE_SOURCE = "mindformers_train_step"
#: The metric whose labels the `$run_id` variable lists (run_id with `run` configured).
RUN_SOURCE = "mindformers_train_rank_info"

#: Legend of a per-rank series.
RANK = "{{job_name}} rank {{rank}}"
#: Legend of a per-job series.
JOB = "{{job_name}}"

JOB_MATCHER = 'job_name=~"$job_name"'
RANK_MATCHER = 'rank=~"$rank"'
RUN_MATCHER = 'run_id=~"$run_id"'

#: Up to this many selected ranks of a job, panels draw one line per rank; above it, the
#: minimum, median and maximum over the ranks (pick ranks with `$rank` to see their lines).
MAX_RANK_LINES = 16

#: Colours of a single, neutral number (no good or bad value).
NEUTRAL: tuple[Step, ...] = ((None, "blue"),)


def sel(metric: str, *matchers: str, rank: bool = True) -> str:
    """`metric{job_name=~"$job_name", rank=~"$rank", *matchers}`: the dashboard filter.

    `rank=False` for series that carry no rank label (job-level recording rules).
    """
    parts = [JOB_MATCHER, *([RANK_MATCHER] if rank else []), *matchers]
    return f"{metric}{{{', '.join(parts)}}}"


# ---- PromQL that scales with the number of ranks ----------------------------------------

_RANKS_SELECTED = f"count by (job_name) ({sel(VARIABLE_SOURCE)})"
#: Each job's lifetime within the selected run(s); `in_run()` keeps data inside it.
_RUN_ALIVE = f"max by (job_name) ({sel(RUN_SOURCE, RUN_MATCHER, rank=False)})"


def rank_count_gate(op: str, limit: int = MAX_RANK_LINES) -> str:
    """Jobs whose number of selected ranks is `op` (`<=` or `>`) `limit`."""
    return f"({_RANKS_SELECTED} {op} {limit})"


def per_rank(expr: str) -> str:
    """`expr` for jobs with at most MAX_RANK_LINES ranks selected."""
    return f"({expr}) and on (job_name) {rank_count_gate('<=')}"


def over_ranks(expr: str) -> str:
    """`expr` for jobs with more ranks selected than MAX_RANK_LINES."""
    return f"({expr}) and on (job_name) {rank_count_gate('>')}"


def in_run(expr: str) -> str:
    """`expr` (which keeps `job_name`) at the times a rank of the selected `$run_id` reported.

    Series carry no run_id; mindformers_train_rank_info does, so a run is its lifetime."""
    return f"({expr}) and on (job_name) {_RUN_ALIVE}"


#: (aggregation over ranks with `{}` for the per-rank expression, legend) of `rank_lines`.
SPREAD = (("min by (job_name) ({})", "{{job_name}} min over ranks"),
          ("quantile by (job_name) (0.5, {})", "{{job_name}} median over ranks"),
          ("max by (job_name) ({})", "{{job_name}} max over ranks"))
TOTAL = (("sum by (job_name) ({})", "{{job_name}} all ranks"),)


def rank_lines(expr: str, legend: str = RANK,
               many: tuple[tuple[str, str], ...] = SPREAD) -> tuple[Target, ...]:
    """One line per rank while few ranks are selected; `many` (min/median/max by default)
    over the ranks otherwise. `expr` must keep the `job_name` and `rank` labels."""
    return (Target(per_rank(expr), legend),
            *(Target(over_ranks(aggregate.format(expr)), name) for aggregate, name in many))


def nonfinite_bars(condition: str, what: str) -> tuple[Target, ...]:
    """Red bars over the time where `condition` (per rank) holds: which ranks while few are
    selected, how many otherwise."""
    return (Target(per_rank(f"count by (job_name, rank) ({condition})"),
                   f"{RANK}: {what} NaN/Inf", role="nonfinite"),
            Target(over_ranks(f"count by (job_name) ({condition})"),
                   f"{JOB}: ranks with {what} NaN/Inf", role="nonfinite"))


# ---- when the loss and the grad norm are not finite --------------------------------------

# /metrics exposes the loss and the grad norm as they are (NaN, +Inf, -Inf), which a line
# cannot draw and an average cannot hold; an OTLP push (the SDK drops NaN/Inf) keeps the last
# finite value instead. These conditions say, per rank, when the value is not a finite loss
# of now, either way: the last loss was not finite, or one was within the rate window (the
# alert's test).
_RATE_WINDOW = "[$__rate_interval]"
_NONFINITE_LOSS_STEPS = sel("mindformers_train_nonfinite_total", 'metric="loss"')
_NONFINITE_GRAD_STEPS = sel("mindformers_train_nonfinite_total", 'metric="grad_norm"')
LOSS_NONFINITE = (f"max by (job_name, rank) ({sel('mindformers_train_loss_finite')} == 0) or "
                  f"max by (job_name, rank) (increase({_NONFINITE_LOSS_STEPS}{_RATE_WINDOW}) > 0)")
GRAD_NORM_NONFINITE = (f"max by (job_name, rank) "
                       f"(increase({_NONFINITE_GRAD_STEPS}{_RATE_WINDOW}) > 0)")
#: The loss and grad norm where they are finite: no line, no value where they are NaN/Inf.
FINITE_LOSS = (f"{finite_samples(sel('mindformers_train_loss'))} "
               f"unless on (job_name, rank) ({LOSS_NONFINITE})")
FINITE_GRAD_NORM = (f"{finite_samples(sel('mindformers_train_grad_norm'))} "
                    f"unless on (job_name, rank) ({GRAD_NORM_NONFINITE})")


# ---- definitions ------------------------------------------------------------------------

@dataclass(frozen=True)
class ValueText:
    """Show `text` (in `color`) instead of the number `value` (states, flags)."""

    value: int
    text: str
    color: str


@dataclass(frozen=True)
class Target:
    """One PromQL query of a panel. `instant` for tables and rankings (current value only);
    in a table, `column` names its value column, `unit` and `value_texts` apply there.
    `run_scoped` targets are cut to the selected run (their result must keep `job_name`)."""

    expr: str
    legend: str = ""
    instant: bool = False
    column: str = ""
    unit: str = ""
    value_texts: tuple[ValueText, ...] = ()
    role: TargetRole = "value"
    run_scoped: bool = True


#: The job's global step, in the tooltip of step-based panels.
STEP = Target(f"max by (job_name) ({sel('mindformers_train_step')})", "{{job_name}} step",
              role="step")

#: mindformers_train_status values (contract); the job's worst of them is `worst_status`.
STATUS_TEXTS = (
    ValueText(0, "initialising", "blue"),
    ValueText(1, "running", "green"),
    ValueText(2, "completed", "purple"),
    ValueText(3, "failed / stopped", "red"),
    ValueText(4, "cancelled", "orange"),
)


def worst_status(selector: str) -> str:
    """The job's worst status over its ranks: failed (3) beats everything, then the highest
    value (cancelled 4 > completed 2 > running 1 > initialising 0); a plain `max` would let a
    cancelled rank hide a failed one."""
    return (f"(max by (job_name) ({selector} == {STATUS_FAILED}) "
            f"or max by (job_name) ({selector}))")
#: mindformers_train_loss_finite values.
FINITE_TEXTS = (ValueText(0, "NaN / Inf", "red"), ValueText(1, "finite", "green"))
#: job_name_rank:mindformers_train_in_step:bool values.
IN_STEP_TEXTS = (ValueText(0, "between steps", "orange"), ValueText(1, "in step", "green"))


@dataclass(frozen=True)
class Panel:
    """A panel: title, Grafana unit id, queries. `needs` names what must run for it to have
    data beyond the core callback (shown in the panel description). Stat panels declare
    their `thresholds` (colours from a value on); `log_scale` for values spanning decades."""

    title: str
    unit: str
    targets: tuple[Target, ...]
    kind: PanelKind = "timeseries"
    description: str = ""
    width: int = 12
    height: int = 8
    min: float | None = None
    max: float | None = None
    decimals: int | None = None
    value_texts: tuple[ValueText, ...] = ()
    thresholds: tuple[Step, ...] = ()
    log_scale: bool = False
    needs: str = ""
    draw: DrawStyle = "line"
    stacked: bool = False
    #: (series display name, colour): a fixed colour per series (categories of an account).
    colors: tuple[tuple[str, str], ...] = ()
    #: The query step's floor (Grafana's "min interval"): a record's own interval, e.g. "1m".
    min_interval: str = ""

    def __post_init__(self) -> None:
        def fail(why: str) -> None:
            raise ValueError(f"panel {self.title!r}: {why}")
        if not self.unit:
            fail("every panel needs a unit")
        if not self.targets:
            fail("no targets")
        if not 1 <= self.width <= 24:
            fail(f"width {self.width} outside 1..24")
        for target in self.targets:
            if (target.unit or target.value_texts) and not target.column:
                fail("a column unit or value text needs a column name")
        if (self.draw != "line" or self.stacked) and self.kind != "timeseries":
            fail("bars and stacking are for time series panels")
        if self.kind == "stat" and not self.thresholds:
            fail("a stat panel needs thresholds (NEUTRAL for a number without good or bad)")
        steps = [value for value, _ in self.thresholds[1:]]
        values = [value for value in steps if value is not None]
        if self.thresholds and (self.thresholds[0][0] is not None or len(values) < len(steps)
                                or values != sorted(set(values))):
            fail("thresholds start with (None, colour), then rise")


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...]


@dataclass(frozen=True)
class Annotation:
    """Marks on every time series panel where `expr` returns a value (Prometheus annotation)."""

    name: str
    expr: str
    color: str
    title: str
    text: str = ""
    tag_keys: str = "job_name,rank"
    #: The mark's time is the series' value in milliseconds (an event's own time, e.g. a
    #: process start), not the time the value was seen at; a repeated value is one mark.
    value_is_time: bool = False


#: Firing MindFormers* alerts of the selected jobs, as marks on every dashboard.
ALERTS_ANNOTATION = Annotation(
    "MindFormers alerts",
    f'ALERTS{{alertname=~"MindFormers.*", alertstate="firing", {JOB_MATCHER}}}', "purple",
    "{{alertname}}", "{{severity}}: {{job_name}} {{rank}}", tag_keys="alertname,severity")


@dataclass(frozen=True)
class DashboardSpec:
    uid: str
    title: str
    rows: tuple[Row, ...]
    description: str = ""
    annotations: tuple[Annotation, ...] = ()
    tags: tuple[str, ...] = ()
    refresh: str = "30s"
    time_from: str = "now-3h"

    @property
    def filename(self) -> str:
        return f"{self.uid}.json"
