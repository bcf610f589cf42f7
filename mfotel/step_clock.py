"""The step clock: global step, step timing, throughput and record crossing (pure, no MindSpore).

One clock per `Model.train` call. The callback feeds it MindSpore's counters and
`time.perf_counter()` marks; it answers with one `Tick` per step end:

    clock = StepClock(RecordSchedule(step_interval=50), batch_size=8)
    clock.train_begin(cur_step_num=0)
    clock.begin(perf_counter())              # step begin hook (or an integration's mark)
    tick = clock.end(cur_step_num=1, now=perf_counter())
    tick.step, tick.seconds, tick.outside, tick.record   # record: None between record steps

Time figures (README, Time figures):
- `seconds`: the step's own time, begin mark to end mark (an integration may move both onto
  another callback's hooks), divided by the steps it advanced (sink mode advances several).
- `outside`: host time outside the steps, from the previous step's end mark to this step's
  begin: input wait and host work between steps. A rank that waits for its input has a long
  `outside` and a short step; the ranks waiting for it in the all-reduce, the reverse.
- `record`: at a record step, the means since the previous record (wall time between the two
  step ends): samples per second and seconds per step.
- `in_step_since`: the begin mark while a step runs, None between steps (hang detection).

Global step: `cur_step_num` continued from where the run resumed. `Model.train(initial_epoch=k)`
restarts cur_step_num at 1, a fault-repair resume starts it at the resumed step, and
integrations that skip data themselves (mindformers' `initial_step`) give `resume_step`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class RecordSchedule:
    """Which global steps record seed metrics: every `early_step_interval` steps up to
    `early_steps`, every `step_interval` steps after (monitor_config keys of those names)."""

    step_interval: int = 1
    early_steps: int = 0
    early_step_interval: int = 1

    def is_record_step(self, step: int) -> bool:
        if step <= self.early_steps:
            return step % self.early_step_interval == 0
        return step % self.step_interval == 0

    def next_after(self, step: int) -> int:
        """The first record step after `step` (O(1))."""
        first = step + 1
        if first > self.early_steps:  # the usual case, at every record step
            return -(-first // self.step_interval) * self.step_interval
        if first <= self.early_steps:
            early = -(-first // self.early_step_interval) * self.early_step_interval
            if early <= self.early_steps:
                return early
            first = self.early_steps + 1
        first = max(first, 1)
        return -(-first // self.step_interval) * self.step_interval


class Record(NamedTuple):
    """Means over the steps since the previous record."""

    elapsed: float          # seconds between the previous record's step end and this one
    steps: int              # steps in that interval
    samples: int            # samples in that interval (0 without a batch size)
    throughput: float | None  # samples per second (None without a batch size)
    step_time: float | None   # seconds per step


class Tick(NamedTuple):
    """What one step end yields."""

    step: int               # global step
    previous_step: int      # the global step before this one (a sink advances several)
    advanced: int           # steps since the previous end (>= 1)
    seconds: float | None   # the step's time, per step advanced; None without any mark
    outside: float | None   # previous step's end -> this begin; None when not known
    samples: int            # samples trained in this tick (0 without a batch size)
    record: Record | None   # set at a record step


#: A NamedTuple of all its fields without its own __new__ (a Python frame), every step.
_new_tuple = tuple.__new__


class StepClock:
    """Global step, step timing and record crossing of one run (see the module docstring)."""

    __slots__ = ("schedule", "batch_size", "resume_step", "total_steps", "last_step",
                 "in_step_since", "_begin_step", "_offset", "started", "_next_record",
                 "_end_mark", "_last_end", "_last_step_end", "_record_time", "_record_samples",
                 "_record_steps")   # read every step

    def __init__(self, schedule: RecordSchedule, batch_size: int | None = None,
                 resume_step: int | None = None) -> None:
        self.schedule = schedule
        self.batch_size = batch_size
        self.resume_step = resume_step
        self.total_steps: int | None = None
        self.last_step = 0              # the last completed global step
        self.in_step_since: float | None = None  # begin mark of the running step (begin())
        self._begin_step = 0            # cur_step_num at train begin
        self._offset = 0                # global step - cur_step_num, known at the first end
        self.started = False            # whether first_step() fixed the offset
        self._next_record = schedule.next_after(0)
        self._end_mark: float | None = None  # an integration's end mark for this step
        self._last_end: float | None = None  # perf time of the previous end hook
        self._last_step_end: float | None = None  # the previous step's end mark
        self._record_time: float | None = None
        self._record_samples = 0
        self._record_steps = 0

    # ------------------------------------------------------------ run
    def train_begin(self, cur_step_num: int, total_steps: int | None = None,
                    resume_step: int | None = None) -> None:
        """`cur_step_num` at train begin (non-zero when resuming), the run's length, and the
        global step the run resumed from when an integration knows it."""
        self._begin_step = cur_step_num
        self.total_steps = total_steps
        if resume_step is not None:
            self.resume_step = resume_step

    def first_step(self, cur_step_num: int, batch_num: int | None = None, epoch: int | None = None,
                   epoch_num: int | None = None) -> None:
        """Fix the offset from cur_step_num to the global step at the first step end:
        `batch_num` steps per epoch, `epoch` the current (1-based), `epoch_num` the last."""
        per_epoch = batch_num if isinstance(batch_num, int) else 0
        epoch = epoch if isinstance(epoch, int) else 1
        epoch_start = (epoch - 1) * per_epoch
        offset = epoch_start - self._begin_step if cur_step_num <= epoch_start else 0
        if self.resume_step is not None:
            offset = max(self.resume_step - self._begin_step, 0)
        self._offset, self.started = offset, True
        self.last_step = self._begin_step + offset
        self._next_record = self.schedule.next_after(self.last_step)
        if self.last_step and isinstance(epoch_num, int) and per_epoch:
            self.total_steps = (epoch_num + epoch - 1) * per_epoch

    # ------------------------------------------------------------ every step
    def begin(self, now: float) -> None:
        """The step's begin mark (perf_counter seconds): `in_step_since`, which the step's end
        clears (OTelMonitor sets it itself, every step)."""
        self.in_step_since = now

    def mark_end(self, now: float) -> None:
        """An integration's end mark for the running step (before other callbacks' work)."""
        self._end_mark = now

    def end(self, cur_step_num: int, now: float) -> Tick:
        """The step end hook at `now`; call first_step() before the first."""
        # every step runs this on the training thread: plain locals, one branch per case
        step = cur_step_num + self._offset
        previous = self.last_step
        advanced = step - previous if step > previous else 1
        begin = self.in_step_since
        outside = None
        if begin is not None:
            last_end = self._last_step_end
            if last_end is not None and begin >= last_end:
                outside = begin - last_end
        else:
            begin = self._last_end
        end = now
        mark = self._end_mark
        if mark is not None:
            if begin is not None and begin <= mark <= now:
                end = mark
            self._end_mark = None
        if begin is None:
            seconds = None
            if self._record_time is None:
                self._record_time = now
        else:
            seconds = end - begin if advanced == 1 else (end - begin) / advanced
            if self._record_time is None:
                self._record_time = begin
        samples = self.batch_size * advanced if self.batch_size else 0
        self._record_samples += samples
        self._record_steps += advanced
        record = None
        if step >= self._next_record:
            record = self._record(now)
            self._next_record = self.schedule.next_after(step)
        elif step < previous:  # went back (a new epoch counted from 1 again): look again
            self._next_record = self.schedule.next_after(step)
        self.last_step, self._last_end, self._last_step_end = step, now, end
        self.in_step_since = None
        return _new_tuple(Tick, (step, previous, advanced, seconds, outside, samples, record))

    def _record(self, now: float) -> Record:
        elapsed = now - (self._record_time if self._record_time is not None else now)
        steps, samples = self._record_steps, self._record_samples
        throughput = samples / elapsed if self.batch_size and elapsed > 0 else None
        step_time = elapsed / steps if elapsed > 0 and steps else None
        self._record_time, self._record_samples, self._record_steps = now, 0, 0
        return _new_tuple(Record, (elapsed, steps, samples, throughput, step_time))

    @property
    def progress(self) -> float | None:
        """Completed fraction of the run, 0..1, when its length is known."""
        if not self.total_steps:
            return None
        return min(self.last_step / self.total_steps, 1.0)
