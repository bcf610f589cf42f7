"""PromQL and rule text shared by the rule modules (rules.py, cascade.py).

    alert(cfg, "MindFormersX", expr, "5m", "warning", "Summary.", f"{WHO} did ...")
    running_lately(cfg)   # ranks whose last reported status is running
"""
from __future__ import annotations

from typing import Any

from ..contract import STATUS_CANCELLED, STATUS_COMPLETED, STATUS_RUNNING
from .thresholds import RulesConfig


def in_step(cfg: RulesConfig) -> str:
    """1 while a rank is inside a step (it began after the last step ended), else 0."""
    m = cfg.m
    return (f"max by (job_name, rank) ({m('mindformers_train_step_begin_timestamp_seconds')})\n"
            f"> bool on (job_name, rank)\n"
            f"max by (job_name, rank) ({m('mindformers_train_last_step_timestamp_seconds')})")


def ended_as_asked(cfg: RulesConfig) -> str:
    """Ranks whose own last status says they completed or were cancelled."""
    last = f"last_over_time({cfg.m('mindformers_train_status')}[{cfg.rank_down_lookback}])"
    return f"({last} == {STATUS_COMPLETED} or {last} == {STATUS_CANCELLED})"


def alert(cfg: RulesConfig, name: str, expr: str, for_: str, severity: str, summary: str,
           description: str) -> dict[str, Any]:
    rule: dict[str, Any] = {"alert": name, "expr": expr}
    if for_ not in ("0", "0s", "0m"):
        rule["for"] = for_
    rule["labels"] = {"severity": severity}
    rule["annotations"] = {"summary": summary, "description": description,
                           "runbook_url": cfg.runbook_url(name)}
    return rule


WHO = "job {{ $labels.job_name }} rank {{ $labels.rank }}"
#: The node agent's states of a rank whose process lives (mfotel.node.metrics).
ALIVE = 'state=~"running|stopped"'
ENDED = 'state=~"zombie|exited"'
#: Exit causes that page: the rank ended on its own, not as asked.
FAILED_CAUSES = 'cause=~"exit_code|signal|oom|unknown"'
JOB = "job {{ $labels.job_name }}"


def query_value(expr_format: str, *labels: str) -> str:
    """Template text printing the value of a query built from the alert's labels."""
    args = " ".join(f"$labels.{label}" for label in labels)
    return (f'{{{{ with printf "{expr_format}" {args} | query }}}}'
            "{{ . | first | value }}{{ end }}")


def running_lately(cfg: RulesConfig) -> str:
    """Ranks whose last reported status is running. A failed scrape marks a target's series
    stale at once; the last value of the last 5m keeps one failed scrape from resetting `for`."""
    return f"last_over_time({cfg.m('mindformers_train_status')}[5m]) == {STATUS_RUNNING}"


def by_rank(expr: str, by: str = "job_name, rank") -> str:
    """`expr` with one series per rank (per `by`): a rank scraped by two scrape jobs has each
    of its series twice, and a one-to-one match or a count of ranks must see it once."""
    return f"max by ({by}) ({expr})"


def indent(expr: str, by: str = "  ") -> str:
    return "\n".join(by + line for line in expr.splitlines())


def num(x: float) -> str:
    return f"{x:g}"


def step_interval_record(cfg: RulesConfig) -> str:
    """The recorded mean seconds between a rank's steps over `step_interval_window`."""
    return f"job_name_rank:mindformers_train_step_interval_seconds:mean{cfg.step_interval_window}"
