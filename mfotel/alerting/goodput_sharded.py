"""Goodput on the sharded topology (docs/scaling.md, section 7): each shard accounts its own
ranks, the global ruler combines the shards' accounts.

The goodput records (mfotel.alerting.goodput) are a chain: each reads records of the same
evaluation. A ruler that writes its records to a remote store (vmalert) reads them a flush
later, after its whole group has run, so the chain cannot run there. It runs on every shard
instead, over the ranks that shard scrapes (a Prometheus reads its own records at once), its
records named with the prefix `shard_` and carrying the shard's external label. The global
part reads only the shards' latest records, never its own of the same evaluation:

- the run's time account, wall clock and steps redone: the shards' means weighted by the
  ranks each holds (`RANKS`), so they are the mean over the run's ranks, as one Prometheus
  records them, read as the shards recorded them `count_late` intervals ago (a shard's
  records land one by one: a round read at once may be half of it), `unaccounted` the wall
  clock less the categories as read; the high-water mark is each shard's own (its ranks'
  lowest step), which differs from the run's by the ranks' spread of a step or so;
- the attempts and the restarts without progress: the most any shard counted over the run
  window (every shard holding ranks of an attempt counts it, maybe a minute apart), its growth
  from three intervals ago to two (at least 30 s ago: `count_late`): a shard's sample counts
  once, whichever shard shows it first, if it reached the store within that. (Not against the global
  part's own record of the evaluation before: the store serves a new series 8-10 s after it
  lands, so that record was missing at the next evaluation and the first attempt counted
  twice);
- the run's first process start, the latest attempt's start: the earliest of the shards'; the
  step resumed after: the highest;
- the per-minute account: the weighted totals' growth over the interval before last.

The shards' records come once a minute and the store forgets a series a few scrapes after its
last sample, so everything here reads them over two of the group's intervals (`fresh`). The
goodput alerts of the global part read the global records the same way.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from . import goodput as g
from .promql import indent
from .thresholds import RulesConfig, duration_seconds

#: The prefix of a shard's goodput records.
PREFIX = "shard_"
#: The run's ranks on the shard: the most it read at once (its weight in the run's means).
RANKS = g.RANKS
#: Over the run window, each shard's count (recorded on the shard), then the most of them.
ATTEMPTS_TOTAL = "job_name_run_id:mindformers_train_attempts:total"
RESTARTS_NO_PROGRESS_TOTAL = "job_name_run_id:mindformers_train_restarts_without_progress:total"
#: The unsharded records that only the shares read: the shards leave them to the global part.
SHARES = (g.SHARE_RUN, g.SHARE_WINDOW, g.JOB_GOODPUT)
RUN_SHARD = f"{g.RUN}, shard"
GOODPUT = 'category="goodput"'


def shard(name: str) -> str:
    return PREFIX + name


def _fresh_window() -> str:
    return f"{2 * duration_seconds(g.INTERVAL):g}s"


def fresh(name: str, *matchers: str, ago: int = 0, window: str | None = None) -> str:
    """A record's latest value within two of the goodput group's intervals (or `window`); as
    it was `ago` intervals ago."""
    selector = name + (f"{{{', '.join(matchers)}}}" if matchers else "")
    offset = f" offset {ago * duration_seconds(g.INTERVAL):g}s" if ago else ""
    return f"last_over_time({selector}[{window or _fresh_window()}]{offset})"


def _renamed(text: str, names: list[str]) -> str:
    pattern = re.compile(r"(?<![\w:])(" + "|".join(map(re.escape, names)) + r")(?![\w:])")
    return pattern.sub(lambda m: shard(m.group(1)), text)


def shard_goodput_records(cfg: RulesConfig) -> list[dict[str, Any]]:
    """The goodput chain over one shard's ranks, every record `shard_`-prefixed, with the
    shard's weight and its counts over the run window; without the shares (global only)."""
    chain = [r for r in g.goodput_records(cfg) if r["record"] not in SHARES]
    names = sorted({r["record"] for r in chain} | {ATTEMPTS_TOTAL, RESTARTS_NO_PROGRESS_TOTAL},
                   key=len, reverse=True)
    w = cfg.goodput_run_window
    extra = [
        {"record": ATTEMPTS_TOTAL, "expr": f"sum_over_time({g.ATTEMPTS}[{w}])"},
        {"record": RESTARTS_NO_PROGRESS_TOTAL,
         "expr": f"sum_over_time({g.RESTARTS_NO_PROGRESS}[{w}])"},
    ]
    return [{**r, "record": shard(r["record"]), "expr": _renamed(r["expr"], names)}
            for r in [*chain, *extra]]


def _weighted_sum(name: str, by: str = g.RUN, *matchers: str, ago: int = 0) -> str:
    """The sum over shards of a shard record times the shard's ranks of the run."""
    return (f"sum by ({by}) (\n  {fresh(shard(name), *matchers, ago=ago)}\n"
            f"  * on ({RUN_SHARD}) group_left ()\n  {fresh(shard(RANKS), ago=ago)}\n)")


def _weight(name: str, *matchers: str, ago: int = 0) -> str:
    """The run's ranks over the shards that hold a record `name`."""
    return (f"sum by ({g.RUN}) (\n  {fresh(shard(RANKS), ago=ago)}\n  and on ({RUN_SHARD})\n"
            f"  {fresh(shard(name), *matchers, ago=ago)}\n)")


def _mean(name: str, by: str = g.RUN, *matchers: str, ago: int = 0) -> str:
    """A shard record's mean over the run's ranks."""
    return (f"{_weighted_sum(name, by, *matchers, ago=ago)}\n/ on ({g.RUN}) group_left ()\n"
            f"{_weight(name, *matchers, ago=ago)}")


def _most(name: str, ago: int = 0, window: str | None = None) -> str:
    return f"max by ({g.RUN}) ({fresh(shard(name), ago=ago, window=window)})"


def _increase(total: Callable[[int], str], on: str, late: int = 1) -> str:
    """The growth of `total` (an expression of how many intervals ago) from `late` + 1 to
    `late` intervals ago, all of it the first time: a sample counts exactly once, whichever
    evaluation sees it first, if it reached the store within `late` intervals of its time (one
    that comes later falls between two reads and is never counted). (The counts read back
    over the run window: a shard's gap of minutes is no new run.)"""
    return (f"clamp_min(\n{indent(total(late))}\n  - on ({on})\n{indent(total(late + 1))},\n"
            f"  0\n)\nor\n{total(late)}")


#: How late the global part counts attempts and restarts, and reads the run's totals (the
#: same rounds: an attempt and its downtime show together): a shard's sample that reaches the
#: store (and is served: a new series 8-10 s after it is written, later on a loaded store) up
#: to two goodput intervals, and at least LATE_SECONDS, after its time still counts. (At the
#: tests' 5 s interval two intervals were not enough: a run's first attempt, a new series
#: served 23 s late, was never counted.)
COUNT_LATE, LATE_SECONDS = 2, 30.0


def count_late() -> int:
    """The goodput intervals the global part counts late (COUNT_LATE, LATE_SECONDS)."""
    return max(COUNT_LATE, math.ceil(LATE_SECONDS / duration_seconds(g.INTERVAL)))


def _window_sum(by: str, *matchers: str) -> str:
    """Over the last WINDOW, the shards' per-minute accounts summed, each times its ranks."""
    selector = shard(g.CATEGORY_INCREASE) + (f"{{{', '.join(matchers)}}}" if matchers else "")
    return (f"sum by ({by}) (\n  sum_over_time({selector}[{g.WINDOW}])\n"
            f"  * on ({RUN_SHARD}) group_left ()\n  last_over_time({shard(RANKS)}[{g.WINDOW}])\n)")


def global_goodput_records(cfg: RulesConfig) -> list[dict[str, Any]]:
    """The run's account from the shards' (module docstring), under the unsharded names."""
    by_category = f"{g.RUN}, category"
    accounted = f'category!="{g.UNACCOUNTED}"'
    run = cfg.goodput_run_window
    # the shards' rounds of count_late() intervals ago, whole (a shard's records reach the
    # store one by one: its wall clock of one round beside its categories of the round before
    # left them 7/8 x 5 s short of it); unaccounted the wall clock less the categories as read
    late = count_late()
    totals = _mean(g.CATEGORY_TOTAL, by_category, accounted, ago=late)
    wall = _mean(g.WALL, ago=late)
    unaccounted = f"(\n{indent(wall)}\n)\n- on ({g.RUN})\nsum by ({g.RUN}) (\n{indent(totals)}\n)"
    return [
        {"record": g.PROCESS_START, "expr": f"min by ({g.RUN}) ({fresh(shard(g.PROCESS_START))})"},
        {"record": g.ATTEMPT_START, "expr": f"min by ({g.RUN}) ({fresh(shard(g.ATTEMPT_START))})"},
        {"record": g.RESUME_STEP, "expr": _most(g.RESUME_STEP)},
        {"record": g.ATTEMPTS,
         "expr": _increase(lambda ago: _most(ATTEMPTS_TOTAL, ago, run), g.RUN, count_late())},
        {"record": g.RESTARTS_NO_PROGRESS,
         "expr": _increase(lambda ago: _most(RESTARTS_NO_PROGRESS_TOTAL, ago, run), g.RUN,
                           count_late())},
        {"record": g.CATEGORY_TOTAL, "expr": totals},
        {"record": g.WALL, "expr": wall},
        {"record": g.CATEGORY_TOTAL, "expr": unaccounted,
         "labels": {"category": g.UNACCOUNTED}},
        {"record": g.RECOMPUTED_TOTAL, "expr": _mean(g.RECOMPUTED_TOTAL, ago=late)},
        # the account's growth over the interval before last (the unaccounted time aside)
        {"record": g.CATEGORY_INCREASE,
         "expr": _increase(lambda ago: _mean(g.CATEGORY_TOTAL, by_category, accounted,
                                             ago=ago), by_category)},
        {"record": g.SHARE_RUN,
         "expr": f"(\n{indent(totals)}\n  or\n  label_replace(\n{indent(unaccounted, '    ')}"
                 f',\n    "category", "{g.UNACCOUNTED}", "", ""\n  )\n)\n'
                 f"/ on ({g.RUN}) group_left ()\n(\n{indent(wall)}\n  > 0\n)"},
        {"record": g.SHARE_WINDOW,
         "expr": f"{_window_sum(by_category)}\n/ on ({g.RUN}) group_left ()\n"
                 f"({_window_sum(g.RUN)} > 0)"},
        {"record": g.JOB_GOODPUT,
         "expr": f"{_window_sum('job_name', GOODPUT)}\n/\n({_window_sum('job_name')} > 0)"},
    ]


#: The global records the goodput alerts read at an instant: read over FRESH instead.
_INSTANT = re.compile("(" + re.escape(g.SHARE_WINDOW) + r"\{[^}]*\})")


def global_goodput_alerts(cfg: RulesConfig) -> list[dict[str, Any]]:
    """The goodput alerts over the global records (written once a minute: read the latest)."""
    def latest(text: str) -> str:
        return _INSTANT.sub(lambda m: f"last_over_time({m.group(1)}[{_fresh_window()}])", text)
    return [{**rule, "expr": latest(rule["expr"]),
             "annotations": {k: latest(v) for k, v in rule["annotations"].items()}}
            for rule in g.goodput_alerts(cfg)]
