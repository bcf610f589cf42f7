"""What the callback reads of MindSpore besides `cb_params`: the rank once `init()` ran, and
the learning rate a step used. MindSpore is imported inside the functions that need it.

    identity = identity_after_init()       # at train begin: init() has run by then
    read = LearningRateReader()
    read(optimizer)                        # at a record step: the rate that step used
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .extract import to_float
from .identity import RankIdentity, identity_from_env


def identity_after_init() -> RankIdentity:
    """Environment identity, corrected by MindSpore's communication layer once init() ran."""
    identity = identity_from_env()
    try:
        from mindspore.communication import (
            _comm_helper,
            get_group_size,
            get_local_rank,
            get_local_rank_size,
            get_rank,
        )
        if not getattr(_comm_helper, "_is_initialized", lambda: True)():
            return identity  # without init() these echo the environment (local size 1)
        return identity.with_communication(get_rank(), get_local_rank(), get_group_size(),
                                           get_local_rank_size())
    except Exception:  # noqa: BLE001 - not initialised: a single process
        return identity


class LearningRateReader:
    """The learning rate a step actually used (get_lr() already returns the next step's).

    What to read is found at the first call and kept (a Cell's attribute lookup costs more
    than the read): make a new reader when the optimizer's rate was replaced or its table
    changed (OTelMonitor.learning_rate_changed)."""

    def __init__(self) -> None:
        self._read: Callable[[], float | None] | None = None

    def __call__(self, optimizer: Any) -> float | None:
        read = self.find(optimizer)
        return None if read is None else read()

    def find(self, optimizer: Any) -> Callable[[], float | None] | None:
        """The read of `optimizer`'s rate, found at the first call (None: no optimizer)."""
        if optimizer is None:
            return None
        if self._read is None:
            self._read = self._reader(optimizer)
        return self._read

    @staticmethod
    def _reader(optimizer: Any) -> Callable[[], float | None]:
        lr = optimizer.learning_rate
        if getattr(optimizer, "is_group_lr", False):
            lr = lr[0]
        if not getattr(optimizer, "dynamic_lr", False):  # a Parameter: changed in place
            item = getattr(lr, "item", None)
            if item is not None and getattr(lr, "size", 0) == 1:
                return item  # type: ignore[no-any-return]  # one element: a Python float
            return lambda: to_float(lr)
        global_step = optimizer.global_step

        def used_step() -> int:
            return max(int(to_float(global_step) or 0) - 1, 0)
        table = getattr(lr, "learning_rate", None)  # list lr: _IteratorLearningRate
        if table is not None and getattr(table, "ndim", 0) == 1:
            values = table.asnumpy()
            return lambda: float(values[min(used_step(), len(values) - 1)])
        from mindspore import Tensor, int32
        return lambda: to_float(lr(Tensor(used_step(), int32)))
