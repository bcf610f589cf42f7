"""Prometheus alerting and recording rules for the metric contract, generated from Python.

Monitoring-mixin style: thresholds and selectors live in `RulesConfig`, apart from the rules.
`mfotel rules --out DIR` writes them (`mfotel assets` also writes the Prometheus config and
runbook beside them); the repository's `prometheus/rules/` holds the output of the defaults.

    mfotel rules --out prometheus/rules                  # the defaults
    mfotel rules --out /tmp/r --set stall_seconds=1800 --set selector='cluster="a"'
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import yaml

from ..contract import STATUS_FAILED, STATUS_RUNNING

ALERTS_FILE = "mindformers-alerts.yml"
RECORDING_FILE = "mindformers-recording.yml"
RUNBOOK_BASE_URL = "https://github.com/mfotel/mfotel/blob/main/prometheus/runbook.md"

_DURATION = re.compile(r"^([0-9]+(ms|s|m|h|d|w|y))+$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}


def duration_seconds(text: str) -> float:
    """Seconds of a Prometheus duration ("1h30m", "90s"); ValueError if it is not one."""
    if not isinstance(text, str) or not _DURATION.match(text):
        raise ValueError(f"{text!r} is not a Prometheus duration")
    return sum(int(n) * _UNIT_SECONDS[u] for n, u in re.findall(r"([0-9]+)(ms|s|m|h|d|w|y)", text))


@dataclass(frozen=True)
class RulesConfig:
    """Selectors and thresholds of the rules (the only knobs; the rules follow from them).

    `selector` is added to every raw metric selector, e.g. `cluster="a"` or
    `job=~"mindformers.*"`. Durations are Prometheus durations ("90s", "5m", "1h").
    """

    selector: str = ""
    runbook_base_url: str = RUNBOOK_BASE_URL
    # loss / grad norm not finite: look-back for the non-finite counters
    nonfinite_window: str = "5m"
    # stalled: no step for max(stall_seconds, stall_step_factor x mean step interval)
    stall_seconds: int = 900
    stall_step_factor: float = 10.0
    step_interval_window: str = "1h"
    stall_for: str = "2m"
    # rank down: last status scraped within the look-back was "running" and the rank is gone
    rank_down_lookback: str = "1h"
    rank_down_for: str = "2m"
    # a rank reported status 3 (failed/stopped) within the look-back
    failed_lookback: str = "15m"
    # spikes: last value above factor x its average over the window
    loss_spike_factor: float = 1.5
    loss_spike_window: str = "30m"
    loss_spike_for: str = "2m"
    grad_norm_spike_factor: float = 5.0
    grad_norm_spike_window: str = "1h"
    grad_norm_spike_for: str = "2m"
    # throughput drop: step rate over `throughput_window` below ratio x the rate of the
    # `throughput_baseline_window` before it
    throughput_drop_ratio: float = 0.5
    throughput_window: str = "5m"
    throughput_baseline_window: str = "1h"
    throughput_drop_for: str = "10m"
    # straggler: a rank's mean step time above factor x the job's median over ranks
    straggler_factor: float = 1.5
    straggler_for: str = "10m"
    # overflow storm: fraction of steps with a loss-scale overflow
    overflow_storm_ratio: float = 0.5
    overflow_window: str = "5m"
    overflow_storm_for: str = "5m"
    # ranks missing: fewer ranks report than the world_size label of their rank_info, while
    # at least one rank of the job runs (one alert per job, no rank label)
    ranks_missing_for: str = "5m"
    # loss divergence: a running rank's mean loss over the window is further than
    # tolerance x the median over the job's ranks from that median (data parallel)
    loss_divergence_window: str = "10m"
    loss_divergence_tolerance: float = 0.5
    loss_divergence_for: str = "15m"
    # step drift: a running rank more than this many seconds of training (steps behind the
    # job's leading rank / the job's step rate) behind
    step_drift_seconds: int = 120
    step_drift_for: str = "5m"
    # checkpoint too old: a running rank's last checkpoint (before its first: its start) is
    # older than max(checkpoint_max_age_seconds, factor x its configured interval), a step
    # interval turned into seconds by the step rate over the window
    checkpoint_max_age_seconds: int = 7200
    checkpoint_interval_factor: float = 3.0
    checkpoint_rate_window: str = "15m"
    checkpoint_for: str = "5m"

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name.endswith(("_window", "_for", "_lookback")) and not _DURATION.match(value):
                raise ValueError(f"RulesConfig.{f.name}={value!r} is not a Prometheus "
                                 "duration; use e.g. '90s', '5m', '1h'")
            if f.name.endswith("_factor") and not value > 1:
                raise ValueError(f"RulesConfig.{f.name}={value!r} must be > 1")
            if f.name.endswith("_ratio") and not 0 < value < 1:
                raise ValueError(f"RulesConfig.{f.name}={value!r} must be in (0, 1)")
        for name in ("stall_seconds", "step_drift_seconds", "loss_divergence_tolerance",
                     "checkpoint_max_age_seconds"):
            if not getattr(self, name) > 0:
                raise ValueError(f"RulesConfig.{name}={getattr(self, name)!r} must be > 0")
        if self.selector.strip().startswith("{") or self.selector.strip().endswith(","):
            raise ValueError(f"RulesConfig.selector={self.selector!r}: give bare matchers "
                             "without braces, e.g. 'cluster=\"a\"'")

    def m(self, name: str, *matchers: str) -> str:
        """`name{matchers, selector}`."""
        parts = [*matchers, *([self.selector] if self.selector else [])]
        return f"{name}{{{', '.join(parts)}}}" if parts else name

    def runbook_url(self, alertname: str) -> str:
        return f"{self.runbook_base_url}#{alertname.lower()}"


# ---------------------------------------------------------------- recording rules
STEP_QUANTILES = ("0.5", "0.9", "0.99")

#: Recorded series names; dashboards depend on them.
SAMPLES_RATE = "job_name:mindformers_train_samples:rate1m"
TOKENS_RATE = "job_name:mindformers_train_tokens:rate1m"
STEPS_RATE = "job_name:mindformers_train_steps:rate1m"
STEP_MEAN = "job_name_rank:mindformers_train_step_duration_seconds:mean1m"
STEP_QUANTILE = "job_name:mindformers_train_step_duration_seconds:quantile1m"
STEP_RANK_MEDIAN = "job_name:mindformers_train_step_duration_seconds:rank_median1m"
STEP_RANK_SPREAD = "job_name:mindformers_train_step_duration_seconds:rank_spread1m"
RANKS_RUNNING = "job_name:mindformers_train_ranks_running:count"
RANKS = "job_name:mindformers_train_ranks:count"
STRAGGLER_SCORE = "job_name_rank:mindformers_train_straggler_score:ratio1m"
RANKS_REPORTING = "job_name:mindformers_train_ranks_reporting:count"
STEPS_BEHIND = "job_name_rank:mindformers_train_step:behind_leader"
# For many ranks (docs/scaling.md): the job's bucket rates once (the three quantiles read
# them, instead of each summing 16 buckets of every rank again), the per-rank p99 a panel
# would otherwise compute at every point of its range, export errors summed over ranks.
STEP_BUCKET_RATE = "job_name:mindformers_train_step_duration_seconds_bucket:rate1m"
STEP_RANK_QUANTILE = "job_name_rank:mindformers_train_step_duration_seconds:quantile1m"
RANK_QUANTILES = ("0.99",)
EXPORT_ERRORS = "job_name_stage:mfotel_export_errors:increase1m"
# What cluster panels aggregate over every rank at each point of their range: ranks per
# status value, the job's progress (the slowest rank's), and the slowest rank's identity
# (rank_info of the lowest straggler score) for joins with device exporters.
RANKS_BY_STATUS = "job_name_status:mindformers_train_ranks:count"
JOB_PROGRESS = "job_name:mindformers_train_progress_ratio:min"
SLOWEST_RANK = "job_name:mindformers_train_rank_info:slowest1m"


def step_interval_record(cfg: RulesConfig) -> str:
    return f"job_name_rank:mindformers_train_step_interval_seconds:mean{cfg.step_interval_window}"


def loss_mean_record(cfg: RulesConfig) -> str:
    return f"job_name_rank:mindformers_train_loss:avg{cfg.loss_divergence_window}"


def loss_median_record(cfg: RulesConfig) -> str:
    return f"job_name:mindformers_train_loss:rank_median{cfg.loss_divergence_window}"


def recording_rules(cfg: RulesConfig) -> list[dict[str, Any]]:
    m = cfg.m
    dur = "mindformers_train_step_duration_seconds"
    ts, steps = (m("mindformers_train_last_step_timestamp_seconds"),
                 m("mindformers_train_steps_total"))
    step = m("mindformers_train_step")
    w = cfg.step_interval_window
    throughput = [
        {"record": SAMPLES_RATE,
         "expr": f"sum by (job_name) (rate({m('mindformers_train_samples_total')}[1m]))"},
        {"record": TOKENS_RATE,
         "expr": f"sum by (job_name) (rate({m('mindformers_train_tokens_total')}[1m]))"},
        {"record": STEPS_RATE,
         "expr": f"avg by (job_name) (rate({steps}[1m]))"},
    ]
    step_time = [
        {"record": STEP_MEAN,
         "expr": (f"sum by (job_name, rank) (rate({m(dur + '_sum')}[1m]))\n"
                  f"/\nsum by (job_name, rank) (rate({m(dur + '_count')}[1m]))")},
        {"record": STEP_BUCKET_RATE,
         "expr": f"sum by (job_name, le) (rate({m(dur + '_bucket')}[1m]))"},
        *({"record": STEP_QUANTILE, "expr": f"histogram_quantile({q}, {STEP_BUCKET_RATE})",
           "labels": {"quantile": q}} for q in STEP_QUANTILES),
        # `>= 0` drops the NaN of ranks with only the +Inf bucket (cardinality health)
        *({"record": STEP_RANK_QUANTILE,
           "expr": f"histogram_quantile({q}, sum by (job_name, rank, le) "
                   f"(rate({m(dur + '_bucket')}[1m])))\n>= 0",
           "labels": {"quantile": q}} for q in RANK_QUANTILES),
        {"record": STEP_RANK_MEDIAN, "expr": f"quantile by (job_name) (0.5, {STEP_MEAN})"},
        {"record": STEP_RANK_SPREAD,
         "expr": f"max by (job_name) ({STEP_MEAN})\n/\nmin by (job_name) ({STEP_MEAN})"},
        # 0..1, 1 = the job's fastest rank (the inverse of the spread, per rank)
        {"record": STRAGGLER_SCORE,
         "expr": f"min by (job_name) ({STEP_MEAN})\n/ on (job_name) group_right ()\n{STEP_MEAN}"},
        {"record": SLOWEST_RANK,
         "expr": f"max by (job_name, rank, node, device_id, namespace, pod_name) "
                 f"({m('mindformers_train_rank_info')})\n* on (job_name, rank) group_left ()\n"
                 f"(bottomk by (job_name) (1, {STRAGGLER_SCORE}) > bool 0)"},
        # Mean seconds between steps over the steps seen in the window. It ignores time after
        # the last step, so a stall does not inflate it (0/0 = NaN once no step is in the window).
        {"record": step_interval_record(cfg),
         "expr": (f"sum by (job_name, rank) ({ts} - min_over_time({ts}[{w}]))\n"
                  f"/\nsum by (job_name, rank) ({steps} - min_over_time({steps}[{w}]))")},
    ]
    ranks = [
        {"record": RANKS_RUNNING,
         "expr": f"count by (job_name) ({m('mindformers_train_status')} == {STATUS_RUNNING})"},
        {"record": RANKS, "expr": f"count by (job_name) ({m('mindformers_train_status')})"},
        # distinct ranks: a restarted rank's rank_info (new attempt label) may overlap the old
        # one's until it expires (OTLP push through a collector)
        {"record": RANKS_REPORTING,
         "expr": f"count by (job_name) (max by (job_name, rank) "
                 f"({m('mindformers_train_rank_info')}))"},
        {"record": STEPS_BEHIND,
         "expr": (f"max by (job_name) ({step})\n- on (job_name) group_right ()\n"
                  f"max by (job_name, rank) ({step})")},
        {"record": RANKS_BY_STATUS,
         "expr": f"count_values by (job_name) (\"status\", {m('mindformers_train_status')})"},
        {"record": JOB_PROGRESS,
         "expr": f"min by (job_name) ({m('mindformers_train_progress_ratio')})"},
    ]
    loss = [
        {"record": loss_mean_record(cfg),
         "expr": f"avg by (job_name, rank) "
                 f"(avg_over_time({m('mindformers_train_loss')}[{cfg.loss_divergence_window}]))"},
        {"record": loss_median_record(cfg),
         "expr": f"quantile by (job_name) (0.5, {loss_mean_record(cfg)})"},
    ]
    exporter = [
        {"record": EXPORT_ERRORS,
         "expr": f"sum by (job_name, stage) (increase({m('mfotel_export_errors_total')}[1m]))"},
    ]
    return [{"name": "mindformers-throughput.rules", "rules": throughput},
            {"name": "mindformers-step-time.rules", "rules": step_time},
            {"name": "mindformers-ranks.rules", "rules": ranks},
            {"name": "mindformers-loss.rules", "rules": loss},
            {"name": "mfotel-exporter.rules", "rules": exporter}]


# ---------------------------------------------------------------- alerting rules
def _alert(cfg: RulesConfig, name: str, expr: str, for_: str, severity: str, summary: str,
           description: str) -> dict[str, Any]:
    rule: dict[str, Any] = {"alert": name, "expr": expr}
    if for_ not in ("0", "0s", "0m"):
        rule["for"] = for_
    rule["labels"] = {"severity": severity}
    rule["annotations"] = {"summary": summary, "description": description,
                           "runbook_url": cfg.runbook_url(name)}
    return rule


_WHO = "job {{ $labels.job_name }} rank {{ $labels.rank }}"
_JOB = "job {{ $labels.job_name }}"


def _query_value(expr_format: str, *labels: str) -> str:
    """Template text printing the value of a query built from the alert's labels."""
    args = " ".join(f"$labels.{label}" for label in labels)
    return (f'{{{{ with printf "{expr_format}" {args} | query }}}}'
            "{{ . | first | value }}{{ end }}")


def alerting_rules(cfg: RulesConfig) -> list[dict[str, Any]]:
    m = cfg.m
    status = m("mindformers_train_status")
    running = f"{status} == {STATUS_RUNNING}"
    nf_loss = m("mindformers_train_nonfinite_total", 'metric="loss"')
    nf_grad = m("mindformers_train_nonfinite_total", 'metric="grad_norm"')
    ts = m("mindformers_train_last_step_timestamp_seconds")
    steps = m("mindformers_train_steps_total")
    loss, grad = m("mindformers_train_loss"), m("mindformers_train_grad_norm")
    overflow = m("mindformers_train_overflow_total")
    first_nf = ('{{ with printf "mindformers_train_first_nonfinite_step{job_name=\'%s\','
                'rank=\'%s\'}" $labels.job_name $labels.rank | query }}'
                ' First non-finite loss at step {{ . | first | value }}.{{ end }}')
    health = [
        _alert(cfg, "MindFormersLossNotFinite",
               # by (job_name, rank) only: the callback's fast path posts the same labels,
               # so Alertmanager deduplicates the two
               f"max by (job_name, rank) (\n"
               f"  ({m('mindformers_train_loss_finite')} == 0)\n"
               f"  or\n"
               f"  (sum without (metric) (increase({nf_loss}[{cfg.nonfinite_window}])) > 0)\n)",
               "0m", "critical", "Training loss is NaN or Inf.",
               f"The loss of {_WHO} is not finite (NaN/Inf) or was within the last "
               f"{cfg.nonfinite_window}; the run is diverging or its data/precision is "
               f"broken.{first_nf}"),
        _alert(cfg, "MindFormersGradNormNotFinite",
               f"(sum without (metric) (increase({nf_grad}[{cfg.nonfinite_window}])) > 0)\n"
               f"unless on (job_name, rank)\n"
               f"(increase({overflow}[{cfg.nonfinite_window}]) > 0)",
               "0m", "warning", "Gradient norm is NaN or Inf outside loss-scale overflows.",
               f"The gradient global norm of {_WHO} was NaN/Inf on "
               "about {{ $value | printf \"%.0f\" }} steps in the last "
               f"{cfg.nonfinite_window} with no loss-scale overflow reported; the weights "
               "are about to be poisoned."),
        _alert(cfg, "MindFormersTrainingStalled",
               f"(\n  (time() - {ts}) > {cfg.stall_seconds}\n"
               f"  unless on (job_name, rank)\n"
               f"  (time() - {ts}) <= on (job_name, rank) {_num(cfg.stall_step_factor)} * "
               f"{step_interval_record(cfg)}\n)\n"
               f"and on (job_name, rank) ({running})\n"
               f"and on (job_name, rank) (changes({steps}[{cfg.stall_seconds}s]) == 0)",
               cfg.stall_for, "critical", "Training made no step progress.",
               f"{_WHO} is running but completed no step for "
               "{{ $value | humanizeDuration }} (threshold: the larger of "
               f"{cfg.stall_seconds}s and {_num(cfg.stall_step_factor)} x its mean step "
               "interval): hung collective, dead data loader or stuck I/O."),
        # Only a rank last seen running pages: one that completed (2), failed (3, warns
        # below), was cancelled (4: SIGTERM / SIGINT, reported before it exits) or died while
        # compiling (0) does not; one killed without a catchable signal (kill -9, OOM) does.
        _alert(cfg, "MindFormersRankDown",
               f"(last_over_time({status}[{cfg.rank_down_lookback}]) == {STATUS_RUNNING})\n"
               f"unless on (job_name, rank) {status}\n"
               f"unless on (job_name, rank) "
               f"(last_over_time({m('mindformers_train_progress_ratio')}"
               f"[{cfg.rank_down_lookback}]) >= 1)",
               cfg.rank_down_for, "critical", "A training rank disappeared while running.",
               f"{_WHO} (target {{{{ $labels.instance }}}}) was last seen running and has "
               "not been scraped since: the process died, hangs in a way that blocks /metrics, "
               "or its node is unreachable."),
        _alert(cfg, "MindFormersTrainingFailed",
               f"last_over_time({status}[{cfg.failed_lookback}]) == {STATUS_FAILED}",
               "0m", "warning", "A training rank reported failed or stopped.",
               f"{_WHO} ended with status {STATUS_FAILED} (failed or stopped early) within the "
               f"last {cfg.failed_lookback}."),
        # One alert per job, labelled job_name and world_size. world_size is a label and PromQL
        # cannot turn a label into a number, so count_values turns the reporting count into a
        # label of the same name and the two are compared as labels.
        _alert(cfg, "MindFormersRanksMissing",
               f"(\n  max by (job_name, world_size) ({m('mindformers_train_rank_info')})\n"
               f"  unless on (job_name, world_size)\n"
               f"  count_values by (job_name) (\"world_size\", {RANKS_REPORTING})\n)\n"
               f"and on (job_name) ({RANKS_RUNNING} > 0)",
               cfg.ranks_missing_for, "critical",
               "A job has fewer ranks reporting than its world size.",
               f"{_JOB} has "
               + _query_value(f"{RANKS_REPORTING}{{job_name='%s'}}", "job_name")
               + " ranks reporting, but its world size is {{ $labels.world_size }}: a rank "
               "never started, died, or is missing from the scrape targets."),
    ]
    dynamics = [
        _alert(cfg, "MindFormersLossSpike",
               f"{loss}\n/\n(avg_over_time({loss}[{cfg.loss_spike_window}]) > 0)\n"
               f"> {_num(cfg.loss_spike_factor)}",
               cfg.loss_spike_for, "warning", "Training loss spiked.",
               f"The loss of {_WHO} is {{{{ $value | printf \"%.2f\" }}}}x its "
               f"{cfg.loss_spike_window} average (threshold {_num(cfg.loss_spike_factor)}x)."),
        _alert(cfg, "MindFormersGradNormSpike",
               f"{grad}\n/\n(avg_over_time({grad}[{cfg.grad_norm_spike_window}]) > 0)\n"
               f"> {_num(cfg.grad_norm_spike_factor)}",
               cfg.grad_norm_spike_for, "warning", "Gradient norm spiked.",
               f"The gradient global norm of {_WHO} is {{{{ $value | printf \"%.2f\" }}}}x "
               f"its {cfg.grad_norm_spike_window} average (threshold "
               f"{_num(cfg.grad_norm_spike_factor)}x)."),
        _alert(cfg, "MindFormersLossDivergence",
               f"abs(\n  {loss_mean_record(cfg)}\n  - on (job_name) group_left ()\n"
               f"  {loss_median_record(cfg)}\n)\n"
               f"/ on (job_name) group_left ()\n({loss_median_record(cfg)} > 0)\n"
               f"> {_num(cfg.loss_divergence_tolerance)}\n"
               f"and on (job_name, rank) ({running})",
               cfg.loss_divergence_for, "warning",
               "A data-parallel rank's loss diverges from the other ranks'.",
               f"The {cfg.loss_divergence_window} mean loss of {_WHO} is "
               "{{ $value | humanizePercentage }} away from the median over the job's ranks "
               f"(threshold {cfg.loss_divergence_tolerance:.0%}): this rank sees different "
               "data or computes differently (bad shard, faulty device, weights out of sync)."),
        _alert(cfg, "MindFormersLossScaleOverflowStorm",
               f"rate({overflow}[{cfg.overflow_window}])\n"
               f"/\n(rate({steps}[{cfg.overflow_window}]) > 0)\n"
               f"> {_num(cfg.overflow_storm_ratio)}",
               cfg.overflow_storm_for, "warning", "Most steps overflow the loss scale.",
               f"{{{{ $value | humanizePercentage }}}} of the steps of {_WHO} overflowed the "
               f"loss scale over the last {cfg.overflow_window} (threshold "
               f"{cfg.overflow_storm_ratio:.0%}); those updates are skipped."),
    ]
    performance = [
        # Job-level: the ranks of a data-parallel job step together, so a per-rank alert
        # raised one alert per rank for one slowdown (a thousand for a 1000-rank job); a
        # single slow rank is MindFormersStragglerRank / MindFormersStepDrift.
        _alert(cfg, "MindFormersThroughputDrop",
               f"(\n  avg by (job_name) (rate({steps}[{cfg.throughput_window}]))\n  /\n"
               f"  (avg by (job_name) (rate({steps}[{cfg.throughput_baseline_window}] offset "
               f"{cfg.throughput_window})) > 0)\n) < {_num(cfg.throughput_drop_ratio)}\n"
               f"and on (job_name) ({RANKS_RUNNING} > 0)",
               cfg.throughput_drop_for, "warning", "Training throughput dropped.",
               f"The step rate of {_JOB} over the last {cfg.throughput_window} is "
               "{{ $value | humanizePercentage }} of its rate over the "
               f"{cfg.throughput_baseline_window} before (threshold "
               f"{cfg.throughput_drop_ratio:.0%}; mean over its ranks)."),
        _alert(cfg, "MindFormersStragglerRank",
               f"{STEP_MEAN}\n/ on (job_name) group_left ()\n{STEP_RANK_MEDIAN}\n"
               f"> {_num(cfg.straggler_factor)}\n"
               f"and on (job_name, rank) ({running})",
               cfg.straggler_for, "warning", "A rank is much slower than the others.",
               f"The mean step time of {_WHO} is {{{{ $value | printf \"%.2f\" }}}}x the "
               f"median over the job's ranks (threshold {_num(cfg.straggler_factor)}x): "
               "check its device, host load and data loading."),
        # In time rather than steps: Prometheus scrapes the ranks at different moments, so
        # lock-step ranks can look a few steps apart.
        _alert(cfg, "MindFormersStepDrift",
               f"{STEPS_BEHIND}\n/ on (job_name) group_left ()\n({STEPS_RATE} > 0)\n"
               f"> {cfg.step_drift_seconds}\n"
               f"and on (job_name, rank) ({running})",
               cfg.step_drift_for, "warning", "A rank is many steps behind the others.",
               f"{_WHO} is {{{{ $value | humanizeDuration }}}} of training ("
               + _query_value(f"{STEPS_BEHIND}{{job_name='%s',rank='%s'}}", "job_name", "rank")
               + f" steps) behind the job's leading rank (threshold {cfg.step_drift_seconds}s): "
               "ranks that should step together have drifted apart."),
    ]
    health.append(_checkpoint_too_old(cfg))
    return [{"name": "mindformers-health.alerts", "rules": health},
            {"name": "mindformers-dynamics.alerts", "rules": dynamics},
            {"name": "mindformers-performance.alerts", "rules": performance}]


def _checkpoint_too_old(cfg: RulesConfig) -> dict[str, Any]:
    """Only ranks whose checkpoint callback reported its interval; a stalled rank (no step
    rate) is MindFormersTrainingStalled's, a finished one nobody's."""
    m = cfg.m
    age = (f"time() - (\n    {m('mindformers_train_last_checkpoint_timestamp_seconds')}\n"
           f"    or on (job_name, rank)\n    {m('mindformers_train_start_timestamp_seconds')}\n  )")
    steps_rate = f"rate({m('mindformers_train_steps_total')}[{cfg.checkpoint_rate_window}])"
    interval = (f"{m('mindformers_train_checkpoint_interval_steps')}\n"
                f"    / on (job_name, rank) ({steps_rate} > 0)\n"
                f"    or on (job_name, rank)\n"
                f"    {m('mindformers_train_checkpoint_interval_seconds')}")
    return _alert(
        cfg, "MindFormersCheckpointTooOld",
        f"(\n  {age}\n)\n> on (job_name, rank) group_left ()\nclamp_min(\n"
        f"  {_num(cfg.checkpoint_interval_factor)} * (\n    {interval}\n  ),\n"
        f"  {cfg.checkpoint_max_age_seconds}\n)\n"
        f"and on (job_name, rank) ({m('mindformers_train_status')} == {STATUS_RUNNING})",
        cfg.checkpoint_for, "warning", "No recent checkpoint.",
        f"{_WHO} has saved no checkpoint for {{{{ $value | humanizeDuration }}}} of training "
        f"(threshold: the larger of {cfg.checkpoint_max_age_seconds}s and "
        f"{_num(cfg.checkpoint_interval_factor)} x its checkpoint interval): a crash now would "
        "lose all of it. Saves are failing, hang, or are configured too rarely.")


def _num(x: float) -> str:
    return f"{x:g}"


# ---------------------------------------------------------------- rendering
class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)

_HEADER = ("# Generated by `python -m mfotel.alerting.rules` (mfotel/alerting/rules.py) from RulesConfig{overrides}.\n"
           "# Do not edit: change the config or the generator and regenerate.\n")


def _dump(groups: list[dict[str, Any]], cfg: RulesConfig) -> str:
    changed = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
               if getattr(cfg, f.name) != f.default}
    overrides = "(" + ", ".join(f"{k}={v!r}" for k, v in changed.items()) + ")" if changed else ""
    body = yaml.dump({"groups": groups}, Dumper=_Dumper, sort_keys=False, width=100,
                     default_flow_style=False, allow_unicode=True)
    return _HEADER.format(overrides=overrides) + body


def render_rules(cfg: RulesConfig | None = None) -> dict[str, str]:
    """File name -> YAML text of the recording and alerting rule files."""
    cfg = cfg or RulesConfig()
    return {RECORDING_FILE: _dump(recording_rules(cfg), cfg),
            ALERTS_FILE: _dump(alerting_rules(cfg), cfg)}


def alert_names(cfg: RulesConfig | None = None) -> list[str]:
    return [r["alert"] for g in alerting_rules(cfg or RulesConfig()) for r in g["rules"]]


def write_rules(out_dir: str | Path, config: RulesConfig | None = None) -> list[Path]:
    """Write both rule files into `out_dir` (created if needed); returns their paths."""
    from ..assets import rule_files, write_files
    return write_files(rule_files(config), out_dir)


def stale_rule_files(out_dir: str | Path, config: RulesConfig | None = None) -> list[str]:
    """Names of the files in `out_dir` that differ from what `config` generates."""
    from ..assets import rule_files, stale_files
    return stale_files(rule_files(config), out_dir)


def parse_set(items: Sequence[str]) -> dict[str, Any]:
    """`--set KEY=VALUE` items -> RulesConfig keyword arguments (SystemExit naming the keys)."""
    fields = {f.name: f for f in dataclasses.fields(RulesConfig)}
    overrides: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or key not in fields:
            hint = ", ".join(sorted(fields))
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE with KEY one of: {hint}")
        kind = type(fields[key].default)
        try:
            overrides[key] = kind(raw)
        except ValueError:
            raise SystemExit(f"--set {item!r}: {raw!r} is not a {kind.__name__}") from None
    return overrides


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m mfotel.alerting.rules`: the same as `mfotel rules`."""
    from ..assets import add_arguments
    parser = add_arguments(argparse.ArgumentParser(
        prog="python -m mfotel.alerting.rules", description=__doc__.splitlines()[0]), "rules")
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
