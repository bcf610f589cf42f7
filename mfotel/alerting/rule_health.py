"""The rules' own health: a rule group that fails to evaluate records and pages nothing, and
says so only in its evaluator's log and /metrics. Two alerts read those metrics for the groups
of mfotel (named `mindformers-*` and `mfotel-*`), per evaluator (`instance`) and group:

- `MindFormersRuleFailures` (critical): a group failed evaluations for 10 minutes (a query
  error: "found duplicate series", "query processing would load too many samples", a
  time-out); its alerts cannot fire meanwhile;
- `MindFormersMissingRuleEvaluations` (warning): a group missed evaluations for 15 minutes
  (one evaluation took longer than its interval): its alerts come late.

The names and windows follow the Prometheus mixin's `PrometheusRuleFailures` and
`PrometheusMissingRuleEvaluations`. Prometheus' metrics reach it when it scrapes itself (the
`prometheus` job of the shipped prometheus.yml); vmalert's (the sharded topology's global
ruler) when the shards scrape it, as they do for `MindFormersGlobalRulerDown`. Neither alert
has a `job_name`: an evaluator serves every job whose ranks it holds.
"""
from __future__ import annotations

from typing import Any

from .promql import alert
from .thresholds import RulesConfig

GROUP = "mfotel-rules.alerts"
FAILURES = "MindFormersRuleFailures"
MISSED = "MindFormersMissingRuleEvaluations"
ALERTS = (FAILURES, MISSED)
FAILURES_FOR, MISSED_FOR, WINDOW = "10m", "15m", "5m"
#: mfotel's groups: Prometheus labels a group "<file>;<group>", vmalert "<group>".
OURS_PROMETHEUS = 'rule_group=~".*;(mindformers|mfotel)-.*"'
OURS_VMALERT = 'group=~"(mindformers|mfotel)-.*"'


def _vmalert(expr: str) -> str:
    """vmalert's `expr` per instance and group, the group as Prometheus' `rule_group` label."""
    return (f"sum by (instance, rule_group) (label_replace(\n  {expr},\n"
            f'  "rule_group", "$1", "group", "(.*)"\n))')


def rule_health_alerts(cfg: RulesConfig) -> list[dict[str, Any]]:
    """The two alerts (one group: it reads no series of the ranks)."""
    where = "{{ $labels.rule_group }} on {{ $labels.instance }}"
    failing = (f"sum by (instance, rule_group) (\n  increase(prometheus_rule_evaluation_failures_"
               f"total{{{OURS_PROMETHEUS}}}[{WINDOW}])\n) > 0\nor\n"
               + _vmalert(f"vmalert_alerting_rules_error{{{OURS_VMALERT}}}\n"
                          f"  or vmalert_recording_rules_error{{{OURS_VMALERT}}}") + " > 0")
    missed = (f"sum by (instance, rule_group) (\n  increase(prometheus_rule_group_iterations_"
              f"missed_total{{{OURS_PROMETHEUS}}}[{WINDOW}])\n) > 0\nor\n"
              + _vmalert(f"increase(vmalert_iteration_missed_total{{{OURS_VMALERT}}}"
                         f"[{WINDOW}])") + " > 0")
    return [
        alert(cfg, FAILURES, failing, FAILURES_FOR, "critical",
              "An mfotel rule group fails to evaluate.",
              f"Rule group {where} has failed its evaluations for {FAILURES_FOR}: the alerts "
              "of that group cannot fire and its records are missing, for every job it "
              "evaluates, so a NaN loss, a dead or hung rank may page nobody. The error is on "
              "the evaluator's rules page (Prometheus /rules, vmalert /api/v1/rules: "
              "lastError) and in its log."),
        alert(cfg, MISSED, missed, MISSED_FOR, "warning",
              "An mfotel rule group misses evaluations.",
              f"Rule group {where} has missed evaluations for {MISSED_FOR}: one evaluation "
              "takes longer than the group's interval, so its alerts come late (the group's "
              "last duration is prometheus_rule_group_last_duration_seconds, or vmalert's "
              "vmalert_iteration_duration_seconds)."),
    ]
