"""Checkpoint saves, observed on the run's checkpoint callback (no MindSpore import).

MindSpore's `ModelCheckpoint` (and mindformers' `CheckpointMonitor`, its subclass) saves inside
its `step_end`, every `save_checkpoint_steps` steps (or `save_checkpoint_seconds` seconds), and
once more in `end` when training ends. `CheckpointWatch` wraps those two methods on the instance
(never on the class), times each call, and counts a save when the callback's record of its last
save moved during the call:

    watch = CheckpointWatch(model_checkpoint, instruments.state, instruments.touch, account)
    ...
    watch.detach()

The duration is the training thread's time in that call: the whole save, or with `async_save`
its blocking part (the write goes on in the background). The cost on a step without a save is
two clock reads and two attribute reads.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from .instruments import TrainState
from .time_account import TimeAccount

log = logging.getLogger("mfotel")

#: The methods that save: every step, and once at train end.
SAVING_METHODS = ("step_end", "end")


def save_interval(callback: Any) -> tuple[int | None, float | None]:
    """(steps, seconds) between saves as configured; MindSpore uses the steps when both are set."""
    config = getattr(callback, "_config", None)
    steps = getattr(config, "save_checkpoint_steps", None)
    seconds = getattr(config, "save_checkpoint_seconds", None)
    if isinstance(steps, int) and steps > 0:
        return steps, None
    if isinstance(seconds, (int, float)) and seconds > 0:
        return None, float(seconds)
    return None, None


class CheckpointWatch:
    """Counts and times the saves of one checkpoint callback into `state` (and into the time
    account, when one is kept: its checkpoint phase)."""

    def __init__(self, callback: Any, state: TrainState, on_change: Callable[[], None],
                 account: TimeAccount | None = None) -> None:
        self.callback = callback
        self._state = state
        self._on_change = on_change
        self._account = account
        self._wrapped: list[str] = []
        steps, seconds = save_interval(callback)
        state.checkpoints = state.checkpoints or 0   # a checkpointing run, none saved yet
        state.checkpoint_interval_steps = steps
        state.checkpoint_interval_seconds = seconds
        for name in SAVING_METHODS:
            if callable(getattr(callback, name, None)):
                self._wrap(name)

    def _marker(self) -> tuple[Any, Any]:
        """What a save changes: the step it saved at and the file it wrote."""
        callback = self.callback
        return (getattr(callback, "_last_triggered_step", None),
                getattr(callback, "_latest_ckpt_file_name", None))

    def _wrap(self, name: str) -> None:
        original = getattr(self.callback, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            before = self._marker()
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                seconds = time.perf_counter() - started
                try:
                    if self._marker() != before:
                        self._saved(seconds)
                except Exception as exc:  # noqa: BLE001 - never raise into training
                    log.warning("mfotel: checkpoint timing skipped (%s: %s)",
                                type(exc).__name__, exc)

        setattr(self.callback, name, timed)
        self._wrapped.append(name)

    def _saved(self, seconds: float) -> None:
        state = self._state
        state.checkpoints = (state.checkpoints or 0) + 1
        state.checkpoint_duration = seconds
        state.last_checkpoint_timestamp = now = time.time()
        if self._account is not None:
            self._account.interval("checkpoint", seconds, now)
        self._on_change()

    def detach(self) -> None:
        """Restore the callback's own methods."""
        for name in self._wrapped:
            self.callback.__dict__.pop(name, None)
        self._wrapped.clear()
