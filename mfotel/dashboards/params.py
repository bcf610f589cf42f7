"""Parameter health: mindformers-native norms and losses (TrainingStateMonitor outputs).

Every panel but the global gradient norm needs mindformers' native monitoring
(`monitor_config` with `weight_state_format`, `optimizer_state_format`, `local_norm_format`,
`local_loss_format`, `device_local_loss_format`, `throughput_baseline`) bridged by mfotel.
"""
from __future__ import annotations

from .common import (
    ALERTS_ANNOTATION,
    FINITE_GRAD_NORM,
    DashboardSpec,
    Panel,
    Row,
    Target,
    rank_lines,
    sel,
)

TOP_K = 10


def _native(fmt: str) -> str:
    return f"mindformers native monitoring with monitor_config.{fmt} set"


norms = Row("Norms", (
    Panel("Global gradient norm", "none", rank_lines(FINITE_GRAD_NORM),
          description="Recorded by mfotel itself, for comparison with the native norms; the "
                      "line stops where it was NaN/Inf."),
    Panel("Weight norm", "none", rank_lines(sel("mindformers_train_weight_norm")),
          description="L2 norm of all weights.", needs=_native("weight_state_format")),
    Panel(f"Optimizer state norms (top {TOP_K})", "none", (
        Target(f"topk({TOP_K}, max by (job_name, param, state) "
               f"({sel('mindformers_train_optimizer_state_norm')}))",
               "{{job_name}} {{param}} {{state}}"),
    ), description="Largest per-parameter norms of the optimizer moments (adam_m, adam_v).",
        needs=_native("optimizer_state_format")),
    Panel(f"Local gradient norms (top {TOP_K} parameters)", "none", (
        Target(f"topk({TOP_K}, max by (job_name, param) "
               f"({sel('mindformers_train_local_norm')}))", "{{job_name}} {{param}}"),
    ), description="Largest per-parameter gradient norms, maximum over the selected ranks.",
        needs=_native("local_norm_format")),
    Panel(f"Largest local norms now (top {TOP_K})", "none", (
        Target(f"sort_desc(topk({TOP_K}, max by (job_name, param) "
               f"({sel('mindformers_train_local_norm')})))", "{{job_name}} {{param}}",
               instant=True),
    ), kind="bargauge", width=24, needs=_native("local_norm_format")),
))

losses = Row("Local losses and scaling", (
    Panel("Local loss per rank", "none", rank_lines(sel("mindformers_train_local_loss")),
          needs=_native("local_loss_format")),
    Panel("Device accumulated local loss", "none",
          rank_lines(sel("mindformers_train_device_local_loss")),
          needs=_native("device_local_loss_format")),
    Panel("Throughput linearity", "percentunit",
          rank_lines(sel("mindformers_train_throughput_linearity")),
          description="Per-device throughput relative to the configured baseline (100% = "
                      "baseline).", needs=_native("throughput_baseline")),
))

DASHBOARD = DashboardSpec(
    uid="mfotel-parameter-health",
    title="MindFormers / Parameter health",
    description="Weight, optimizer-state and local gradient norms and local losses from "
                "mindformers' native training-state monitoring, bridged by mfotel.",
    rows=(norms, losses),
    annotations=(ALERTS_ANNOTATION,),
    tags=("mindformers", "parameters"),
)
