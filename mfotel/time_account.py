"""A rank's time account: where each second of this process went, by phase (pure, no MindSpore).

The phases add up, at every event, to the time from the process's start to that event (a
step's begin is noted, and counted at the next event: its end): the goodput account of a run
(docs/metrics.md, Goodput) is built from them, live by the rules (`mfotel.alerting.goodput`)
and offline from the monitor lines (`mfotel goodput`). OTelMonitor keeps one account per
process (`process_account`), whatever its runs: told each step's begin and end, each save
(mfotel.checkpoints) and evaluation, closed when a run's final status is shown.

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

    account = process_account()       # this process's (TimeAccount(process_start_time()))
    account.step_begin(time.time())                  # the step-begin mark
    account.step_end(time.time(), steps=1)           # the step-end hook (sink mode: steps > 1)
    account.interval("checkpoint", 4.2, time.time())  # the last 4.2 s were a save
    account.close(time.time())                       # training ended
    account.totals   # {"startup": ..., "step": ..., ...} (live): sum == last_event - origin
"""
from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping

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
#: The open phases, compared by identity on the training thread's path.
_STARTUP, _STEP, _INPUT = "startup", "step", "input"
#: The account's attribute of each phase's seconds.
TOTAL_FIELDS: dict[str, str] = {phase: phase + "_total" for phase in PHASES}


class TimeAccount:
    """Seconds of this process by phase (see the module docstring). Not thread-safe: the
    training thread calls it; readers take `totals` (a live view of the seconds by phase). A
    run ended by a signal may close it from another thread (mfotel.lifecycle) while a step
    ends: the seconds since the event before may then count twice, once.

    The training thread tells it every step's begin and end: slots, not a dict; a begin is
    noted and counted at the next event, and the usual step (no stall, a begin between two
    ends) in one call, without a further one."""

    __slots__ = ("origin", "last_event", "steps", "stall_seconds", "stall_step_factor",
                 "closed", "totals", "_phase", "_begun", "_since_step_end", "_first_steps",
                 "_capped",
                 *TOTAL_FIELDS.values())

    def __init__(self, origin: float, *, stall_seconds: float = STALL_SECONDS,
                 stall_step_factor: float = STALL_STEP_FACTOR) -> None:
        if not stall_seconds > 0 or not stall_step_factor > 1:
            raise ValueError("stall_seconds must be > 0 and stall_step_factor > 1")
        self.origin = origin
        self.last_event = origin
        self.startup_total = self.step_total = self.input_total = 0.0   # seconds by phase
        self.checkpoint_total = self.evaluation_total = self.stall_total = 0.0
        #: seconds by phase, live (TrainState.time: the exposition reads it at collection)
        self.totals: Mapping[str, float] = PhaseTotals(self)
        self.steps = 0                    # steps this process completed
        self.stall_seconds, self.stall_step_factor = stall_seconds, stall_step_factor
        self._phase = _STARTUP            # the open phase: startup, step or input
        self._begun: float | None = None  # a step begin not counted yet (step_begin)
        self._since_step_end = 0.0        # step, input and stall seconds since the last step end
        self._first_steps = 0             # steps at the end of startup (the first step end)
        self._capped = 0.0                # seconds of later steps beyond the stall threshold
        self.closed = False

    @property
    def phase(self) -> str:
        """The open phase: startup, step (inside a step) or input (between steps)."""
        return _STEP if self._begun is not None and self._phase is not _STARTUP else \
            self._phase

    def stall_threshold(self) -> float:
        """max(stall_seconds, stall_step_factor x the mean step + input seconds per step after
        the first, each step's at most the threshold at its end)."""
        return self._threshold(self.steps - self._first_steps)

    def _threshold(self, steps: int) -> float:
        """The threshold over `steps` steps after the first, the ended ones' seconds (no
        bookkeeping of them every step: their phases less the open step's, less what was
        beyond the threshold)."""
        if not steps:
            return self.stall_seconds
        ended = self.step_total + self.input_total + self.stall_total - self._since_step_end
        return max(self.stall_seconds, self.stall_step_factor * (ended - self._capped) / steps)

    # ------------------------------------------------------------ events
    def step_begin(self, now: float) -> None:
        """A step begins (the time since the last event was outside the steps). Noted, and
        counted at the next event: the step's end counts both."""
        if self._begun is not None:
            self._settle()
        self._begun = now

    def step_end(self, now: float, steps: int = 1) -> None:
        """`steps` steps (a sink's several) ended at `now`."""
        begun, last = self._begun, self.last_event
        if begun is not None and self._phase is _INPUT and last < begun <= now and \
                self._since_step_end + (now - last) <= self.stall_seconds:
            # the usual step, every step: input to its begin, then the step, no stall (as
            # _settle and _advance would count them, without their calls)
            self.input_total += begun - last
            self.step_total += now - begun
            self.last_event, self._begun = now, None
            self.steps += steps
            self._since_step_end = 0.0
            return
        self._settle()
        self._advance(now)
        if self._phase is _STARTUP:
            self._first_steps = self.steps + steps
        elif self._since_step_end > self.stall_seconds:   # this step counted in
            threshold = self._threshold(self.steps + steps - self._first_steps)
            self._capped += max(self._since_step_end - threshold, 0.0)
        self.steps += steps
        self._since_step_end = 0.0
        self._phase = _INPUT

    def interval(self, phase: str, seconds: float, now: float) -> None:
        """The last `seconds` before `now` were `phase` (a checkpoint save, an evaluation),
        told when it returns; the rest since the last event goes to the open phase."""
        if phase not in CARVED:
            raise ValueError(f"phase {phase!r}: one of {', '.join(CARVED)}")
        self._settle()
        carved = min(max(seconds, 0.0), max(now - self.last_event, 0.0))
        self._advance(now - carved)
        if phase == "checkpoint":
            self.checkpoint_total += carved
        else:
            self.evaluation_total += carved
        self.last_event = max(self.last_event, now)

    def close(self, now: float) -> None:
        """Training ended at `now` (the time since the last event goes to the open phase)."""
        self._settle()
        self._advance(now)
        self.closed = True

    # ------------------------------------------------------------ reading
    def line_values(self) -> dict[str, float]:
        """The monitor line's account fields (LINE_FIELDS), for a record step's line (on the
        training thread: built at once, not through `totals`)."""
        return {LINE_STEPS: float(self.steps), "account_startup": self.startup_total,
                "account_step": self.step_total, "account_input": self.input_total,
                "account_checkpoint": self.checkpoint_total,
                "account_evaluation": self.evaluation_total, "account_stall": self.stall_total}

    # ------------------------------------------------------------ attribution
    def _settle(self) -> None:
        """Count a step begin noted before: the time to it was outside the steps."""
        begun = self._begun
        if begun is not None:
            self._begun = None
            self._advance(begun)
            if self._phase is not _STARTUP:
                self._phase = _STEP

    def _advance(self, now: float) -> None:
        """The time since the last event goes to the open phase (startup, step or input);
        beyond the stall threshold since the last step end, to stall. A clock that went back
        adds nothing."""
        seconds = now - self.last_event
        if seconds <= 0:
            return
        self.last_event = now
        phase = self._phase
        if phase is _STARTUP:
            self.startup_total += seconds
            return
        before = self._since_step_end
        since = before + seconds
        kept = seconds if since <= self.stall_seconds else \
            min(seconds, max(self.stall_threshold() - before, 0.0))
        self._since_step_end = since
        if phase is _STEP:
            self.step_total += kept
        else:
            self.input_total += kept
        self.stall_total += seconds - kept


class PhaseTotals(Mapping[str, float]):
    """An account's seconds by phase (PHASES' order), live and read-only."""

    __slots__ = ("_account",)

    def __init__(self, account: TimeAccount) -> None:
        self._account = account

    def __getitem__(self, phase: str) -> float:
        return getattr(self._account, TOTAL_FIELDS[phase])

    def __iter__(self) -> Iterator[str]:
        return iter(PHASES)

    def __len__(self) -> int:
        return len(PHASES)


_process: tuple[int, TimeAccount] | None = None   # (pid, its account)


def process_account() -> TimeAccount:
    """This process's account, made at the first call: one per process, kept across
    `Model.train` calls (a new account in the same process would read as a counter reset
    with an unchanged start); a forked child makes its own."""
    global _process
    pid = os.getpid()
    if _process is None or _process[0] != pid:
        _process = (pid, TimeAccount(process_start_time()))
    return _process[1]


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
