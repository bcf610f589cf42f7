"""A rank's time account: where each second of this process went, by phase (pure, no MindSpore).

The phases add up, at every event, to the time from the process's start to that event: the
goodput account of a run (docs/metrics.md, Goodput) is built from them, live by the rules
(`mfotel.alerting.goodput`) and offline from the monitor lines (`mfotel goodput`).

| phase | from .. to |
|---|---|
| startup | process start .. the end of its first step (imports, model build, checkpoint load, |
|         | graph compilation, the first step) |
| step | a step's begin .. its end (after the first) |
| input | a step's end .. the next one's begin, and after the last step (waiting for input, |
|       | host work between steps) |
| checkpoint | a checkpoint save, wherever it falls |
| evaluation | an evaluation during training, wherever it falls |
| stall | step and input time beyond the stall threshold since the last step end |

The stall threshold is max(stall_seconds, stall_step_factor x the mean step + input seconds
per step so far), as the rules' MindFormersTrainingStalled (RulesConfig's defaults: 900 s, 10).
Saves and evaluations never count toward it. Times are unix seconds (time.time()); a clock
that goes back adds nothing.

    account = TimeAccount(origin=process_start_time())
    account.step_begin(time.time())                  # the step-begin mark
    account.step_end(time.time(), steps=1)           # the step-end hook (sink mode: steps > 1)
    account.interval("checkpoint", 4.2, time.time())  # the last 4.2 s were a save
    account.close(time.time())                       # training ended
    account.totals   # {"startup": ..., "step": ..., ...}: sum == last_event - origin
"""
from __future__ import annotations

import os
import time

PHASES: tuple[str, ...] = ("startup", "step", "input", "checkpoint", "evaluation", "stall")
#: Phases an interval of `TimeAccount.interval` may name (carved out of the open phase).
CARVED: tuple[str, ...] = ("checkpoint", "evaluation")
#: RulesConfig.stall_seconds and stall_step_factor's defaults (a unit test keeps them equal).
STALL_SECONDS = 900.0
STALL_STEP_FACTOR = 10.0

#: The monitor line's fields (text and JSON): the account's totals, and this process's steps.
LINE_PREFIX = "account_"
LINE_STEPS = LINE_PREFIX + "steps"
LINE_FIELDS: tuple[str, ...] = (LINE_STEPS, *(LINE_PREFIX + phase for phase in PHASES))


class TimeAccount:
    """Seconds of this process by phase (see the module docstring). Not thread-safe: the
    training thread calls it; readers take `totals` (a dict updated in place)."""

    def __init__(self, origin: float, *, stall_seconds: float = STALL_SECONDS,
                 stall_step_factor: float = STALL_STEP_FACTOR) -> None:
        if not stall_seconds > 0 or not stall_step_factor > 1:
            raise ValueError("stall_seconds must be > 0 and stall_step_factor > 1")
        self.origin = origin
        self.last_event = origin
        self.totals: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.steps = 0                    # steps this process completed
        self.stall_seconds, self.stall_step_factor = stall_seconds, stall_step_factor
        self._phase = "startup"
        self._since_step_end = 0.0        # step + input seconds since the last step end
        self._cycle_seconds = 0.0         # step + input seconds (no stall) of later steps
        self._cycles = 0                  # steps after the first
        self.closed = False

    @property
    def phase(self) -> str:
        """The open phase: startup, step (inside a step) or input (between steps)."""
        return self._phase

    def stall_threshold(self) -> float:
        mean = self._cycle_seconds / self._cycles if self._cycles else 0.0
        return max(self.stall_seconds, self.stall_step_factor * mean)

    # ------------------------------------------------------------ events
    def step_begin(self, now: float) -> None:
        """A step begins (the time since the last event was outside the steps)."""
        self._spend(self._elapsed(now))
        if self._phase != "startup":
            self._phase = "step"

    def step_end(self, now: float, steps: int = 1) -> None:
        """`steps` steps (a sink's several) ended at `now`."""
        self._spend(self._elapsed(now))
        if self._phase != "startup":
            self._cycles += steps
            self._cycle_seconds += min(self._since_step_end, self.stall_threshold())
        self.steps += steps
        self._since_step_end = 0.0
        self._phase = "input"

    def interval(self, phase: str, seconds: float, now: float) -> None:
        """The last `seconds` before `now` were `phase` (a checkpoint save, an evaluation),
        told when it returns; the rest since the last event goes to the open phase."""
        if phase not in CARVED:
            raise ValueError(f"phase {phase!r}: one of {', '.join(CARVED)}")
        elapsed = self._elapsed(now)
        carved = min(max(seconds, 0.0), elapsed)
        self._spend(elapsed - carved)
        self.totals[phase] += carved

    def close(self, now: float) -> None:
        """Training ended at `now` (the time since the last event goes to the open phase)."""
        self._spend(self._elapsed(now))
        self.closed = True

    # ------------------------------------------------------------ reading
    def line_values(self) -> dict[str, float]:
        """The monitor line's account fields (LINE_FIELDS), for a record step's line."""
        return {LINE_STEPS: float(self.steps),
                **{LINE_PREFIX + phase: seconds for phase, seconds in self.totals.items()}}

    # ------------------------------------------------------------ attribution
    def _elapsed(self, now: float) -> float:
        elapsed = now - self.last_event
        if elapsed <= 0:
            return 0.0
        self.last_event = now
        return elapsed

    def _spend(self, seconds: float) -> None:
        if seconds <= 0:
            return
        phase, totals = self._phase, self.totals
        if phase == "startup":
            totals["startup"] += seconds
            return
        room = max(self.stall_threshold() - self._since_step_end, 0.0)
        kept = min(seconds, room)
        totals[phase] += kept
        totals["stall"] += seconds - kept
        self._since_step_end += seconds


def process_start_time() -> float:
    """Unix time this process started (Linux: /proc; elsewhere: now, a start-up of 0)."""
    try:
        with open("/proc/self/stat", "rb") as handle:
            fields = handle.read().rsplit(b")", 1)[1].split()
        ticks = int(fields[19])            # starttime, field 22 of stat(5)
        with open("/proc/stat", "rb") as handle:
            boot = next(int(line.split()[1]) for line in handle if line.startswith(b"btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()
