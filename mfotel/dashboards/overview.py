"""Training overview: is the job learning, how fast, and when will it finish."""
from __future__ import annotations

from typing import TypedDict

from . import goodput
from .common import (
                     ALERTS_ANNOTATION,
                     FINITE_GRAD_NORM,
                     FINITE_LOSS,
                     FINITE_TEXTS,
                     GRAD_NORM_NONFINITE,
                     JOB,
                     LOSS_NONFINITE,
                     NEUTRAL,
                     STATUS_TEXTS,
                     STEP,
                     Annotation,
                     DashboardSpec,
                     Panel,
                     PanelKind,
                     Row,
                     Target,
                     nonfinite_bars,
                     rank_lines,
                     sel,
                     worst_status,
)

_RATE = "[$__rate_interval]"
_SAMPLES_PER_S = "suffix: samples/s"
_TOKENS_PER_S = "suffix: tokens/s"
_SAMPLES_RULE = "job_name:mindformers_train_samples:rate1m"
_PROGRESS_RULE = "job_name:mindformers_train_progress_ratio:min"   # the slowest rank's
_TOKENS_RULE = "job_name:mindformers_train_tokens:rate1m"
_LOSS_SCALE = "a run that reports its loss scale (mindformers loss-scale training cells)"


class _Shape(TypedDict):
    """Keyword arguments shared by panels of one shape (`Panel(..., **_STAT)`)."""
    kind: PanelKind
    height: int


_STAT: _Shape = {"kind": "stat", "height": 5}

progress = Row("Progress", (
    Panel("Global step", "none", (Target(f"max by (job_name) ({sel('mindformers_train_step')})",
                                         JOB),), width=3, thresholds=NEUTRAL, **_STAT),
    Panel("Epoch", "none", (Target(f"max by (job_name) ({sel('mindformers_train_epoch')})",
                                   JOB),), width=3, thresholds=NEUTRAL, **_STAT),
    Panel("Progress", "percentunit",
          (Target(sel(_PROGRESS_RULE, rank=False), JOB),),
          width=3, min=0, max=1, thresholds=((None, "blue"), (1, "green")),
          description="Completed fraction of the run (slowest rank).", **_STAT),
    Panel("ETA", "s",
          (Target(f"(1 - {sel(_PROGRESS_RULE, rank=False)}) / "
                  f"(deriv({sel(_PROGRESS_RULE, rank=False)}{_RATE}) > 0)", JOB),),
          width=3, thresholds=NEUTRAL,
          description="Remaining fraction divided by the recent progress rate (slowest rank). "
                      "Empty once no rank makes progress.", **_STAT),
    Panel("Throughput", _SAMPLES_PER_S, (Target(sel(_SAMPLES_RULE, rank=False), JOB),),
          width=4, thresholds=((None, "red"), (1e-9, "green")),
          description="Samples per second of the whole job over the last minute (red: none).",
          **_STAT),
    Panel("Loss finite", "none",
          (Target(f"min by (job_name) ({sel('mindformers_train_loss_finite')})", JOB),),
          width=4, value_texts=FINITE_TEXTS, thresholds=((None, "red"), (1, "green")),
          description="Whether the last loss of every selected rank was finite.", **_STAT),
    Panel("First non-finite step", "none",
          (Target(f"min by (job_name) ({sel('mindformers_train_first_nonfinite_step')})", JOB),),
          width=4, thresholds=((None, "red"),), needs="a NaN/Inf loss (absent in a healthy run)",
          description="The step whose loss first went NaN/Inf (earliest rank).", **_STAT),
    Panel("Status", "none", (
        Target(worst_status(sel('mindformers_train_status')), JOB),
    ), kind="state-timeline", width=24, height=4, value_texts=STATUS_TEXTS,
        description="The worst status of the selected ranks over time: failed beats cancelled "
                    "beats completed beats running beats initialising (graph compilation)."),
))

optimisation = Row("Loss and optimisation", (
    Panel("Loss", "none", (*rank_lines(FINITE_LOSS), *nonfinite_bars(LOSS_NONFINITE, "loss"),
                           STEP),
          log_scale=True,
          description="Loss per rank (min, median and max over ranks when more than 16 are "
                      "selected); red bars where it was NaN/Inf, and there the line stops "
                      "(NaN cannot be drawn; an OTLP push would repeat the last finite value). "
                      "Hover for the step."),
    Panel("Learning rate", "sci",
          (Target(f"max by (job_name) ({sel('mindformers_train_learning_rate')})", JOB), STEP),
          description="Learning rate used by the last recorded step. Hover for the step."),
    Panel("Gradient norm", "none",
          (*rank_lines(FINITE_GRAD_NORM), *nonfinite_bars(GRAD_NORM_NONFINITE, "grad norm"),
           STEP),
          log_scale=True,
          description="Global L2 norm of the gradients per rank; red bars where it was NaN/Inf "
                      "(loss-scale overflow steps included). Hover for the step."),
    Panel("Loss scale", "none", rank_lines(sel("mindformers_train_loss_scale")),
          log_scale=True, needs=_LOSS_SCALE),
))

speed = Row("Throughput and step time", (
    Panel("Samples per second", _SAMPLES_PER_S, (
        Target(f"sum by (job_name) ({sel(_SAMPLES_RULE, rank=False)})", "{{job_name}} total"),
        *rank_lines(f"max by (job_name, rank) "
                    f"(rate({sel('mindformers_train_samples_total')}{_RATE}))"),
    ), description="From the sample counters: the job total (1m) and each rank."),
    Panel("Tokens per second", _TOKENS_PER_S, (
        Target(f"sum by (job_name) ({sel(_TOKENS_RULE, rank=False)})", "{{job_name}} total"),
        *rank_lines(f"max by (job_name, rank) "
                    f"(rate({sel('mindformers_train_tokens_total')}{_RATE}))"),
    ), needs="the sequence length (read from the run or set in the monitor config)"),
    Panel("Step time quantiles", "s", (
        Target(sel("job_name:mindformers_train_step_duration_seconds:quantile1m", rank=False),
               "{{job_name}} p{{quantile}}"),
    ), description="Step-time quantiles over all ranks of the job, 1m window."),
    Panel("Mean step time per rank", "s",
          rank_lines(sel("job_name_rank:mindformers_train_step_duration_seconds:mean1m")),
          description="Mean wall time of one step per rank, 1m window."),
))

health = Row("Health events", (
    Panel("Non-finite steps", "none", (
        Target(f"sum by (job_name, metric) "
               f"(increase({sel('mindformers_train_nonfinite_total')}{_RATE}))",
               "{{job_name}} {{metric}}"),
    ), description="Steps whose loss or grad norm was NaN/Inf, summed over the ranks."),
    Panel("Loss-scale overflow steps", "none", (
        Target(f"sum by (job_name) (increase({sel('mindformers_train_overflow_total')}{_RATE}))",
               JOB),
    ), needs=_LOSS_SCALE),
))

_CHECKPOINTING = ("a checkpoint callback (MindSpore ModelCheckpoint or mindformers "
                  "CheckpointMonitor) in the run")
long_run = Row("Checkpoints, evaluation and efficiency", (
    Panel("Time since last checkpoint", "s", (
        Target(f"max by (job_name) (time() - "
               f"{sel('mindformers_train_last_checkpoint_timestamp_seconds')})",
               "{{job_name}} oldest over ranks"),
    ), width=6, needs=_CHECKPOINTING,
        description="Age of the last checkpoint of the rank that saved least recently: the "
                    "training a crash would lose. MindFormersCheckpointTooOld warns."),
    Panel("Checkpoint save time", "s", (
        Target(f"max by (job_name) ({sel('mindformers_train_checkpoint_duration_seconds')})",
               "{{job_name}} slowest rank"),
    ), width=6, needs=_CHECKPOINTING,
        description="Training-thread time of the last save per rank (with async_save, its "
                    "blocking part); the slowest rank."),
    Panel("Training and evaluation loss", "none", (
        Target(f"avg by (job_name) ({FINITE_LOSS})", "{{job_name}} train"),
        Target(f"avg by (job_name) ({sel('mindformers_train_eval_loss')})", "{{job_name}} eval"),
    ), width=12, needs="evaluation during training (mindformers do_eval, Model.fit valid_dataset)",
        description="Mean over ranks of the last recorded training loss and of the last "
                    "evaluation's loss (mindformers_train_eval_step says after which step)."),
    Panel("Tokens per second per device", _TOKENS_PER_S, (
        Target(f"avg by (job_name) "
               f"({sel('mindformers_train_device_throughput_tokens_per_second')})",
               "{{job_name}} mean over devices"),
        Target(f"min by (job_name) "
               f"({sel('mindformers_train_device_throughput_tokens_per_second')})",
               "{{job_name}} slowest device"),
    ), needs="the sequence length (read from the run or set in the monitor config)",
        description="Tokens one device trains per second over the recording interval."),
    Panel("Model FLOPs utilisation (MFU)", "percentunit", (
        Target(f"avg by (job_name) ({sel('mindformers_train_model_flops_utilization_ratio')})",
               "{{job_name}} mean over devices"),
    ), min=0, needs="peak_flops in the monitor config and the model's FLOPs per token",
        description="Achieved model FLOP/s per device over the device's peak (peak_flops); "
                    "FLOPs per token from the model config (6N + 12 L h s) or flops_per_token."),
))

_NOW = "max by (job_name, rank) ({})"
per_rank_row = Row("Per rank", (
    Panel("Ranks now", "none", (
        Target(_NOW.format(sel("mindformers_train_step")), instant=True, column="step"),
        Target(_NOW.format(FINITE_LOSS), instant=True, column="loss"),
        Target(_NOW.format(sel("mindformers_train_loss_finite")), instant=True,
               column="loss finite", value_texts=FINITE_TEXTS),
        Target(_NOW.format(FINITE_GRAD_NORM), instant=True, column="grad norm"),
        Target(_NOW.format(sel("job_name_rank:mindformers_train_step_duration_seconds:mean1m")),
               instant=True, column="step time", unit="s"),
        Target(_NOW.format(sel("mindformers_train_throughput_samples_per_second")),
               instant=True, column="throughput", unit=_SAMPLES_PER_S),
        Target(_NOW.format(f"time() - {sel('mindformers_train_last_step_timestamp_seconds')}"),
               instant=True, column="since last step", unit="s"),
        Target(_NOW.format(sel("mindformers_train_status")), instant=True, column="status",
               value_texts=STATUS_TEXTS),
    ), kind="table", width=24, height=9,
        description="Current values per rank; sort by a column to find the odd one out. A "
                    "rank whose loss is NaN/Inf shows no loss and a red 'loss finite'."),
))

DASHBOARD = DashboardSpec(
    uid="mfotel-training-overview",
    title="MindFormers / Training overview",
    description="Loss, learning rate, grad norm, throughput, step time, progress and goodput "
                "of MindSpore / MindFormers training jobs exported by mfotel.",
    rows=(progress, optimisation, speed, health, long_run, goodput.ROW, per_rank_row),
    annotations=(
        # a region from the first NaN/Inf loss on, titled with its step
        Annotation("First non-finite loss",
                   f'count_values by (job_name) ("step", min by (job_name) '
                   f'({sel("mindformers_train_first_nonfinite_step")}))', "red",
                   "First NaN/Inf loss at step {{step}}", "{{job_name}}", tag_keys="job_name"),
        Annotation("Loss-scale overflow",
                   f"count by (job_name) "
                   f"(increase({sel('mindformers_train_overflow_total')}[1m]) > 0)", "orange",
                   "Loss-scale overflow", "{{job_name}}", tag_keys="job_name"),
        *goodput.ANNOTATIONS,
        ALERTS_ANNOTATION,
    ),
    tags=("mindformers", "training"),
)
