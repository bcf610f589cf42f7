"""One way to wait: poll a predicate until it holds, or fail saying what was awaited.

    rows = wait_for(lambda: prom.query("up == 1"), timeout=30, message="the target up")

Timeouts come from what is awaited (see `settle`), never from a guess: a scrape interval,
an evaluation interval, an alert's `for`, Alertmanager's group_wait, a step time.
"""
from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")

#: Head-room for a loaded machine: a configured delay is multiplied by load_factor(), plus SLACK
#: seconds for the scheduler.
MIN_LOAD_FACTOR = 3.0
SLACK = 30.0
#: Measured start-up times here (quiet machine): a Python process importing MindSpore serves
#: /metrics after ~5 s; an msrun job of 2 CPU ranks reaches its first step after ~15 s.
PYTHON_START_SECONDS = 5.0
MSRUN_START_SECONDS = 15.0


def load_factor() -> float:
    """How much slower than quiet this machine runs now: twice the runnable processes per core
    (the 1-minute load average; measured here: a step of the tiny Llama took 11x its quiet
    time at a load of 19 on 2 cores), at least MIN_LOAD_FACTOR."""
    return max(MIN_LOAD_FACTOR, 2 * os.getloadavg()[0] / (os.cpu_count() or 1))


def under_load(quiet: float) -> float:
    """A bound on a time a test reads (not waits for), measured on a quiet machine, times the
    load per core when the machine is busier than one process a core."""
    return quiet * max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


def settle(*seconds: float, slack: float = SLACK) -> float:
    """How long to wait for something whose nominal delay is the sum of `seconds`
    (e.g. scrape interval + evaluation interval + `for` + group_wait), with margin."""
    return load_factor() * sum(seconds) + slack


def startup() -> float:
    """How long to wait for a Python process to start, import MindSpore and listen."""
    return settle(PYTHON_START_SECONDS)


def msrun_startup() -> float:
    """How long to wait for an msrun job of 2 CPU ranks to reach its first step."""
    return settle(MSRUN_START_SECONDS)


def wait_for(predicate: Callable[[], T], timeout: float, interval: float = 0.1,
             message: str = "the condition", *, alive: Iterable[subprocess.Popen] = (),
             ignore: tuple[type[BaseException], ...] = (),
             details: Callable[[], str] | None = None) -> T:
    """Poll `predicate` every `interval` s until it returns something truthy, and return that.

    AssertionError after `timeout` s, saying what was awaited (`message`) and the last value
    seen. Exceptions in `ignore` count as "not yet" (e.g. OSError while a server starts). A
    process in `alive` that exits first ends the wait at once. `details()` is added to the
    failure's message (e.g. the tail of a log).
    """
    deadline = time.monotonic() + timeout
    watched = list(alive)
    last: object = None
    while True:
        try:
            last = predicate()
        except ignore as exc:
            last = exc
        else:
            if last:
                return last  # type: ignore[return-value]
        failure = next((f"{process.args!r} exited ({process.returncode}) while waiting for "
                        f"{message}" for process in watched if process.poll() is not None), None)
        if failure is None and time.monotonic() >= deadline:
            failure = f"timed out after {timeout:.0f} s waiting for {message}"
        if failure is not None:
            extra = f"\n{details()}" if details is not None else ""
            raise AssertionError(f"{failure}; last value: {_short(last)}{extra}")
        time.sleep(interval)


def _short(value: object, limit: int = 500) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
