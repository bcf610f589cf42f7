"""Cluster health: which ranks run, which are slow, which stalled, which diverge."""
from __future__ import annotations

from collections.abc import Callable

from ..contract import finite_samples
from .common import (
    ALERTS_ANNOTATION,
    FINITE_LOSS,
    FINITE_TEXTS,
    IN_STEP_TEXTS,
    JOB,
    RANK,
    RUN_MATCHER,
    STATUS_TEXTS,
    DashboardSpec,
    Panel,
    Row,
    Step,
    Target,
    ValueText,
    over_ranks,
    per_rank,
    rank_lines,
    sel,
    worst_status,
)

_RATE = "[$__rate_interval]"
_MEAN = "job_name_rank:mindformers_train_step_duration_seconds:mean1m"
_MEDIAN = "job_name:mindformers_train_step_duration_seconds:rank_median1m"
_SPREAD = "job_name:mindformers_train_step_duration_seconds:rank_spread1m"
# who waits for whom (docs/alerting.md, "Job-level truth")
_OUTSIDE = "job_name_rank:mindformers_train_step_outside:ratio1m"
_WAITED_FOR = "job_name_rank:mindformers_train_waited_for:ratio1m"
_IN_STEP = "job_name_rank:mindformers_train_in_step:bool"
_FIRST_NONFINITE = "job_name:mindformers_train_first_nonfinite_step:min"
_RANK_P99 = "job_name_rank:mindformers_train_step_duration_seconds:quantile1m"
# one series per job (and status): what the panels below would otherwise aggregate over every
# rank at each point of their range (seconds per query at 1024 ranks, docs/scaling.md)
_BY_STATUS = "job_name_status:mindformers_train_ranks:count"
_PROGRESS = "job_name:mindformers_train_progress_ratio:min"
_SLOWEST = "job_name:mindformers_train_rank_info:slowest1m"


def _ranks_in(status: int, title: str, description: str,
              thresholds: tuple[Step, ...]) -> Panel:
    # A job with no rank in `status` has no such count: 0 then, while the job reports.
    count = sel(_BY_STATUS, f'status="{status}"', rank=False)
    return Panel(title, "none", (Target(
        f"sum by (job_name) ({count}) or 0 * {sel(_PROGRESS, rank=False)}", JOB),),
        kind="stat", width=6, height=5, thresholds=thresholds,
        description=description + " All ranks of the job (recording rule; the rank filter "
                                  "does not apply).")


def _per_rank_state(metric: str, worst: Callable[[str], str], texts: tuple[ValueText, ...],
                    title: str, description: str) -> Panel:
    """A state timeline: a row per rank while few are selected, the job's `worst` otherwise."""
    return Panel(title, "none", (
        Target(per_rank(f"max by (job_name, rank) ({sel(metric)})"), RANK),
        Target(over_ranks(worst(sel(metric))), "{{job_name}} worst rank"),
    ), kind="state-timeline", value_texts=texts, description=description)


#: Targets (job, instance) that served each selected job in the last 10 minutes (a rank that
#: stopped answering has no series now, so its identity is remembered that long).
_JOB_TARGETS = (f"max by (job, instance, job_name) "
                f"(max_over_time({sel('mindformers_train_rank_info', RUN_MATCHER, rank=False)}"
                f"[10m]))")


def _slowest_rank_device(labels: str, *matchers: str) -> str:
    """rank_info of the rank each job waits for most, `labels` kept, value 1."""
    return f"max by (job_name, rank, {labels}) ({sel(_SLOWEST, *matchers, rank=False)})"


# NPU-Exporter labels a chip `id` (its physical index, = rank_info's device_id) and, in
# Kubernetes, the `namespace`/`pod_name` using it; on bare metal its target host stands in for
# rank_info's `node`. dcgm-exporter labels `gpu` and `Hostname`. The pod_name matchers keep
# the Kubernetes and bare-metal joins apart (chip ids repeat on every node).
_DEVICE_UTILISATION = (
    Target("npu_chip_info_utilization * on (namespace, pod_name, id) "
           "group_left (job_name, rank) label_replace("
           + _slowest_rank_device("namespace, pod_name, device_id", 'pod_name!=""')
           + ', "id", "$1", "device_id", "(.*)")',
           "{{job_name}} rank {{rank}} npu {{id}}"),
    Target('label_replace(npu_chip_info_utilization, "node", "$1", "instance", "([^:]+):.*") '
           "* on (node, id) group_left (job_name, rank) label_replace("
           + _slowest_rank_device("node, device_id", 'pod_name=""')
           + ', "id", "$1", "device_id", "(.*)")',
           "{{job_name}} rank {{rank}} npu {{id}}"),
    Target("DCGM_FI_DEV_GPU_UTIL * on (Hostname, gpu) group_left (job_name, rank) "
           "label_replace(label_replace("
           + _slowest_rank_device("node, device_id")
           + ', "gpu", "$1", "device_id", "(.*)"), "Hostname", "$1", "node", "(.*)")',
           "{{job_name}} rank {{rank}} gpu {{gpu}}"),
)


def _deviation(metric: str) -> str:
    """The rank's value minus the mean over all ranks of its job, both of finite values (one
    rank's NaN loss would make the mean, hence every rank's deviation, NaN)."""
    return (f"{finite_samples(sel(metric))} - on (job_name) group_left () "
            f"avg by (job_name) ({finite_samples(sel(metric, rank=False))})")


ranks = Row("Ranks", (
    _ranks_in(0, "Ranks initialising", "Before the first step (graph compilation).",
              ((None, "blue"),)),
    _ranks_in(1, "Ranks running", "Ranks whose last report says running.", ((None, "green"),)),
    _ranks_in(2, "Ranks completed", "Ranks that finished their run normally.",
              ((None, "purple"),)),
    _ranks_in(3, "Ranks failed or stopped", "Ranks that stopped early or failed.",
              ((None, "green"), (1, "red"))),
    _ranks_in(4, "Ranks cancelled", "Ranks ended by SIGTERM / SIGINT (scancel, pod deletion, "
              "Ctrl-C): pages nobody.", ((None, "green"), (1, "orange"))),
    Panel("Ranks running over time", "none", (
        Target(sel("job_name:mindformers_train_ranks_running:count", rank=False),
               "{{job_name}} running"),
    ), description="Ranks reporting status running (recording rule)."),
    Panel("Scrape targets up", "none", (
        Target(f"sum by (job_name) (up * on (job, instance) group_left (job_name) "
               f"{_JOB_TARGETS})", "{{job_name}} up", run_scoped=False),
        Target(f"sum by (job_name) ((1 - up) * on (job, instance) group_left (job_name) "
               f"{_JOB_TARGETS})", "{{job_name}} down", run_scoped=False),
    ), description="Prometheus scrape targets of the selected jobs (and run): those whose "
                   "ranks reported in the last 10 minutes, up or down now."),
))

stragglers = Row("Step time and stragglers", (
    Panel("Median rank step time", "s", (
        Target(sel(_MEDIAN, rank=False), "{{job_name}} median rank"),
    ), width=6, description="Median over ranks of the per-rank mean step time, 1m window. In "
                            "synchronous training every rank leaves the step's collective "
                            "together: a slow rank lengthens every rank's step."),
    Panel("Step-time spread", "percentunit", (
        Target(sel(_SPREAD, rank=False), "{{job_name}} slowest / fastest"),
    ), width=6, description="Mean step time of the slowest rank divided by the fastest's "
                            "(100% = all equal), 1m window. A rank that waits for its input "
                            "has the shortest step: the others wait for it inside theirs."),
    Panel("Slowest rank: the one the others wait for", "percentunit", (
        Target(f"sort_desc(topk(10, {sel(_WAITED_FOR)} > 0))", RANK, instant=True),
    ), kind="bargauge", min=0, max=1,
        description="The ranks the others wait for most: their time outside the training "
                    "step (input, host work between steps) above the job's median rank's, 1m "
                    "window. MindFormersStragglerRank names a running rank above 10% for 10m. "
                    "A rank slow inside the step (compute, its device) is not here: it slows "
                    "every rank's step equally (step time, throughput)."),
    Panel("Waiting vs waited-for per rank", "percentunit", rank_lines(sel(_WAITED_FOR)),
          min=-1, max=1,
          description="Time outside the step above the job's median rank's, 1m window: above "
                      "0 the others wait for this rank, below 0 it waits for them (inside its "
                      "own step, in the collective). Recording rule."),
    Panel("Time outside the step per rank", "percentunit", rank_lines(sel(_OUTSIDE)),
          min=0, max=1,
          description="Share of wall time a rank spends between its steps (from one step's "
                      "end to the next step's begin: waiting for input, host work), 1m "
                      "window. Every rank high: the job is input-bound."),
    Panel("Device of the slowest rank: utilisation", "percent", _DEVICE_UTILISATION,
          description="Utilisation of the NPU or GPU behind the rank each job waits for "
                      "most, joined through mindformers_train_rank_info: "
                      "NPU-Exporter in Kubernetes (namespace, pod_name, id) or on bare metal "
                      "(target host, id), dcgm-exporter (Hostname, gpu).",
          needs="MindCluster NPU-Exporter or dcgm-exporter scraped by the same Prometheus"),
    Panel("Mean step time per rank", "s", rank_lines(sel(_MEAN)),
          description="Mean wall time of one step per rank, 1m window (a waiting rank's step "
                      "includes its wait)."),
    Panel("p99 step time per rank", "s", rank_lines(sel(_RANK_P99, 'quantile="0.99"')),
          description="From each rank's step-time histogram buckets, 1m window (recording "
                      "rule: computed from the buckets at query time, 1024 ranks took 22 s "
                      "per refresh)."),
))

stalls = Row("Stalls", (
    Panel("Time since last step", "s",
          rank_lines(f"time() - {sel('mindformers_train_last_step_timestamp_seconds')}"),
          description="Grows without bound on a stalled (or finished) rank."),
    Panel("Steps per second", "suffix: steps/s",
          rank_lines(f"rate({sel('mindformers_train_steps_total')}{_RATE})")),
    Panel("Steps behind the leading rank", "none", rank_lines(
        f"max by (job_name) ({sel('mindformers_train_step', rank=False)}) "
        f"- on (job_name) group_right () {sel('mindformers_train_step')}"),
        description="Global step of the job's most advanced rank minus this rank's."),
    _per_rank_state("mindformers_train_status", worst_status, STATUS_TEXTS, "Status per rank",
                    "Initialising (graph compilation), running, completed, failed or stopped, "
                    "cancelled (SIGTERM/SIGINT); "
                    "with more than 16 ranks selected, the worst rank's."),
    _per_rank_state(_IN_STEP, lambda s: f"min by (job_name) ({s})", IN_STEP_TEXTS,
                    "Inside a step per rank",
                    "Whether each rank is inside a step (it began one after the last ended) "
                    "or between steps. A stalled job: the ranks inside the step wait in its "
                    "collective for the ones that are not. With more than 16 ranks selected, "
                    "whether any rank is between steps."),
    Panel("Inside the current step since", "s", rank_lines(
        f"time() - {sel('mindformers_train_step_begin_timestamp_seconds')} "
        f"and on (job_name, rank) ({sel(_IN_STEP)} == 1)"),
        description="Seconds since each rank began the step it is in (no value between "
                    "steps). Growing on every rank but one: the others wait for that one."),
))

divergence = Row("Divergence across ranks", (
    Panel("Loss deviation from the job mean", "none", rank_lines(
        f"({_deviation('mindformers_train_loss')}) and on (job_name, rank) ({FINITE_LOSS})"),
        description="Finite loss of each rank minus the mean over the job's ranks."),
    Panel("Grad norm deviation from the job mean", "none",
          rank_lines(_deviation("mindformers_train_grad_norm"))),
    _per_rank_state("mindformers_train_loss_finite", lambda s: f"min by (job_name) ({s})",
                    FINITE_TEXTS, "Loss finite per rank",
                    "Finite while the last loss was, NaN / Inf after a non-finite loss; with "
                    "more than 16 ranks selected, whether any rank's is."),
    Panel("Where a non-finite loss started", "none", (
        Target(f"max by (job_name, rank) ({sel('mindformers_train_first_nonfinite_step')}) "
               f"== on (job_name) group_left () {sel(_FIRST_NONFINITE, rank=False)}",
               instant=True, column="first non-finite step"),
    ), kind="table", width=6,
        description="The rank(s) whose loss went NaN/Inf first, and at which step (the other "
                    "ranks follow a step later: the gradient all-reduce carries it). "
                    "MindFormersLossNotFinite names them."),
    Panel("First non-finite loss step per rank", "none", rank_lines(
        f"max by (job_name, rank) ({sel('mindformers_train_first_nonfinite_step')})",
        many=(("min by (job_name) ({})", "{{job_name}} first"),
              ("count by (job_name) ({})", "{{job_name}} ranks non-finite"))),
        width=6, description="The step at which each rank's loss first went NaN/Inf: the "
                             "lowest is where the incident started."),
    Panel("Non-finite steps per rank", "none", rank_lines(
        f"max by (job_name, rank, metric) ({sel('mindformers_train_nonfinite_total')})",
        "{{job_name}} rank {{rank}} {{metric}}",
        many=(("sum by (job_name, metric) ({})", "{{job_name}} {{metric}} all ranks"),)),
        description="Steps since the start whose loss or grad norm was NaN/Inf."),
))

exporter = Row("mfotel exporter", (
    Panel("Export errors", "none", (
        Target(f"sum by (job_name, stage) (max by (job_name, rank, stage) "
               f"(increase({sel('mfotel_export_errors_total')}{_RATE})))",
               "{{job_name}} {{stage}}"),
    ), description="Errors mfotel swallowed to protect training, by stage."),
    Panel("Rank identity", "none", (
        Target(sel("mindformers_train_rank_info"), instant=True),
    ), kind="table", description="Labels that join a rank to its host and device exporters "
                                 "(and its run_id, attempt with a run identity)."),
))

DASHBOARD = DashboardSpec(
    uid="mfotel-cluster-health",
    title="MindFormers / Cluster health",
    description="Ranks up and running, step-time spread and stragglers, stalls and per-rank "
                "divergence of MindSpore / MindFormers training jobs.",
    rows=(ranks, stragglers, stalls, divergence, exporter),
    annotations=(ALERTS_ANNOTATION,),
    tags=("mindformers", "cluster"),
)
