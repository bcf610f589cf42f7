"""Prometheus alerting and recording rules for the metric contract, generated from Python.

Monitoring-mixin style: thresholds and selectors live in `RulesConfig`, apart from the rules.
`mfotel rules --out DIR` writes them (`mfotel assets` also writes the Prometheus config, the
runbook and the promtool tests beside them: `mfotel.assets`, which imports this module, never
the other way); the repository's `prometheus/rules/` holds the output of the defaults.

    mfotel rules --out prometheus/rules                  # the defaults
    mfotel rules --out /tmp/r --set stall_seconds=1800 --set selector='cluster="a"'
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from ..contract import (
    STATUS_COMPLETED,
    STATUS_FAILED,
    STATUS_RUNNING,
    finite_samples,
)
from . import goodput, rule_health
from .cascade import FAILED_EXIT as FAILED_EXIT
from .cascade import FIRST, cascade_alerts, cascade_records
from .goodput import goodput_alerts, goodput_records
from .promql import (
    ALIVE,
    JOB,
    WHO,
    alert,
    by_rank,
    in_step,
    indent,
    num,
    query_value,
    running_lately,
    step_interval_record,
)

# the knobs, re-exported: `from mfotel.alerting.rules import RulesConfig` as before
from .thresholds import RUNBOOK_BASE_URL as RUNBOOK_BASE_URL
from .thresholds import RulesConfig
from .thresholds import duration_seconds as duration_seconds
from .thresholds import parse_set as parse_set

ALERTS_FILE = "mindformers-alerts.yml"
RECORDING_FILE = "mindformers-recording.yml"


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
# (rank_info of the rank the others wait for most) for joins with device exporters.
RANKS_BY_STATUS = "job_name_status:mindformers_train_ranks:count"
JOB_PROGRESS = "job_name:mindformers_train_progress_ratio:min"
SLOWEST_RANK = "job_name:mindformers_train_rank_info:slowest1m"
# Who waits for whom (docs/alerting.md, "Job-level truth"). In synchronous training the ranks
# leave each step's collective together: a rank slow outside its timed step (input, host work
# between steps) makes the others wait inside theirs. OUTSIDE_SHARE: the share of wall time a
# rank spends outside its timed steps; WAITED_FOR: that share minus the job's median rank's
# (above 0: the others wait for it; below: it waits for them). IN_STEP: 1 while a rank is
# inside a step.
OUTSIDE_SHARE = "job_name_rank:mindformers_train_step_outside:ratio1m"
WAITED_FOR = "job_name_rank:mindformers_train_waited_for:ratio1m"
IN_STEP = "job_name_rank:mindformers_train_in_step:bool"
# The first non-finite loss step of the job (over its ranks): the ranks that reported it are
# where the incident started, the others followed after the gradient all-reduce.
FIRST_NONFINITE = "job_name:mindformers_train_first_nonfinite_step:min"



# The finite samples of the loss and the gradient norm, recorded at each evaluation: they are
# exposed as they are, and one NaN (or a loss-scale overflow's Inf grad norm) in a window would
# make avg_over_time NaN (Inf) for the whole window, blinding the spike and divergence alerts.
# Their means over a window read these records (one sample an evaluation, each series' own
# labels); a subquery `[window:]` computed the same points again at every evaluation: 3,600 of
# them per series for a 1h window at 1 s, the costliest rule of a job's Prometheus.
LOSS_FINITE = "job_name_rank:mindformers_train_loss:finite"
GRAD_NORM_FINITE = "job_name_rank:mindformers_train_grad_norm:finite"


def _finite_mean(finite: str, window: str) -> str:
    """The mean over `window` of a finite-samples record (LOSS_FINITE, GRAD_NORM_FINITE)."""
    return f"avg_over_time({finite}[{window}])"


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
    # each rank once (by_rank): a target in two scrape jobs has each of its series twice, and
    # the job's numbers stay the job's (MindFormersRankDuplicated warns)
    samples, tokens = (f"rate({m('mindformers_train_samples_total')}[1m])",
                       f"rate({m('mindformers_train_tokens_total')}[1m])")
    throughput = [
        {"record": SAMPLES_RATE, "expr": f"sum by (job_name) (\n  {by_rank(samples)}\n)"},
        {"record": TOKENS_RATE, "expr": f"sum by (job_name) (\n  {by_rank(tokens)}\n)"},
        {"record": STEPS_RATE,
         "expr": f"avg by (job_name) (\n  {by_rank(f'rate({steps}[1m])')}\n)"},
    ]
    bucket_rate = f"rate({m(dur + '_bucket')}[1m])"
    step_time = [
        {"record": STEP_MEAN,
         "expr": (f"sum by (job_name, rank) (rate({m(dur + '_sum')}[1m]))\n"
                  f"/\nsum by (job_name, rank) (rate({m(dur + '_count')}[1m]))")},
        {"record": STEP_BUCKET_RATE,
         "expr": f"sum by (job_name, le) (\n  {by_rank(bucket_rate, 'job_name, rank, le')}\n)"},
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
        # Mean seconds between steps over the steps seen in the window. It ignores time after
        # the last step, so a stall does not inflate it (0/0 = NaN once no step is in the window).
        {"record": step_interval_record(cfg),
         "expr": (f"sum by (job_name, rank) ({ts} - min_over_time({ts}[{w}]))\n"
                  f"/\nsum by (job_name, rank) ({steps} - min_over_time({steps}[{w}]))")},
    ]
    status = m("mindformers_train_status")
    ranks = [   # each rank once (a rank restarted elsewhere may show its old status a while)
        {"record": RANKS_RUNNING,
         "expr": f"count by (job_name) (\n  {by_rank(f'{status} == {STATUS_RUNNING}')}\n)"},
        {"record": RANKS, "expr": f"count by (job_name) (\n  {by_rank(status)}\n)"},
        # distinct ranks: a restarted rank's rank_info (new attempt label) may overlap the old
        # one's until it expires (OTLP push through a collector)
        {"record": RANKS_REPORTING,
         "expr": f"count by (job_name) (max by (job_name, rank) "
                 f"({m('mindformers_train_rank_info')}))"},
        {"record": STEPS_BEHIND,
         "expr": (f"max by (job_name) ({step})\n- on (job_name) group_right ()\n"
                  f"max by (job_name, rank) ({step})")},
        {"record": RANKS_BY_STATUS,
         "expr": f"count by (job_name, status) (\n"
                 f"  count_values by (job_name, rank) (\"status\", {status})\n)"},
        {"record": JOB_PROGRESS,
         "expr": f"min by (job_name) ({m('mindformers_train_progress_ratio')})"},
    ]
    job = job_truth_records(cfg)
    # first: the means below and the spike alerts read them (mindformers-dynamics.alerts, which
    # the promtool tests evaluate after this group: `group_eval_order`)
    loss = [
        {"record": LOSS_FINITE, "expr": finite_samples(m("mindformers_train_loss"))},
        {"record": GRAD_NORM_FINITE, "expr": finite_samples(m("mindformers_train_grad_norm"))},
        {"record": loss_mean_record(cfg),
         "expr": f"avg by (job_name, rank) "
                 f"({_finite_mean(LOSS_FINITE, cfg.loss_divergence_window)})"},
        {"record": loss_median_record(cfg),
         "expr": f"quantile by (job_name) (0.5, {loss_mean_record(cfg)})"},
    ]
    errors = f"increase({m('mfotel_export_errors_total')}[1m])"
    exporter = [
        {"record": EXPORT_ERRORS,
         "expr": f"sum by (job_name, stage) (\n  {by_rank(errors, 'job_name, rank, stage')}\n)"},
    ]
    return [{"name": "mindformers-throughput.rules", "rules": throughput},
            {"name": "mindformers-step-time.rules", "rules": step_time},
            {"name": "mindformers-ranks.rules", "rules": ranks},
            {"name": "mindformers-job.rules", "rules": job},
            {"name": "mindformers-loss.rules", "rules": loss},
            {"name": "mindformers-cascade.rules", "rules": cascade_records(cfg)},
            # every minute exactly: its increases read the evaluation a minute before
            {"name": "mindformers-goodput.rules", "interval": goodput.INTERVAL,
             "rules": goodput_records(cfg)},
            {"name": "mfotel-exporter.rules", "rules": exporter}]


def job_truth_records(cfg: RulesConfig) -> list[dict[str, Any]]:
    """Who waits for whom, and where a non-finite loss started (the job-level alerts and the
    cluster panels read these)."""
    m = cfg.m
    outside = m("mindformers_train_step_outside_seconds_total")
    return [
        # seconds outside per second of wall time: a share, 0..1 (the sum: a process restarted
        # at another address within the minute; each address once)
        {"record": OUTSIDE_SHARE,
         "expr": f"clamp(sum by (job_name, rank) "
                 f"({by_rank(f'rate({outside}[1m])', 'job_name, rank, instance')}), 0, 1)"},
        # against the median rank: one rank far above it is waited for; a job whose ranks
        # all wait for their input (or all but one) has no straggler
        {"record": WAITED_FOR,
         "expr": f"{OUTSIDE_SHARE}\n- on (job_name) group_left ()\n"
                 f"quantile by (job_name) (0.5, {OUTSIDE_SHARE})"},
        {"record": SLOWEST_RANK,
         "expr": f"max by (job_name, rank, node, device_id, namespace, pod_name) "
                 f"({m('mindformers_train_rank_info')})\n* on (job_name, rank) group_left ()\n"
                 f"(topk by (job_name) (1, {WAITED_FOR} > {num(cfg.slowest_wait_ratio)}) "
                 f"> bool 0)"},
        {"record": IN_STEP, "expr": in_step(cfg)},
        {"record": FIRST_NONFINITE,
         "expr": f"min by (job_name) ({m('mindformers_train_first_nonfinite_step')})"},
    ]


# ---------------------------------------------------------------- alerting rules
def alerting_rules(cfg: RulesConfig) -> list[dict[str, Any]]:
    m = cfg.m
    status = m("mindformers_train_status")
    running = f"{status} == {STATUS_RUNNING}"
    steps = m("mindformers_train_steps_total")
    loss, grad = m("mindformers_train_loss"), m("mindformers_train_grad_norm")
    overflow = m("mindformers_train_overflow_total")
    health = [
        *nonfinite_alerts(cfg),
        alert(cfg, "MindFormersTrainingFailed",
               f"last_over_time({status}[{cfg.failed_lookback}]) == {STATUS_FAILED}",
               "0m", "warning", "A training rank reported failed or stopped.",
               f"{WHO} ended with status {STATUS_FAILED} (failed or stopped early) within the "
               f"last {cfg.failed_lookback}."),
        # One alert per job, labelled job_name and world_size. world_size is a label and PromQL
        # cannot turn a label into a number, so count_values turns the reporting count into a
        # label of the same name and the two are compared as labels.
        # A rank its node agent reports alive counts as present (its /metrics may be silent
        # while it compiles; MindFormersRankUnresponsive says so), and so does a rank that
        # completed (its job is finishing: rank 0 saves the last checkpoint). A job with a
        # rank that left the healthy state has its culprit's page (mfotel.alerting.cascade):
        # the ranks missing after it are that page's context.
        alert(cfg, "MindFormersRanksMissing",
               f"(\n  max by (job_name, world_size) ({m('mindformers_train_rank_info')})\n"
               f"  unless on (job_name, world_size)\n"
               f"  count_values by (job_name) (\"world_size\", count by (job_name) (\n"
               f"    max by (job_name, rank) ({m('mindformers_train_rank_info')})\n"
               f"    or\n"
               f"    max by (job_name, rank) ({m('mfotel_node_rank_state', ALIVE)} == 1)\n"
               f"    or\n"
               f"    max by (job_name, rank) (last_over_time({status}[{cfg.rank_down_lookback}]) "
               f"== {STATUS_COMPLETED})\n"
               f"  ))\n)\n"
               f"and on (job_name) ({RANKS_RUNNING} > 0)\n"
               f"unless on (job_name) {FIRST}\n"
               # a rank seen running is gone now: its departure is recorded at the cascade
               # group's next evaluation, and its page names it
               f"unless on (job_name) (\n"
               f"  last_over_time({status}[{cfg.rank_down_lookback}]) == {STATUS_RUNNING}\n"
               f"  unless on (job_name, rank) {status}\n)",
               cfg.ranks_missing_for, "critical",
               "A job has fewer ranks reporting than its world size.",
               f"{JOB} has "
               + query_value(f"{RANKS_REPORTING}{{job_name='%s'}}", "job_name")
               + " ranks reporting, but its world size is {{ $labels.world_size }}: a rank "
               "never started, died, or is missing from the scrape targets."),
    ]
    dynamics = [
        alert(cfg, "MindFormersLossSpike",
               f"{loss}\n/\n"
               f"({_finite_mean(LOSS_FINITE, cfg.loss_spike_window)} > 0)\n"
               f"> {num(cfg.loss_spike_factor)}",
               cfg.loss_spike_for, "warning", "Training loss spiked.",
               f"The loss of {WHO} is {{{{ $value | printf \"%.2f\" }}}}x its "
               f"{cfg.loss_spike_window} average (threshold {num(cfg.loss_spike_factor)}x)."),
        alert(cfg, "MindFormersGradNormSpike",
               f"{grad}\n/\n"
               f"({_finite_mean(GRAD_NORM_FINITE, cfg.grad_norm_spike_window)} > 0)\n"
               f"> {num(cfg.grad_norm_spike_factor)}",
               cfg.grad_norm_spike_for, "warning", "Gradient norm spiked.",
               f"The gradient global norm of {WHO} is {{{{ $value | printf \"%.2f\" }}}}x "
               f"its {cfg.grad_norm_spike_window} average (threshold "
               f"{num(cfg.grad_norm_spike_factor)}x)."),
        alert(cfg, "MindFormersLossDivergence",
               f"abs(\n  {loss_mean_record(cfg)}\n  - on (job_name) group_left ()\n"
               f"  {loss_median_record(cfg)}\n)\n"
               f"/ on (job_name) group_left ()\n({loss_median_record(cfg)} > 0)\n"
               f"> {num(cfg.loss_divergence_tolerance)}\n"
               f"and on (job_name, rank) ({running})",
               cfg.loss_divergence_for, "warning",
               "A data-parallel rank's loss diverges from the other ranks'.",
               f"The {cfg.loss_divergence_window} mean loss of {WHO} is "
               "{{ $value | humanizePercentage }} away from the median over the job's ranks "
               f"(threshold {cfg.loss_divergence_tolerance:.0%}): this rank sees different "
               "data or computes differently (bad shard, faulty device, weights out of sync)."),
        alert(cfg, "MindFormersLossScaleOverflowStorm",
               f"rate({overflow}[{cfg.overflow_window}])\n"
               f"/\n(rate({steps}[{cfg.overflow_window}]) > 0)\n"
               f"> {num(cfg.overflow_storm_ratio)}",
               cfg.overflow_storm_for, "warning", "Most steps overflow the loss scale.",
               f"{{{{ $value | humanizePercentage }}}} of the steps of {WHO} overflowed the "
               f"loss scale over the last {cfg.overflow_window} (threshold "
               f"{cfg.overflow_storm_ratio:.0%}); those updates are skipped."),
    ]
    performance = [
        # Job-level: the ranks of a data-parallel job step together, so a per-rank alert
        # raised one alert per rank for one slowdown (a thousand for a 1000-rank job); a
        # single slow rank is MindFormersStragglerRank / MindFormersStepDrift.
        alert(cfg, "MindFormersThroughputDrop",
               f"(\n  avg by (job_name) (rate({steps}[{cfg.throughput_window}]))\n  /\n"
               f"  (avg by (job_name) (rate({steps}[{cfg.throughput_baseline_window}] offset "
               f"{cfg.throughput_window})) > 0)\n) < {num(cfg.throughput_drop_ratio)}\n"
               f"and on (job_name) ({RANKS_RUNNING} > 0)\n"
               # every rank at its last step: the end work (a final save), not a slowdown
               f"unless on (job_name) ({JOB_PROGRESS} >= 1)",
               cfg.throughput_drop_for, "warning", "Training throughput dropped.",
               f"The step rate of {JOB} over the last {cfg.throughput_window} is "
               "{{ $value | humanizePercentage }} of its rate over the "
               f"{cfg.throughput_baseline_window} before (threshold "
               f"{cfg.throughput_drop_ratio:.0%}; mean over its ranks)."),
        _straggler_rank(cfg),
        # In time rather than steps: Prometheus scrapes the ranks at different moments, so
        # lock-step ranks can look a few steps apart.
        alert(cfg, "MindFormersStepDrift",
               f"{STEPS_BEHIND}\n/ on (job_name) group_left ()\n({STEPS_RATE} > 0)\n"
               f"> {cfg.step_drift_seconds}\n"
               f"and on (job_name, rank) ({running})",
               cfg.step_drift_for, "warning", "A rank is many steps behind the others.",
               f"{WHO} is {{{{ $value | humanizeDuration }}}} of training ("
               + query_value(f"{STEPS_BEHIND}{{job_name='%s',rank='%s'}}", "job_name", "rank")
               + f" steps) behind the job's leading rank (threshold {cfg.step_drift_seconds}s): "
               "ranks that should step together have drifted apart."),
    ]
    health += [_checkpoint_too_old(cfg), _rank_duplicated(cfg), _export_failing(cfg)]
    return [{"name": "mindformers-health.alerts", "rules": health},
            {"name": "mindformers-dynamics.alerts", "rules": dynamics},
            {"name": "mindformers-performance.alerts", "rules": performance},
            {"name": "mindformers-cascade.alerts", "rules": cascade_alerts(cfg)},
            {"name": "mindformers-node.alerts", "rules": node_alerts(cfg)},
            {"name": "mindformers-goodput.alerts", "rules": goodput_alerts(cfg)},
            {"name": rule_health.GROUP, "rules": rule_health.rule_health_alerts(cfg)}]


def node_alerts(cfg: RulesConfig) -> list[dict[str, Any]]:
    """What a rank's node agent (mfotel-instrument) reports beyond the cascade's pages
    (mfotel.alerting.cascade: how a rank ended): a rank alive whose /metrics is silent."""
    m = cfg.m
    state = ('{{ with printf "max by (state) (mfotel_node_rank_state{job_name=\'%s\','
             'rank=\'%s\'} == 1)" $labels.job_name $labels.rank | query }}'
             '{{ . | first | label "state" }}{{ end }}')
    return [
        alert(cfg, "MindFormersRankUnresponsive",
               f"(time() - {m('mfotel_node_rank_endpoint_last_answer_timestamp_seconds')})\n"
               f"and on (job_name, rank) ({m('mfotel_node_rank_endpoint_up')} == 0)\n"
               f"and on (job_name, rank) "
               f"(max by (job_name, rank) ({m('mfotel_node_rank_state', ALIVE)}) == 1)",
               cfg.rank_unresponsive_for, "warning",
               "A training rank is alive but its /metrics does not answer.",
               f"{WHO} is alive (process {state}) but its /metrics has not answered the node "
               "agent's liveness probe for {{ $value | humanizeDuration }}: it holds the GIL "
               "(graph compilation, a long C call), is stopped (SIGSTOP, a debugger) or is "
               "starved. Its own series are stale meanwhile; it is not paged as down while its "
               "process lives."),
    ]


# ---------------------------------------------------------------- job-level truth
# Per-rank series stay the raw truth; these alerts tell the rank that is waited for from the
# ranks that wait (docs/alerting.md, "Job-level truth"), and page once per job and incident.
#: Alerts that only inhibit others (Alertmanager routes `severity="info"` to no receiver).
INFO_ALERTS = ("MindFormersLossNotFiniteFollower",)


def _loss_nonfinite(cfg: RulesConfig) -> str:
    """Ranks whose loss is not finite now or was within the look-back."""
    m = cfg.m
    nf_loss = m("mindformers_train_nonfinite_total", 'metric="loss"')
    return (f"max by (job_name, rank) (\n"
            f"  ({m('mindformers_train_loss_finite')} == 0)\n  or\n"
            f"  (sum without (metric) (increase({nf_loss}[{cfg.nonfinite_window}])) > 0)\n)")


def nonfinite_alerts(cfg: RulesConfig) -> list[dict[str, Any]]:
    """A NaN loss on one rank reaches every rank one step later (the gradient all-reduce):
    the page names the rank(s) whose loss went non-finite first; the ranks that followed
    fire an info alert that mutes their own fast-path posts. The silent case, a non-finite
    grad norm while every loss stays finite and no overflow explains it, pages per job."""
    m = cfg.m
    first = m("mindformers_train_first_nonfinite_step")
    recent = _loss_nonfinite(cfg)
    # the first non-finite step of each rank whose loss is not finite now or lately (an
    # earlier incident's ranks must not hide a new one), and its minimum over the job
    def of_recent_ranks(step: str) -> str:
        return f"(\n  max by (job_name, rank) ({step})\n  and on (job_name, rank)\n" \
               f"{indent(recent, '  ')}\n)"
    # held over the window, as `recent` already is: the ranks' series vanish at the job's end
    # one by one, and the origin must not move to a rank still scraped (its follower), nor the
    # follower's mute lift (a rank's fast-path post lives Alertmanager's resolve_timeout, 5m)
    w = cfg.nonfinite_window
    held_first = of_recent_ranks(f"last_over_time({first}[{w}])")
    job_first = f"min by (job_name) {held_first}"
    held_step = f"max by (job_name, rank) (last_over_time({m('mindformers_train_step')}[{w}]))"
    nf_grad = m("mindformers_train_nonfinite_total", 'metric="grad_norm"')
    overflow = m("mindformers_train_overflow_total")
    # the alert's value is the rank's first non-finite step; a follower's shows one step
    # later, and may not be scraped yet when the page goes out
    # (ranks, not series: a rank scraped by two jobs has its series twice)
    followed = ('{{ with printf "count(max by (rank) (last_over_time('
                'mindformers_train_first_nonfinite_step'
                f"{{job_name='%s'}}[{w}])) > %v)\" $labels.job_name $value | query }}}}"
                "{{ . | first | value }} other rank(s) of the job followed a step later"
                "{{ else }}The other ranks of the job follow a step later{{ end }}")
    step_now = ('{{ with printf "max(mindformers_train_step{job_name=\'%s\'})" $labels.job_name '
                '| query }}{{ . | first | value }}{{ end }}')
    return [
        # Labelled (job_name, rank) like the fast path's post (mfotel.alerting.fastpage), so
        # Alertmanager merges the two. Named once every rank has been scraped at or past the
        # job's first non-finite step (a rank scraped earlier may hide an earlier origin) and
        # every rank counted non-finite shows its first non-finite step (a new series may be
        # readable seconds after the older series of the same scrape: VictoriaMetrics), or
        # `nonfinite_settle` after it (a rank that stopped stepping holds the check back).
        alert(cfg, "MindFormersLossNotFinite",
               f"{held_first}\n== on (job_name) group_left ()\n{job_first}\n"
               f"and on (job_name)\n(\n"
               f"  (\n    min by (job_name) ({held_step})\n"
               f"    >= on (job_name)\n{indent(job_first, '    ')}\n"
               f"    unless on (job_name)\n    (\n{indent(recent, '      ')}\n"
               f"      unless on (job_name, rank)\n"
               f"      last_over_time({first}[{w}])\n    )\n  )\n  or\n"
               f"  count by (job_name) (\n    {first} offset {cfg.nonfinite_settle}\n"
               f"    and on (job_name, rank)\n{indent(recent, '    ')}\n  )\n)",
               "0m", "critical", "Training loss is NaN or Inf.",
               f"The loss of {WHO} went NaN/Inf first, at step {{{{ $value }}}} (or within the "
               f"last {cfg.nonfinite_window}): the incident started on this rank. {followed} "
               "(the gradient all-reduce carries a NaN to every rank); look at this rank's data "
               "and inputs first."),
        alert(cfg, "MindFormersLossNotFiniteFollower",
               f"{held_first}\n> on (job_name) group_left ()\nmin by (job_name) {held_first}",
               "0m", "info", "A rank's loss went NaN or Inf after another rank's.",
               f"The loss of {WHO} went NaN/Inf at step {{{{ $value }}}}, after another rank's: "
               "it followed (the gradient all-reduce carried it). Sent nowhere: it mutes this "
               "rank's own MindFormersLossNotFinite; the page names the rank it started on."),
        alert(cfg, "MindFormersGradNormNotFinite",
               f"count by (job_name) (\n"
               f"  {by_rank(f'sum without (metric) (increase({nf_grad}[{w}])) > 0')}\n"
               f"  unless on (job_name, rank)\n  (increase({overflow}[{w}]) > 0)\n)\n"
               f"unless on (job_name)\n(\n{indent(f'max by (job_name) ({recent})')}\n)",
               cfg.grad_norm_nonfinite_for, "critical",
               "Gradient norm is NaN or Inf while the loss stays finite.",
               f"The gradient norm of {JOB} was NaN/Inf on {{{{ $value }}}} rank(s) in the "
               f"last {w} (by step {step_now}) while every rank's loss stayed finite and no "
               "loss-scale overflow explains it: the weights are turning NaN (a NaN input behind "
               "a ReLU keeps the loss finite and constant). The gradient all-reduce gives every "
               "rank the same norm, so it does not tell where it started; stop or roll back "
               "before the next checkpoint saves NaN weights."),
    ]


def _straggler_rank(cfg: RulesConfig) -> dict[str, Any]:
    """The rank the others wait for (slow outside its timed step). A rank slow inside the
    step (compute) makes every rank's timed step equally long: no rank is named, the job's
    MindFormersThroughputDrop fires."""
    running = running_lately(cfg)
    return alert(
        cfg, "MindFormersStragglerRank",
        f"{WAITED_FOR} > {num(cfg.straggler_wait_ratio)}\nand on (job_name, rank) ({running})",
        cfg.straggler_for, "warning", "The other ranks wait for one rank.",
        f"The other ranks of job {{{{ $labels.job_name }}}} wait for rank {{{{ $labels.rank }}}}: "
        "it spends {{ $value | humanizePercentage }} more of its time outside the training step "
        "(input pipeline, host work between steps) than the job's median rank, while the others "
        "wait for it inside theirs (its own step time is the shortest). Threshold "
        f"{cfg.straggler_wait_ratio:.0%}. Check its data loading, storage and host.")


def _checkpoint_too_old(cfg: RulesConfig) -> dict[str, Any]:
    """Only ranks whose checkpoint callback reported its interval; a stalled rank (no step
    rate) is MindFormersTrainingStalled's, a finished one nobody's."""
    m = cfg.m
    age = (f"time() - (\n    {m('mindformers_train_last_checkpoint_timestamp_seconds')}\n"
           f"    or on (job_name, rank)\n    {m('mindformers_train_start_timestamp_seconds')}\n  )")
    steps_rate = f"rate({m('mindformers_train_steps_total')}[{cfg.checkpoint_rate_window}])"
    interval = (f"{by_rank(m('mindformers_train_checkpoint_interval_steps'))}\n"
                f"    / on (job_name, rank) {by_rank(f'{steps_rate} > 0')}\n"
                f"    or on (job_name, rank)\n"
                f"    {by_rank(m('mindformers_train_checkpoint_interval_seconds'))}")
    return alert(
        cfg, "MindFormersCheckpointTooOld",
        f"(\n  {age}\n)\n> on (job_name, rank) group_left ()\nclamp_min(\n"
        f"  {num(cfg.checkpoint_interval_factor)} * (\n    {interval}\n  ),\n"
        f"  {cfg.checkpoint_max_age_seconds}\n)\n"
        f"and on (job_name, rank) ({m('mindformers_train_status')} == {STATUS_RUNNING})",
        cfg.checkpoint_for, "warning", "No recent checkpoint.",
        f"{WHO} has saved no checkpoint for {{{{ $value | humanizeDuration }}}} of training "
        f"(threshold: the larger of {cfg.checkpoint_max_age_seconds}s and "
        f"{num(cfg.checkpoint_interval_factor)} x its checkpoint interval): a crash now would "
        "lose all of it. Saves are failing, hang, or are configured too rarely.")


#: How long a rank may show on two targets before it warns: a rank restarted at another
#: address while its old process lingers (30 s) is not a duplicate.
RANK_DUPLICATED_FOR = "5m"


def _rank_duplicated(cfg: RulesConfig) -> dict[str, Any]:
    """A (job_name, rank) on two or more targets: one target in two scrape jobs, or two runs
    sharing a job_name. The rules evaluate then and the records count the rank once
    (tests/unit/test_duplicate_targets.py), but its pages come once per target."""
    status = cfg.m("mindformers_train_status")
    # (sorted by address and job: one label, as the query's order of ties varies)
    targets = ("{{ range $i, $e := printf \"label_join(mindformers_train_status{job_name='%s',"
               "rank='%s'}, 'target', ' ', 'instance', 'job')\" "
               "$labels.job_name $labels.rank | query | sortByLabel \"target\" }}"
               "{{ if $i }},{{ end }} {{ .Labels.instance }} (scrape job "
               "{{ .Labels.job }}){{ end }}")
    return alert(
        cfg, "MindFormersRankDuplicated",
        f"count by (job_name, rank) ({status}) > 1", RANK_DUPLICATED_FOR, "warning",
        "A rank is exposed by more than one scrape target.",
        f"{WHO} is exposed by {{{{ $value }}}} targets:" + targets + ". mfotel's records and "
        "dashboards count it once, but a page about it comes once per target, and two runs "
        "under one job_name mix their numbers. If one target is in two scrape jobs, keep one; "
        "if two runs share the job_name, give each its own.")


#: How long a stage of mfotel's export must keep failing (an error in every 5 minutes) before
#: it warns: a collector restarting or a disk briefly full is not a ticket.
EXPORT_FAILING_FOR, EXPORT_FAILING_WINDOW = "15m", "5m"


def _export_failing(cfg: RulesConfig) -> dict[str, Any]:
    """A stage of mfotel's export (mfotel_export_errors_total{stage}) that keeps failing on a
    job's ranks: training goes on (the errors are swallowed, each stage warned about once in
    the rank's log), but what that stage delivers is missing. One alert per job and stage."""
    errors = by_rank(f"increase({cfg.m('mfotel_export_errors_total')}"
                     f"[{EXPORT_FAILING_WINDOW}])", "job_name, rank, stage")
    ranks = query_value(f"count(max by (rank) (increase(mfotel_export_errors_total{{job_name="
                        f"'%s',stage='%s'}}[{EXPORT_FAILING_WINDOW}])) > 0)",
                        "job_name", "stage")
    return alert(
        cfg, "MindFormersExportFailing",
        f"sum by (job_name, stage) (\n  {errors}\n) > 0", EXPORT_FAILING_FOR, "warning",
        "A stage of mfotel's export keeps failing.",
        f"{JOB}: mfotel's {{{{ $labels.stage }}}} stage failed {{{{ $value | printf \"%.0f\" }}}} "
        f"time(s) in the last {EXPORT_FAILING_WINDOW} on " + ranks + " rank(s), and in every "
        f"{EXPORT_FAILING_WINDOW} for {EXPORT_FAILING_FOR}. Training goes on (mfotel swallows "
        "the errors and warned once in each rank's log), but what that stage delivers is "
        "missing: otlp the pushed metrics, alertmanager the NaN fast path, sink the monitor "
        "log, callback or extract the step's values.")


# ---------------------------------------------------------------- rendering
class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)

_HEADER = ("# Generated by `mfotel rules` (mfotel/alerting/rules.py) from "
           "RulesConfig{overrides}.\n"
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
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in render_rules(config).items():
        (out / name).write_text(text, encoding="utf-8")
        written.append(out / name)
    return written


def stale_rule_files(out_dir: str | Path, config: RulesConfig | None = None) -> list[str]:
    """Names of the files in `out_dir` that differ from what `config` generates."""
    out = Path(out_dir)
    return [name for name, text in render_rules(config).items()
            if not (out / name).is_file() or (out / name).read_text(encoding="utf-8") != text]
