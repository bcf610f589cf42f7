"""Multiply a MindSpore optimizer's learning rate in place, mid-run (imports MindSpore lazily).

| optimizer.learning_rate | how it is scaled |
|---|---|
| Parameter (float lr) | set_data(lr * factor) |
| _IteratorLearningRate (list lr) | its table Parameter * factor |
| _ConvertToCell (float lr in a dynamic group) | its Parameter * factor |
| other LearningRateSchedule (cosine, ...) | wrapped in `ScaledSchedule` before compilation |
| CellList / ParameterTuple (group lrs) | each group as above |

`ScaledSchedule` multiplies by a scale Parameter; a schedule compiled without it cannot be
scaled. The compiled graph reads Parameters at every step, so the new rate applies from the next
step.
"""
from __future__ import annotations

from typing import Any


class LrNotScalable(RuntimeError):
    """The learning rate cannot be changed in place; the message says why and what to do."""


def _is_parameter(obj: Any) -> bool:
    from mindspore import Parameter
    return isinstance(obj, Parameter)


def _scale_parameter(param: Any, factor: float) -> None:
    from mindspore import Tensor
    param.set_data(Tensor(param.asnumpy() * factor, param.dtype))


def _scaled_schedule_class() -> type:
    from mindspore import Parameter, Tensor, float32
    from mindspore.nn.learning_rate_schedule import LearningRateSchedule

    class ScaledSchedule(LearningRateSchedule):
        """`inner(step) * scale`, with `scale` a Parameter that mfotel can change mid-run.

        The scale is saved in checkpoints (as `mfotel_lr_scale`), so a resumed run keeps it.
        """

        def __init__(self, inner: Any) -> None:
            super().__init__()
            self.inner = inner
            self.scale = Parameter(Tensor(1.0, float32), name="mfotel_lr_scale",
                                   requires_grad=False)

        def construct(self, global_step: Any) -> Any:
            return self.inner(global_step) * self.scale
    return ScaledSchedule


_SCALED: type | None = None


def _scaled_type() -> type:
    global _SCALED
    if _SCALED is None:
        _SCALED = _scaled_schedule_class()
    return _SCALED


def _schedules(optimizer: Any) -> list[tuple[Any, Any]]:
    """(container, key) of every LearningRateSchedule without a Parameter of its own."""
    from mindspore.nn.learning_rate_schedule import LearningRateSchedule
    lr = optimizer.learning_rate
    slots = [(lr, i) for i in range(len(lr))] if getattr(optimizer, "is_group_lr", False) \
        and not _is_parameter(lr) and hasattr(lr, "__setitem__") else [(optimizer, "learning_rate")]
    found = []
    for container, key in slots:
        item = container[key] if isinstance(key, int) else getattr(container, key)
        if isinstance(item, LearningRateSchedule) and not _is_parameter(
                getattr(item, "learning_rate", None)) and not isinstance(item, _scaled_type()):
            found.append((container, key))
    return found


def make_scalable(optimizer: Any, train_network: Any = None) -> str | None:
    """Wrap schedule-cell learning rates so they can be scaled later; call before compilation.

    Returns a message when a schedule cannot be wrapped (the graph is already compiled).
    """
    slots = _schedules(optimizer)
    if not slots:
        return None
    if train_network is not None and getattr(train_network, "compile_cache", None):
        names = ", ".join(type(getattr(c, k) if isinstance(k, str) else c[k]).__name__
                          for c, k in slots)
        return (f"the learning rate is a schedule ({names}) and the training graph was compiled "
                f"before the monitor started, so scale_lr cannot change it. Fix: create the "
                f"callback before Model.build()/the first step, or use a float or list lr")
    wrapper = _scaled_type()
    for container, key in slots:
        if isinstance(key, int):
            container[key] = wrapper(container[key])
        else:
            setattr(container, key, wrapper(getattr(container, key)))
    return None


def _scale_one(lr: Any, factor: float) -> None:
    if _is_parameter(lr):
        _scale_parameter(lr, factor)
    elif isinstance(lr, _scaled_type()):
        _scale_parameter(getattr(lr, "scale"), factor)  # noqa: B009 - the type is built at run time
    elif _is_parameter(getattr(lr, "learning_rate", None)):  # list table or _ConvertToCell
        _scale_parameter(lr.learning_rate, factor)
    else:
        raise LrNotScalable(
            f"the learning rate is a {type(lr).__name__} schedule with no Parameter to change "
            f"and was not wrapped before compilation. Fix: enable actions before training "
            f"starts (the callback wraps schedules at train begin), or use a float or list lr")


def scale_learning_rate(optimizer: Any, factor: float) -> None:
    """Multiply every learning rate of `optimizer` by `factor`; LrNotScalable if impossible."""
    if optimizer is None:
        raise LrNotScalable("the run has no optimizer to scale (cb_params.optimizer and "
                            "train_network.optimizer are both None)")
    lr = optimizer.learning_rate
    items = list(lr) if getattr(optimizer, "is_group_lr", False) and not _is_parameter(lr) else [lr]
    for item in items:  # check all first: never scale some groups and not others
        if not (_is_parameter(item) or isinstance(item, _scaled_type())
                or _is_parameter(getattr(item, "learning_rate", None))):
            _scale_one(item, factor)  # raises with the message
    for item in items:
        _scale_one(item, factor)
