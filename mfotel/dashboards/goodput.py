"""Goodput across restarts: a run's time account (mfotel/alerting/goodput.py's records) as a row
of the training overview, and its attempts as annotations.

Every query reads the records per `job_name` and `run_id`, filtered by `$run_id` itself: a
run's account goes on through the downtime between its attempts, when no rank reports.
"""
from __future__ import annotations

from typing import TypedDict

from ..alerting import goodput as records
from ..alerting.thresholds import RulesConfig
from .common import NEUTRAL, RUN_MATCHER, Annotation, Panel, PanelKind, Row, Target, sel

#: Legend of a per-run series.
RUN = "{{job_name}} {{run_id}}"
#: The categories of the run's account, bottom to top of a stack, with their colours.
COLORS: tuple[tuple[str, str], ...] = (
    ("goodput", "green"), ("recomputed", "dark-red"), ("startup", "blue"), ("input", "yellow"),
    ("checkpoint", "purple"), ("evaluation", "light-blue"), ("stall", "red"),
    ("downtime", "orange"), (records.UNACCOUNTED, "#8F8F8F"))
assert [name for name, _ in COLORS] == [*records.CATEGORIES, records.UNACCOUNTED]
#: The shipped floor of MindFormersGoodputLow (`--set goodput_floor_ratio=...` moves the
#: alert's, not this colour).
FLOOR = RulesConfig().goodput_floor_ratio


def run_sel(record: str, *matchers: str) -> str:
    """`record{job_name=~"$job_name", run_id=~"$run_id", *matchers}`."""
    return sel(record, RUN_MATCHER, *matchers, rank=False)


def _goodput(record: str) -> str:
    share = run_sel(record, 'category="goodput"')
    return f"max without (category) ({share})"


def _target(expr: str, legend: str) -> Target:
    # the records carry run_id: cut by it, not by the ranks' lifetime (none in a downtime)
    return Target(expr, legend, run_scoped=False)


def share_of_wall(category: str) -> str:
    """The category's share of the selected runs' wall clocks (the shares add up to 1)."""
    total = run_sel(records.CATEGORY_TOTAL, f'category="{category}"')
    wall = run_sel(records.WALL)
    return f"sum by (category) ({total})\n/ on () group_left () (sum ({wall}) > 0)"


def per_minute(category: str) -> str:
    """The category's seconds in each evaluation of the records, over the selected runs."""
    increase = run_sel(records.CATEGORY_INCREASE, f'category="{category}"')
    return f"sum by (category) ({increase})"


class _Shape(TypedDict):
    """Keyword arguments shared by the row's stat panels."""
    kind: PanelKind
    height: int
    width: int


_STAT: _Shape = {"kind": "stat", "height": 5, "width": 4}

ROW = Row("Goodput across restarts", (
    Panel("Goodput, last hour", "percentunit",
          (_target(_goodput(records.SHARE_WINDOW), RUN),), min=0, max=1,
          thresholds=((None, "red"), (FLOOR, "green")),
          description="Share of the run's accounted time of the last hour spent on steps that "
                      "count (each global step once). Red below MindFormersGoodputLow's "
                      f"shipped floor ({FLOOR:.0%}).", **_STAT),
    Panel("Goodput over the run", "percentunit",
          (_target(_goodput(records.SHARE_RUN), RUN),), min=0, max=1,
          thresholds=((None, "red"), (FLOOR, "green")),
          description="Time of the steps that count over the run's wall clock, from its first "
                      "process start, across every attempt with the same run_id.",
          **_STAT),
    Panel("Attempts in range", "none", (_target(
        f"round(sum by (job_name, run_id) "
        f"(sum_over_time({run_sel(records.ATTEMPTS)}[$__range])), 0.01)", RUN),),
        thresholds=((None, "green"), (2, "orange")),
        description="Attempts of the run (its ranks' processes started anew) in the time "
                    "range shown: 2 and more are restarts. Marked on the panels.",
        **_STAT),
    Panel("Recomputed steps", "none",
          (_target(run_sel(records.RECOMPUTED_TOTAL), RUN),),
          thresholds=((None, "green"), (1, "orange")),
          description="Steps done again after an attempt resumed from an older checkpoint, over "
                      "the run's life (each rank's, averaged).", **_STAT),
    Panel("Downtime between attempts", "s", (_target(
        run_sel(records.CATEGORY_TOTAL, 'category="downtime"'), RUN),),
        thresholds=NEUTRAL,
        description="From the last event of each attempt to the start of the next one's "
                    "processes, over the run's life.", **_STAT),
    Panel("Run wall clock", "s", (_target(run_sel(records.WALL), RUN),), thresholds=NEUTRAL,
          description="From the run's first process start to now while a rank runs, else to "
                      "its last event: what the account divides.",
          **_STAT),
    Panel("Goodput over time", "percentunit", (
        _target(_goodput(records.SHARE_RUN), f"{RUN} since the run's start"),
        _target(_goodput(records.SHARE_WINDOW), f"{RUN} last hour"),
    ), min=0, max=1,
        description="The run's goodput since its first start and over the last hour, as the "
                    "records had it at each time."),
    Panel("Where the run's time went", "percentunit",
          tuple(_target(share_of_wall(name), name) for name, _ in COLORS),
          stacked=True, colors=COLORS, min=0, max=1,
          description="Each category's share of the selected runs' wall clock, stacked "
                      "(goodput at the bottom, adding up to 100%): start-up, waiting for input, "
                      "checkpoint saves, evaluation, stalls, downtime between attempts, steps "
                      "recomputed after a resume, and what no event accounts for yet "
                      "(unaccounted: a step in progress, a hang)."),
    Panel("Time per minute by category", "s",
          tuple(_target(per_minute(name), name) for name, _ in COLORS[:-1]),
          draw="bars", stacked=True, colors=COLORS[:-1], width=24,
          min_interval=records.INTERVAL,
          description="Seconds of each category in each minute the records account (one "
                      "rank's time, the run's ranks averaged; summed over the selected runs): "
                      "a bar of 60 s per run while it lives. A step's time, a stall's and a "
                      "downtime's count in the minute they end (a downtime in the minute the "
                      "next attempt shows up). In a minute a rank is first scraped after the "
                      "others, the mean takes it in: the categories so far are averaged anew "
                      "(a bar below zero), so the bars still add up to the run's account."),
))

ANNOTATIONS = (
    # the run's earliest process start, in ms: a new value when every rank started anew
    Annotation("Attempts", f"{run_sel(records.ATTEMPT_START)} * 1000", "blue",
               "Attempt of run {{run_id}} started",
               "{{job_name}}: its processes' first start (an attempt after the first is a "
               "restart)", tag_keys="job_name,run_id", value_is_time=True),
    Annotation("Restart without progress", f"{run_sel(records.RESTARTS_NO_PROGRESS)} > 0",
               "red", "Restart without progress: run {{run_id}}",
               "{{job_name}}: the attempt resumed from no later a step than the one before",
               tag_keys="job_name,run_id"),
)
