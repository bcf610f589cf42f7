"""Training overview: is the job learning, how fast, and when will it finish."""
from __future__ import annotations

from .common import (ALERTS_ANNOTATION, JOB, RANK, Annotation, DashboardSpec, Panel, Row,
                     Target, ValueText, sel)

_RATE = "[$__rate_interval]"
_SAMPLES_PER_S = "suffix: samples/s"
_TOKENS_PER_S = "suffix: tokens/s"
_SAMPLES_RULE = "job_name:mindformers_train_samples:rate1m"
_TOKENS_RULE = "job_name:mindformers_train_tokens:rate1m"
_LOSS_SCALE = "a run that reports its loss scale (mindformers loss-scale training cells)"

STATUS_TEXTS = (
    ValueText(0, "initialising", "blue"),
    ValueText(1, "running", "green"),
    ValueText(2, "completed", "purple"),
    ValueText(3, "failed / stopped", "red"),
)

progress = Row("Progress", (
    Panel("Global step", "none", (Target(f"max by (job_name) ({sel('mindformers_train_step')})",
                                         JOB),), kind="stat", width=4, height=5),
    Panel("Epoch", "none", (Target(f"max by (job_name) ({sel('mindformers_train_epoch')})",
                                   JOB),), kind="stat", width=3, height=5),
    Panel("Progress", "percentunit",
          (Target(f"min by (job_name) ({sel('mindformers_train_progress_ratio')})", JOB),),
          kind="stat", width=4, height=5, min=0, max=1,
          description="Completed fraction of the run (slowest rank)."),
    Panel("ETA", "s",
          (Target(f"max by (job_name) ((1 - {sel('mindformers_train_progress_ratio')}) / "
                  f"(deriv({sel('mindformers_train_progress_ratio')}{_RATE}) > 0))", JOB),),
          kind="stat", width=4, height=5,
          description="Remaining fraction divided by the recent progress rate (slowest rank). "
                      "Empty once no rank makes progress."),
    Panel("Throughput", _SAMPLES_PER_S,
          (Target(sel(_SAMPLES_RULE, rank=False), JOB),),
          kind="stat", width=5, height=5,
          description="Samples per second of the whole job over the last minute."),
    Panel("Status", "none",
          (Target(f"max by (job_name) ({sel('mindformers_train_status')})", JOB),),
          kind="stat", width=4, height=5, value_texts=STATUS_TEXTS,
          description="The worst status of the selected ranks: failed beats completed beats "
                      "running beats initialising (graph compilation)."),
))

optimisation = Row("Loss and optimisation", (
    Panel("Loss", "none", (Target(sel("mindformers_train_loss"), RANK),),
          description="Last finite loss per rank (a NaN/Inf loss shows as an annotation)."),
    Panel("Learning rate", "sci",
          (Target(f"max by (job_name) ({sel('mindformers_train_learning_rate')})", JOB),),
          description="Learning rate used by the last recorded step."),
    Panel("Gradient norm", "none", (Target(sel("mindformers_train_grad_norm"), RANK),),
          description="Global L2 norm of the gradients per rank."),
    Panel("Loss scale", "none", (Target(sel("mindformers_train_loss_scale"), RANK),),
          needs=_LOSS_SCALE),
))

speed = Row("Throughput and step time", (
    Panel("Samples per second", _SAMPLES_PER_S, (
        Target(f"sum by (job_name) ({sel(_SAMPLES_RULE, rank=False)})",
               "{{job_name}} total"),
        Target(f"sum by (job_name, rank) (rate({sel('mindformers_train_samples_total')}{_RATE}))",
               RANK),
    ), description="From the sample counters: the job total (1m) and each rank."),
    Panel("Tokens per second", _TOKENS_PER_S, (
        Target(f"sum by (job_name) ({sel(_TOKENS_RULE, rank=False)})",
               "{{job_name}} total"),
        Target(f"sum by (job_name, rank) (rate({sel('mindformers_train_tokens_total')}{_RATE}))",
               RANK),
    ), needs="the sequence length (read from the run or set in the monitor config)"),
    Panel("Step time quantiles", "s", (
        Target(sel("job_name:mindformers_train_step_duration_seconds:quantile1m", rank=False),
               "{{job_name}} p{{quantile}}"),
    ), description="Step-time quantiles over all ranks of the job, 1m window."),
    Panel("Mean step time per rank", "s", (
        Target(sel("job_name_rank:mindformers_train_step_duration_seconds:mean1m"), RANK),
    ), description="Mean wall time of one step per rank, 1m window."),
))

health = Row("Health events", (
    Panel("Loss finite", "none",
          (Target(f"min by (job_name) ({sel('mindformers_train_loss_finite')})", JOB),),
          kind="stat", width=6, height=6,
          value_texts=(ValueText(0, "NaN / Inf", "red"), ValueText(1, "finite", "green")),
          description="Whether the last loss of every selected rank was finite."),
    Panel("First non-finite step", "none",
          (Target(f"min by (job_name) ({sel('mindformers_train_first_nonfinite_step')})", JOB),),
          kind="stat", width=6, height=6, needs="a NaN/Inf loss (absent in a healthy run)"),
    Panel("Non-finite steps", "none", (
        Target(f"sum by (job_name, metric) "
               f"(increase({sel('mindformers_train_nonfinite_total')}{_RATE}))",
               "{{job_name}} {{metric}}"),
    ), width=6, height=6, description="Steps whose loss or grad norm was NaN/Inf."),
    Panel("Loss-scale overflow steps", "none", (
        Target(f"sum by (job_name) (increase({sel('mindformers_train_overflow_total')}{_RATE}))",
               JOB),
    ), width=6, height=6, needs=_LOSS_SCALE),
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
        Target(f"avg by (job_name) ({sel('mindformers_train_loss')})", "{{job_name}} train"),
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

per_rank = Row("Per rank", (
    Panel("Ranks now", "none", (
        Target(f"max by (job_name, rank) ({sel('mindformers_train_step')})", instant=True,
               column="step"),
        Target(f"max by (job_name, rank) ({sel('mindformers_train_loss')})", instant=True,
               column="loss"),
        Target(f"max by (job_name, rank) ({sel('mindformers_train_grad_norm')})", instant=True,
               column="grad norm"),
        Target(f"max by (job_name, rank) "
               f"({sel('job_name_rank:mindformers_train_step_duration_seconds:mean1m')})",
               instant=True, column="step time", unit="s"),
        Target(f"max by (job_name, rank) "
               f"({sel('mindformers_train_throughput_samples_per_second')})",
               instant=True, column="throughput", unit=_SAMPLES_PER_S),
        Target(f"max by (job_name, rank) "
               f"(time() - {sel('mindformers_train_last_step_timestamp_seconds')})",
               instant=True, column="since last step", unit="s"),
    ), kind="table", width=24, height=9,
        description="Current values per rank; sort by a column to find the odd one out."),
))

DASHBOARD = DashboardSpec(
    uid="mfotel-training-overview",
    title="MindFormers / Training overview",
    description="Loss, learning rate, grad norm, throughput, step time and progress of "
                "MindSpore / MindFormers training jobs exported by mfotel.",
    rows=(progress, optimisation, speed, health, long_run, per_rank),
    annotations=(
        Annotation("Non-finite loss", f"{sel('mindformers_train_loss_finite')} == 0", "red",
                   "Loss not finite", "{{job_name}} rank {{rank}}"),
        Annotation("Loss-scale overflow",
                   f"increase({sel('mindformers_train_overflow_total')}[1m]) > 0", "orange",
                   "Loss-scale overflow", "{{job_name}} rank {{rank}}"),
        ALERTS_ANNOTATION,
    ),
    tags=("mindformers", "training"),
)
