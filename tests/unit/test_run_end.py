"""The end of a run (mfotel.run_end): the final status table, what the run shows while it
ends, and the ordered shutdown."""
from __future__ import annotations

import signal

import pytest
from opentelemetry.sdk.metrics import MeterProvider

from mfotel.contract import (
    STATUS_CANCELLED,
    STATUS_COMPLETED,
    STATUS_FAILED,
    STATUS_INITIALISING,
    STATUS_RUNNING,
)
from mfotel.instruments import Instruments, TrainState
from mfotel.run_end import RunEnd, final_status

TERM, CHILD = signal.SIGTERM, "child process 7 was killed by Killed"
#: (case, error, stopped, total_steps, last_step, signalled, child_failure) -> status
STATUS_TABLE = [
    ("reached the last step", None, False, 10, 10, None, None, STATUS_COMPLETED),
    ("length unknown, ended normally", None, False, None, 3, None, None, STATUS_COMPLETED),
    ("ended before the last step", None, False, 10, 7, None, None, STATUS_FAILED),
    ("stopped early (on_nonfinite, an action)", None, True, 10, 5, None, None, STATUS_FAILED),
    ("stopped at the last step is still a stop", None, True, 10, 10, None, None, STATUS_FAILED),
    ("SIGTERM before the end", None, False, 10, 4, TERM, None, STATUS_CANCELLED),
    ("SIGTERM after the last step: completed", None, False, 10, 10, TERM, None,
     STATUS_COMPLETED),
    ("SIGTERM a dead dataset worker explains", None, False, 10, 4, TERM, CHILD, STATUS_FAILED),
    ("Ctrl-C (KeyboardInterrupt left train())", KeyboardInterrupt(), False, 10, 4, None, None,
     STATUS_CANCELLED),
    ("a chained handler's sys.exit() after SIGTERM", SystemExit(1), False, 10, 4, TERM, None,
     STATUS_CANCELLED),
    ("sys.exit() without a signal", SystemExit(1), False, 10, 4, None, None, STATUS_FAILED),
    ("sys.exit() after SIGTERM from a dead child", SystemExit(1), False, 10, 4, TERM, CHILD,
     STATUS_FAILED),
    ("an exception left train()", RuntimeError("boom"), False, 10, 10, None, None,
     STATUS_FAILED),
]


@pytest.mark.parametrize("case, error, stopped, total, last, signalled, child, expected",
                         STATUS_TABLE, ids=[row[0] for row in STATUS_TABLE])
def test_final_status(case, error, stopped, total, last, signalled, child, expected):
    assert final_status(error=error, stopped=stopped, total_steps=total, last_step=last,
                        signalled=signalled, child_failure=child) == expected


def instruments() -> Instruments:
    return Instruments(MeterProvider().get_meter("test"), {"job_name": "job", "rank": "0"},
                       ("loss",))


def test_a_signal_shows_cancelled_at_once_or_failed_with_a_dead_child():
    end = RunEnd(instruments(), lambda key, message: None)
    state = end.instruments.state
    end.on_signal(TERM, None)
    assert state.status == STATUS_CANCELLED
    end.on_signal(TERM, CHILD)
    assert state.status == STATUS_FAILED                     # the child explains it
    assert end.decide(total_steps=10, last_step=3) == STATUS_FAILED
    assert end.begin(STATUS_COMPLETED)
    state.status = STATUS_COMPLETED                          # shown by the close
    end.on_signal(signal.SIGINT, None)
    assert state.status == STATUS_COMPLETED                  # ending: keeps its status
    assert end.signalled == TERM                             # the first signal counts


def test_close_runs_once_from_whichever_thread_comes_first():
    end = RunEnd(instruments(), lambda key, message: None)
    assert end.begin(STATUS_COMPLETED) and end.final_status == STATUS_COMPLETED
    assert end.closing_thread is not None
    assert not end.begin(STATUS_FAILED) and end.final_status == STATUS_COMPLETED


def test_a_stop_asks_once_and_the_first_error_closes():
    end, asked = RunEnd(instruments(), lambda key, message: None), []
    end.stop(lambda: asked.append(1))
    end.stop(lambda: asked.append(2))
    assert asked == [1] and end.stopped
    first = RuntimeError("boom")
    assert end.fail(first) and not end.fail(KeyboardInterrupt())
    assert end.error is first and end.reason == "failed"


class RacingState(TrainState):
    """Runs `race` right after the step path assigns status running: close() beginning on
    another thread between running_again's check and its assignment."""

    race = None

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        race = self.race
        if name == "status" and value == STATUS_RUNNING and race is not None:
            object.__setattr__(self, "race", None)
            race()


@pytest.mark.parametrize("status", [STATUS_INITIALISING, STATUS_CANCELLED, STATUS_FAILED])
def test_steps_show_running_again_unless_the_run_ends(status):
    end = RunEnd(instruments(), lambda key, message: None)
    state = end.instruments.state
    state.status = status                   # before the first step, or after a signal
    end.running_again()
    assert state.status == STATUS_RUNNING
    end.begin(STATUS_CANCELLED)             # close() began: a late step end changes nothing
    state.status = STATUS_CANCELLED
    end.running_again()
    assert state.status == STATUS_CANCELLED


def test_a_close_that_begins_during_the_assignment_keeps_its_final_status():
    end = RunEnd(instruments(), lambda key, message: None)
    state = end.instruments.state = RacingState()
    state.status = STATUS_CANCELLED         # a signal; its watcher thread closes the run
    state.race = lambda: end.begin(STATUS_CANCELLED)
    end.running_again()
    assert state.race is None and end.closing_thread is not None
    assert state.status == STATUS_CANCELLED  # the second check put the final status back


def test_every_shutdown_step_runs_in_order_and_failures_are_reported():
    done, warned = [], []
    end = RunEnd(instruments(), lambda key, message: warned.append((key, message)))

    def fail() -> None:
        raise OSError("disk gone")
    first = [("status", lambda: done.append("status")), ("lines", fail),
             ("linger", lambda: done.append("linger"))]
    then = [("telemetry", lambda: done.append("telemetry"))]
    end.shutdown((first, then, ("signals", lambda: done.append(("signals", end.closed)))))
    assert done == ["status", "linger", "telemetry", ("signals", True)]
    assert [key for key, _ in warned] == ["shutdown:lines"]
    assert "lines failed at the end of training (OSError: disk gone)" in warned[0][1]
    assert end.instruments.state.export_errors["shutdown"] == 1


def test_a_second_ctrl_c_cuts_the_linger_short_and_the_rest_still_runs():
    done = []
    end = RunEnd(instruments(), lambda key, message: None)

    def interrupted() -> None:
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        end.shutdown(([("linger", interrupted), ("after linger", lambda: done.append("x"))],
                      [("telemetry", lambda: done.append("telemetry"))],
                      ("signals", lambda: done.append("signals"))))
    assert done == ["telemetry", "signals"] and end.closed
