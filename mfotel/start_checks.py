"""Checks at train begin, against the run MindSpore is about to train (no MindSpore import).

The document was checked when the monitor was built (mfotel.config); these need the run:

    shape = run_shape(cb_params, cfg.batch_size)      # total steps, batch size
    for key, message in start_warnings(cfg, shape, world_size=8, device_samples=8.0,
                                       flops_per_token=None):
        warn_once(key, message)

Each warning names the key to change; none of them stops training.
"""
from __future__ import annotations

from typing import Any, NamedTuple

from .config import MonitorConfig
from .extract import cb_param


class RunShape(NamedTuple):
    total_steps: int | None   # epochs x steps per epoch, when the run tells
    batch_size: int | None    # samples per step on this rank


def run_shape(cb: Any, batch_size: int | None = None) -> RunShape:
    """The run's length and batch size from `cb_params` (`batch_size` given wins)."""
    epochs, per_epoch = cb_param(cb, "epoch_num"), cb_param(cb, "batch_num")
    total = None
    if isinstance(epochs, int) and isinstance(per_epoch, int) and epochs * per_epoch > 0:
        total = epochs * per_epoch
    if batch_size is None:
        dataset = cb_param(cb, "train_dataset")
        try:
            batch_size = int(dataset.get_batch_size()) if dataset is not None else None
        except Exception:  # noqa: BLE001 - some datasets cannot tell
            batch_size = None
    return RunShape(total, batch_size)


def start_warnings(cfg: MonitorConfig, shape: RunShape, world_size: int,
                   device_samples: float | None, flops_per_token: float | None
                   ) -> list[tuple[str, str]]:
    """(key, message) of each problem found; `device_samples` are the samples one device
    trains per step and `flops_per_token` the model's, both for MFU."""
    found: list[tuple[str, str]] = []
    total = shape.total_steps
    if total is not None and cfg.step_interval > total:
        found.append(("interval", f"mfotel: step_interval {cfg.step_interval} is larger than "
                      f"the run's {total} steps: seed metrics will never be recorded. Fix: "
                      f"lower monitor_config.step_interval"))
    if cfg.log_rank is not None and all(r >= world_size for r in cfg.log_rank):
        found.append(("log_rank", f"mfotel: log_rank {list(cfg.log_rank)} is outside the world "
                      f"size {world_size}: no rank writes monitor lines. Fix: use a rank below "
                      f"{world_size} or -1"))
    if "throughput" in cfg.metrics and not shape.batch_size:
        found.append(("batch", "mfotel: throughput needs the batch size, which this run does "
                      "not report. Fix: set monitor_config.batch_size"))
    missing = mfu_missing(cfg, device_samples, flops_per_token)
    if missing:
        found.append(("mfu", f"mfotel: peak_flops is set but MFU needs {', '.join(missing)}; "
                      f"mindformers_train_model_flops_utilization_ratio stays absent"))
    return found


def mfu_missing(cfg: MonitorConfig, device_samples: float | None,
                flops_per_token: float | None) -> list[str]:
    """What MFU lacks when peak_flops asks for it ([] when it can be computed or is off)."""
    if not cfg.peak_flops:
        return []
    return [what for what, ok in (
        ("throughput in monitor_config.metrics", "throughput" in cfg.metrics),
        ("the sequence length (monitor_config.seq_length)", bool(cfg.seq_length)),
        ("the batch size (monitor_config.batch_size)", bool(device_samples)),
        ("the model's FLOPs per token (monitor_config.flops_per_token)", bool(flops_per_token)),
    ) if not ok]
