"""The metric contract: every instrument mfotel exposes, in one table (README, "What is exposed").

OTel names are dotted with the unit in the unit field; the Prometheus exporter derives the
exposed name (unit suffix, `_total` on counters). `prometheus_name` is what a scrape shows and
is pinned by tests/unit/test_contract_golden.py, which also checks that an OpenTelemetry
Collector or Prometheus translating our OTLP gets the same names.

Units follow OpenTelemetry: UCUM (`s`), annotations for counted things (`{step}`), `1` only for
true ratios (the collector's translation appends `_ratio` to gauges of unit `1`), and no unit
for dimensionless values that are not ratios (loss, learning rate, norms, loss scale, states).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["gauge", "counter", "histogram"]

#: Label keys on every series. Never `job`/`instance`: Prometheus renames those.
COMMON_LABELS: tuple[str, ...] = ("job_name", "rank")

#: Seed metric names accepted in `monitor_config.metrics`.
SEED_METRICS: tuple[str, ...] = ("loss", "learning_rate", "grad_norm", "throughput", "step_time")

#: Step-time histogram buckets, seconds (10 ms .. 10 min: CPU toy steps to pipeline steps).
STEP_TIME_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

#: Values of `mindformers_train_status`. Cancelled: ended by SIGTERM / SIGINT (scancel, pod
#: deletion, Ctrl-C), which pages nobody; failed: an exception, or stopped before the last step.
STATUS_INITIALISING, STATUS_RUNNING, STATUS_COMPLETED = 0, 1, 2
STATUS_FAILED, STATUS_CANCELLED = 3, 4


@dataclass(frozen=True)
class MetricSpec:
    key: str                 # short name used in code
    otel_name: str
    unit: str
    kind: Kind
    description: str
    prometheus_name: str     # as exposed (counters without the `_total` sample suffix)
    labels: tuple[str, ...] = ()   # extra label keys beyond COMMON_LABELS
    seed_metric: str | None = None  # gated by monitor_config.metrics; None = always on

    @property
    def sample_name(self) -> str:
        """The sample name in the text exposition (`_total` for counters)."""
        return self.prometheus_name + ("_total" if self.kind == "counter" else "")


def _m(key: str, otel: str, unit: str, kind: Kind, prom: str, description: str,
       labels: tuple[str, ...] = (), seed: str | None = None) -> MetricSpec:
    return MetricSpec(key, otel, unit, kind, description, prom, labels, seed)


CONTRACT: tuple[MetricSpec, ...] = (
    # seed metrics, recorded every step_interval steps when selected
    _m("loss", "mindformers.train.loss", "", "gauge", "mindformers_train_loss",
       "Training loss of the last recorded step, or of a later NaN/Inf step, as it is",
       seed="loss"),
    _m("learning_rate", "mindformers.train.learning_rate", "", "gauge",
       "mindformers_train_learning_rate", "Learning rate used by the last recorded step",
       seed="learning_rate"),
    _m("grad_norm", "mindformers.train.grad_norm", "", "gauge", "mindformers_train_grad_norm",
       "Global L2 norm of the gradients of the last recorded step, or of a later NaN/Inf "
       "step, as it is", seed="grad_norm"),
    _m("throughput", "mindformers.train.throughput.samples", "{sample}/s", "gauge",
       "mindformers_train_throughput_samples_per_second",
       "Samples per second over the last recording interval", seed="throughput"),
    _m("samples", "mindformers.train.samples", "{sample}", "counter",
       "mindformers_train_samples", "Samples processed by this rank", seed="throughput"),
    _m("tokens", "mindformers.train.tokens", "{token}", "counter", "mindformers_train_tokens",
       "Tokens processed by this rank (needs the sequence length)", seed="throughput"),
    _m("step_duration", "mindformers.train.step.duration", "s", "histogram",
       "mindformers_train_step_duration_seconds",
       "Wall time of each step, from the step-begin to the step-end hook (README, Time figures)",
       seed="step_time"),
    _m("device_tokens", "mindformers.train.device.throughput.tokens", "{token}/s", "gauge",
       "mindformers_train_device_throughput_tokens_per_second",
       "Tokens per second per device over the last recording interval (needs the sequence "
       "length)", seed="throughput"),
    _m("mfu", "mindformers.train.model_flops_utilization.ratio", "1", "gauge",
       "mindformers_train_model_flops_utilization_ratio",
       "Model FLOPs utilisation, 0..1: achieved model FLOP/s per device over peak_flops "
       "(needs FLOPs per token and peak_flops)", seed="throughput"),
    # health signals, every step
    _m("step", "mindformers.train.step", "{step}", "gauge", "mindformers_train_step",
       "Last completed global step"),
    _m("steps", "mindformers.train.steps", "{step}", "counter", "mindformers_train_steps",
       "Steps completed by this process"),
    _m("last_step_timestamp", "mindformers.train.last_step.timestamp", "s", "gauge",
       "mindformers_train_last_step_timestamp_seconds",
       "Unix time of the last completed step"),
    # job-level signals (who waits for whom): what one rank does between and inside steps
    _m("step_outside", "mindformers.train.step.outside", "s", "counter",
       "mindformers_train_step_outside_seconds",
       "Host time outside the timed steps, summed: from one step's end to the next step's "
       "begin (input wait, host work between steps)"),
    _m("step_begin_timestamp", "mindformers.train.step.begin.timestamp", "s", "gauge",
       "mindformers_train_step_begin_timestamp_seconds",
       "Unix time the current or last step began; above last_step_timestamp while the rank "
       "is inside a step"),
    _m("loss_finite", "mindformers.train.loss_finite", "", "gauge",
       "mindformers_train_loss_finite", "1 if the last loss was finite, 0 if NaN or Inf"),
    _m("nonfinite", "mindformers.train.nonfinite", "{step}", "counter",
       "mindformers_train_nonfinite", "Steps where `metric` was NaN or Inf",
       labels=("metric",)),
    _m("overflow", "mindformers.train.overflow", "{step}", "counter",
       "mindformers_train_overflow", "Loss-scale overflow steps"),
    _m("loss_scale", "mindformers.train.loss_scale", "", "gauge",
       "mindformers_train_loss_scale", "Current loss scale"),
    _m("epoch", "mindformers.train.epoch", "{epoch}", "gauge", "mindformers_train_epoch",
       "Current epoch"),
    _m("progress", "mindformers.train.progress.ratio", "1", "gauge",
       "mindformers_train_progress_ratio", "Completed fraction of the run, 0..1"),
    _m("status", "mindformers.train.status", "", "gauge", "mindformers_train_status",
       "0 initialising, 1 running, 2 completed, 3 failed or stopped, 4 cancelled"),
    _m("first_nonfinite_step", "mindformers.train.first_nonfinite_step", "{step}", "gauge",
       "mindformers_train_first_nonfinite_step", "Step at which the loss first went NaN/Inf"),
    _m("start_timestamp", "mindformers.train.start.timestamp", "s", "gauge",
       "mindformers_train_start_timestamp_seconds",
       "Unix time this process began training (train begin)"),
    _m("end_timestamp", "mindformers.train.end.timestamp", "s", "gauge",
       "mindformers_train_end_timestamp_seconds",
       "Unix time this process's training ended, and why: completed, failed (an exception), "
       "stopped (asked to stop early, or ran out before its last step), cancelled (a signal)",
       labels=("reason",)),
    # the time account (mfotel.time_account): where each second of this process went
    _m("time", "mindformers.train.time", "s", "counter", "mindformers_train_time_seconds",
       "Wall time of this process by phase (startup, step, input, checkpoint, evaluation, "
       "stall), summed up to its last event (a step's begin or end, a save, an evaluation, "
       "the end): the phases add up to that event's time minus process_start_timestamp",
       labels=("phase",)),
    _m("process_start_timestamp", "mindformers.train.process_start.timestamp", "s", "gauge",
       "mindformers_train_process_start_timestamp_seconds",
       "Unix time this process started: the origin of its time account"),
    # checkpoints, from the run's checkpoint callback (ModelCheckpoint / CheckpointMonitor)
    _m("last_checkpoint_timestamp", "mindformers.train.last_checkpoint.timestamp", "s", "gauge",
       "mindformers_train_last_checkpoint_timestamp_seconds",
       "Unix time the last checkpoint save of this process returned"),
    _m("checkpoint_duration", "mindformers.train.checkpoint.duration", "s", "gauge",
       "mindformers_train_checkpoint_duration_seconds",
       "Training-thread time of the last checkpoint save (with async_save, its blocking part)"),
    _m("checkpoints", "mindformers.train.checkpoints", "{checkpoint}", "counter",
       "mindformers_train_checkpoints", "Checkpoints saved by this process"),
    _m("checkpoint_interval_steps", "mindformers.train.checkpoint.interval.steps", "{step}",
       "gauge", "mindformers_train_checkpoint_interval_steps",
       "Configured steps between checkpoints (save_checkpoint_steps)"),
    _m("checkpoint_interval_seconds", "mindformers.train.checkpoint.interval", "s", "gauge",
       "mindformers_train_checkpoint_interval_seconds",
       "Configured seconds between checkpoints (save_checkpoint_seconds, when saving by time)"),
    # evaluation during training
    _m("eval_loss", "mindformers.train.eval.loss", "", "gauge", "mindformers_train_eval_loss",
       "Loss of the last evaluation during training"),
    _m("eval_step", "mindformers.train.eval.step", "{step}", "gauge", "mindformers_train_eval_step",
       "Global training step after which the last evaluation ran"),
    _m("eval_duration", "mindformers.train.eval.duration", "s", "gauge",
       "mindformers_train_eval_duration_seconds", "Wall time of the last evaluation"),
    _m("rank_info", "mindformers.train.rank_info", "", "gauge", "mindformers_train_rank_info",
       "Identity of this rank, for joins with device exporters (value 1)",
       labels=("local_rank", "node", "device_id", "host", "world_size")),
    _m("actions", "mindformers.train.actions", "{action}", "counter", "mindformers_train_actions",
       "Monitor-driven actions applied (stop, scale_lr, warn) by source (plateau, nonfinite, "
       "control, alert)", labels=("action", "source")),
    _m("export_errors", "mfotel.export.errors", "{error}", "counter", "mfotel_export_errors",
       "Errors swallowed by mfotel to protect training", labels=("stage",)),
)

#: prometheus_client's standard process collector of the training process, served beside the
#: contract with the `job_name` and `rank` labels (not at `cardinality: health`; not pushed
#: over OTLP): Prometheus family name -> kind. The counter's sample is `_total`.
PROCESS_SERIES: dict[str, Kind] = {
    "process_cpu_seconds": "counter",             # user + system CPU time
    "process_resident_memory_bytes": "gauge",     # RSS
    "process_virtual_memory_bytes": "gauge",
    "process_start_time_seconds": "gauge",        # unix time the process started
    "process_open_fds": "gauge",
    "process_max_fds": "gauge",
}

BY_KEY: dict[str, MetricSpec] = {spec.key: spec for spec in CONTRACT}


def spec(key: str) -> MetricSpec:
    return BY_KEY[key]


def finite_samples(expr: str) -> str:
    """PromQL keeping only the finite samples of `expr` (NaN and ±Inf each fail one of the
    two comparisons): the loss and the gradient norm are exposed as they are, and one NaN or
    Inf would make an average, a sum or a deviation NaN or Inf."""
    return f"(({expr}) > -Inf < +Inf)"
