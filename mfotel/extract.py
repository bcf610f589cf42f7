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

This runs on the training thread at every step: a one-element Tensor is read with `item()`
(~0.3 us; `asnumpy()` is ~30x dearer) and `StepOutputs` is a NamedTuple (a frozen dataclass
costs ~4 us to build), built with tuple.__new__ (its own __new__ is one more Python frame).
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple


class StepOutputs(NamedTuple):
    """The values of one step's outputs; None where the layout has none."""

    loss: float | None = None
    grad_norm: float | None = None
    overflow: bool | None = None
    loss_scale: float | None = None
    learning_rate: float | None = None
    local_norm: Any = None  # raw per-parameter norms (mindformers 7-tuple), unconverted


NO_OUTPUTS = StepOutputs()
#: A NamedTuple of all its fields without its own __new__ (a Python frame), every step.
_new_tuple = tuple.__new__


def to_float(value: Any) -> float | None:
    """A Python float from a Tensor, numpy array (mean of its elements) or number; None stays."""
    if value is None:
        return None
    try:
        return float(value.item())  # one element (Tensor, numpy): the cheap read, every step
    except AttributeError:
        if type(value) is float:
            return value
    except (ValueError, TypeError, RuntimeError):
        pass                        # several or no elements: below
    if hasattr(value, "asnumpy"):
        value = value.asnumpy()
    size = getattr(value, "size", 1)
    if size == 0:
        return None
    if size != 1 and hasattr(value, "mean"):
        return float(value.mean())
    if hasattr(value, "item"):
        value = value.item()
    return float(value)


def to_bool(value: Any) -> bool | None:
    """True if any element of a Tensor/array/number is truthy."""
    if value is None:
        return None
    item = getattr(value, "item", None)
    if item is not None:
        try:
            return bool(item())
        except (ValueError, TypeError, RuntimeError):
            pass
    if hasattr(value, "asnumpy"):
        value = value.asnumpy()
    if hasattr(value, "any"):
        return bool(value.any())
    return bool(value)


def parse_net_outputs(outputs: Any) -> StepOutputs:
    """StepOutputs from `cb_params.net_outputs` (see the module table)."""
    if not isinstance(outputs, (tuple, list)):
        return NO_OUTPUTS if outputs is None else StepOutputs(to_float(outputs))
    n = len(outputs)
    if n == 2:   # first: mfotel's own cell, every step
        return _new_tuple(StepOutputs, (to_float(outputs[0]), to_float(outputs[1]),
                                        None, None, None, None))
    if n == 0:
        return NO_OUTPUTS
    if n in (3, 4, 5, 7):
        return _new_tuple(StepOutputs, (
            to_float(outputs[0]),                        # loss
            to_float(outputs[4]) if n >= 5 else None,    # grad_norm
            to_bool(outputs[1]), to_float(outputs[2]),   # overflow, loss_scale
            to_float(outputs[3]) if n >= 4 else None,    # learning_rate
            outputs[5] if n == 7 else None))             # local_norm
    return StepOutputs(to_float(outputs[0]))


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


def eval_loss(results: Any) -> float | None:
    """The `loss` of an evaluation result (`Model.eval`'s metrics), any case, at the top or one
    level down: `{"loss": 2.1}` (MindSpore's `nn.Loss` metric named loss) or mindformers'
    `{"PerplexityMetric": {"loss": 2.1, "PPL": 8.2}}`."""
    if not isinstance(results, dict):
        return None
    nested = [v for _, v in sorted(results.items(), key=lambda kv: str(kv[0]))
              if isinstance(v, dict)]
    for found in (results, *nested):
        for key in sorted((k for k in found if str(k).lower() == "loss"), key=str):
            try:
                return to_float(found[key])
            except (TypeError, ValueError):
                return None
    return None
