"""Pure extraction of step values from a train cell's `net_outputs` (no MindSpore import).

Layouts, by tuple length (the one place mfotel guesses them):

| outputs | produced by |
|---|---|
| loss | nn.TrainOneStepCell, WithLossCell |
| (loss, grad_norm) | mfotel.TrainOneStepWithGradNorm |
| (loss, overflow, loss_scale) | nn.TrainOneStepWithLossScaleCell |
| (loss, overflow, loss_scale, lr) | mindformers MFTrainOneStepCell, no clip |
| (loss, overflow, loss_scale, lr, global_norm) | MFTrainOneStepCell with use_clip_grad |
| (loss, overflow, loss_scale, lr, global_norm, local_norm, norm_size) | ... with local norms |
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StepOutputs:
    loss: float | None = None
    grad_norm: float | None = None
    overflow: bool | None = None
    loss_scale: float | None = None
    learning_rate: float | None = None
    local_norm: Any = None  # raw per-parameter norms (mindformers 7-tuple), unconverted


def to_float(value: Any) -> float | None:
    """A Python float from a Tensor, numpy array (mean of its elements) or number; None stays."""
    if value is None:
        return None
    size = getattr(value, "size", 1)
    if size == 1 and hasattr(value, "item"):
        return float(value.item())  # a Tensor's item() is ~30x cheaper than asnumpy()
    if hasattr(value, "asnumpy"):
        value = value.asnumpy()
        size = value.size
    if size == 0:
        return None
    if size != 1 and hasattr(value, "mean"):
        value = value.mean()
    elif hasattr(value, "item"):
        value = value.item()
    return float(value)


def to_bool(value: Any) -> bool | None:
    """True if any element of a Tensor/array/number is truthy."""
    if value is None:
        return None
    if getattr(value, "size", 1) == 1 and hasattr(value, "item"):
        return bool(value.item())
    if hasattr(value, "asnumpy"):
        value = value.asnumpy()
    if hasattr(value, "any"):
        return bool(value.any())
    return bool(value)


def parse_net_outputs(outputs: Any) -> StepOutputs:
    """StepOutputs from `cb_params.net_outputs` (see the module table)."""
    if not isinstance(outputs, (tuple, list)):
        return StepOutputs(loss=to_float(outputs))
    n = len(outputs)
    if n == 0:
        return StepOutputs()
    if n == 2:
        return StepOutputs(loss=to_float(outputs[0]), grad_norm=to_float(outputs[1]))
    if n in (3, 4, 5, 7):
        return StepOutputs(
            loss=to_float(outputs[0]),
            overflow=to_bool(outputs[1]),
            loss_scale=to_float(outputs[2]),
            learning_rate=to_float(outputs[3]) if n >= 4 else None,
            grad_norm=to_float(outputs[4]) if n >= 5 else None,
            local_norm=outputs[5] if n == 7 else None,
        )
    return StepOutputs(loss=to_float(outputs[0]))


def cb_param(cb: Any, name: str, default: Any = None) -> Any:
    """`cb_params.<name>`, or `default`: MindSpore's parameter dict raises KeyError, not
    AttributeError, for a missing key, so plain getattr(cb, name, default) is not enough."""
    try:
        return getattr(cb, name)
    except (AttributeError, KeyError):
        return default


def is_finite(value: float | None) -> bool:
    """False for NaN and +-Inf; None counts as finite (nothing to report)."""
    return value is None or math.isfinite(value)
