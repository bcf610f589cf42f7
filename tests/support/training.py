"""Callbacks that a test adds to a real MindSpore run: act at a step, wait at a step."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tests.support.waiting import wait_for


def at_step(step: int, action: Callable[[], Any]) -> Any:
    """A callback that calls `action()` at the end of step `step` (after the monitor), once
    the monitor lines of the steps so far are written (a thread writes them, off the
    training thread)."""
    from mindspore.train import Callback

    from mfotel import OTelMonitor

    class AtStep(Callback):
        def on_train_step_end(self, run_context: Any) -> None:
            cb = run_context.original_args()
            if int(cb.cur_step_num) == step:
                for callback in cb.list_callback:
                    if isinstance(callback, OTelMonitor):
                        assert callback.flush_lines(10), "the monitor lines were not written"
                action()
    return AtStep()


def wait_at_step(step: int, condition: Callable[[], Any], timeout: float, message: str) -> Any:
    """A callback that holds training at the end of step `step` until `condition()` holds
    (AssertionError, failing the run, after `timeout` s)."""
    return at_step(step, lambda: wait_for(condition, timeout, 0.02, message))
