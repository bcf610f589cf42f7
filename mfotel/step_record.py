"""What a step end changes: the exposed state, the monitor line and the listeners' events
(pure: no MindSpore; a table of steps in tests/unit/test_step_record.py).

The callback turns MindSpore's hooks into a `Tick` (mfotel.step_clock) and the step's
`StepOutputs` (mfotel.extract); the recorder decides everything else:

    recorder = StepRecorder(instruments, RecordPlan.of(cfg), run, run_end)   # run: RunControl
    recorder.attach(listeners)
    recorder.begin(time.time())                     # the step-begin hook
    recorder.end(tick, outputs, epoch=1, total_steps=100, wall=time.time())

| when | what |
|---|---|
| every step | status running (the first step; steps after a signal, unless the run ends) |
| | step, steps, last step timestamp, epoch, progress |
| | step time (histogram), time outside the step, samples, tokens (when known) |
| | loss_finite; overflow count and loss scale (finite), when the outputs have them |
| a NaN / Inf loss or gradient norm | its count and value as it is, the first non-finite step, |
| | a warning (once), a stop (`on_nonfinite: stop`) |
| record steps | seed gauges (finite; loss and grad norm as they are), tokens/s per device, |
| | MFU, the monitor line (files: with the time account as of the step's end) |
| step begin | the step begin timestamp |
| step begin, end, evaluation | the process's time account (mfotel.time_account), when kept |

Listeners hear a step as `on_nonfinite`, `on_record`, then `on_step`; `on_step_begin` at the
step's begin; each hook only calls the listeners that override it (mfotel.listeners).
This is the training thread's every step: assignments, and a `StepSample` only when a
listener or a record needs one (benchmarks/overhead.py measures it; slots, the Tick unpacked
once, no call a step without news does not need).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from math import isfinite
from typing import TYPE_CHECKING, NamedTuple

from .config import MonitorConfig
from .contract import SEED_METRICS, STATUS_RUNNING
from .extract import StepOutputs
from .flops import mfu
from .instruments import AS_IS, PENDING_LIMIT, Instruments, TrainState
from .listeners import RunControl, StepListener, StepSample
from .sinks import LineWriter
from .step_clock import Record, Tick
from .time_account import TimeAccount

if TYPE_CHECKING:
    from .run_end import RunEnd

log = logging.getLogger("mfotel")
#: A NamedTuple of all its fields without its own __new__ (a Python frame).
_new_tuple = tuple.__new__


class RecordPlan(NamedTuple):
    """What a step reads and sets, worked out once at train begin from the settings and what
    the run told (integrations set the last two before it)."""

    names: tuple[str, ...]     # the configured metrics, in the line's order
    all: bool                  # exactly contract.SEED_METRICS, in that order
    gauges: tuple[tuple[str, bool], ...]   # those kept in TrainState (step_time is a
    #                                      histogram), each with whether it keeps NaN (AS_IS)
    reads_lr: bool
    throughput: bool
    seq_length: int | None     # tokens per sample
    stop_on_nonfinite: bool    # on_nonfinite: stop
    peak_flops: float | None
    device_samples: float | None = None   # samples one device trains per step
    flops_per_token: float | None = None

    @classmethod
    def of(cls, cfg: MonitorConfig, device_samples: float | None = None,
           flops_per_token: float | None = None) -> RecordPlan:
        names = tuple(cfg.metrics)
        gauges = tuple((n, n in AS_IS) for n in names if n != "step_time")
        return cls(names, names == SEED_METRICS, gauges,
                   "learning_rate" in names, "throughput" in names, cfg.seq_length,
                   cfg.on_nonfinite == "stop", cfg.peak_flops, device_samples, flops_per_token)


def _overriding(listeners: Iterable[StepListener], hook: str) -> tuple[StepListener, ...]:
    base = getattr(StepListener, hook)
    return tuple(listener for listener in listeners if getattr(type(listener), hook) is not base)


class StepRecorder:
    """One run's step path (see the module docstring).

    - `run`: what listeners may ask of the run (the monitor); `run_end`: the run's end, which
      knows whether it was stopped and whether it is ending (mfotel.run_end).
    - `lines`: the monitor lines' writer, None when this rank writes none.
    - `read_learning_rate()`: the rate the step used, when its outputs do not carry it.
    - `warn_once(key, message)`, `count_error(stage, exc)`: the monitor's.
    - `account`: the process's time account (mfotel.time_account), told each step's begin
      and end and each evaluation, read into the monitor lines; None: none kept.
    """

    __slots__ = ("instruments", "plan", "run", "run_end", "state", "account", "lines",
                 "read_learning_rate", "warn_once", "count_error", "rank", "job_name",
                 "_durations", "_on_step_begin", "_on_nonfinite", "_on_record",
                 "_on_step")  # read every step

    def __init__(self, instruments: Instruments, plan: RecordPlan, run: RunControl,
                 run_end: RunEnd, *, lines: LineWriter | None = None,
                 read_learning_rate: Callable[[], float | None] = lambda: None,
                 warn_once: Callable[[str, str], None] = lambda key, message: None,
                 count_error: Callable[[str, BaseException], None] = lambda stage, exc: None,
                 rank: int = 0, job_name: str = "", account: TimeAccount | None = None) -> None:
        self.instruments, self.plan, self.run, self.run_end = instruments, plan, run, run_end
        self.state, self.account = instruments.state, account
        self._durations = instruments.step_durations   # the histogram's queue
        self.lines, self.read_learning_rate = lines, read_learning_rate
        self.warn_once, self.count_error = warn_once, count_error
        self.rank, self.job_name = rank, job_name
        self.attach(())

    def attach(self, listeners: Iterable[StepListener]) -> None:
        """Call `listeners` (in this order) from now on, each for the hooks it overrides."""
        listeners = tuple(listeners)
        self._on_step_begin = _overriding(listeners, "on_step_begin")
        self._on_nonfinite = _overriding(listeners, "on_nonfinite")
        self._on_record = _overriding(listeners, "on_record")
        self._on_step = _overriding(listeners, "on_step")

    def begin(self, wall: float) -> None:
        """A step begins at unix time `wall`: inside a step from now (job-level signals)."""
        self.state.step_begin_timestamp = wall
        account = self.account
        if account is not None:
            account.step_begin(wall)
        self.instruments.version += 1
        for listener in self._on_step_begin:
            try:
                listener.on_step_begin(wall)
            except Exception as exc:  # noqa: BLE001 - an optional part must not stop the others
                self.count_error("callback", exc)

    def end(self, tick: Tick, out: StepOutputs, epoch: int, total_steps: int | None,
            wall: float) -> None:
        """A step ended at unix time `wall`: `tick` from the step clock, `out` its outputs."""
        # every step: locals unpacked once, no call that a step without news does not need
        step, previous, advanced, seconds, outside, samples, record = tick
        account = self.account
        if account is not None:   # first: a record's line reads it (its time is `wall`)
            account.step_end(wall, advanced)
        st = self.state
        if st.status != STATUS_RUNNING:
            self.run_end.running_again()
        st.step, st.steps, st.last_step_timestamp, st.epoch = \
            step, st.steps + advanced, wall, epoch
        if total_steps:
            st.progress = step / total_steps if step < total_steps else 1.0
        if seconds is not None:   # Instruments.record_step_seconds, inline
            durations = self._durations
            if durations is not None:
                durations.append(seconds)
                if len(durations) >= PENDING_LIMIT:
                    self.instruments.hand_over()
        if outside is not None:
            st.step_outside += outside
        if samples:
            st.samples = (st.samples or 0) + samples
            seq_length = self.plan.seq_length
            if seq_length:
                st.tokens = (st.tokens or 0) + samples * seq_length
        loss, norm, overflow, loss_scale, _, _ = out
        finite = True
        if loss is not None:
            if isfinite(loss):
                st.loss_finite = 1
            else:
                st.loss_finite, finite = 0, False
        if norm is not None and not isfinite(norm):
            finite = False
        if overflow is not None:
            st.overflow = (st.overflow or 0) + int(overflow)
        if loss_scale is not None and isfinite(loss_scale):
            st.loss_scale = loss_scale
        if record is not None or not finite or self._on_step:
            sample = _new_tuple(StepSample, (step, previous, out, record is not None, self.run))
            if not finite:
                self._nonfinite(sample, st)
            if record is not None:
                self._record(sample, record, st, wall)
            for listener in self._on_step:
                try:
                    listener.on_step(sample)
                except Exception as exc:  # noqa: BLE001 - an optional part must not stop others
                    self.count_error("callback", exc)
        self.instruments.version += 1

    def evaluated(self, loss: float | None, seconds: float | None, step: int) -> None:
        """An evaluation ran after step `step` (None: not known)."""
        st = self.instruments.state
        if loss is not None:
            st.eval_loss, st.eval_step = loss, step
        if seconds is not None:
            st.eval_duration = seconds
            if self.account is not None:
                self.account.interval("evaluation", seconds, time.time())
        self.instruments.touch()
        log.info("mfotel: evaluation after step %d: loss %s, %.3f s", step,
                 "unknown" if loss is None else f"{loss:.6g}", seconds or 0.0)

    def _nonfinite(self, sample: StepSample, st: TrainState) -> None:
        """A step whose loss or gradient norm is NaN / Inf: count, warn once, stop if asked,
        tell the listeners."""
        step, loss, norm = sample.step, sample.outputs.loss, sample.outputs.grad_norm
        names = self.plan.names  # a NaN between two records is exposed too, as it is
        if loss is not None and not isfinite(loss):
            st.nonfinite["loss"] += 1
            if "loss" in names:
                st.loss = loss
            if st.first_nonfinite_step is None:
                st.first_nonfinite_step = step
            self.warn_once("nonfinite", f"mfotel: loss is {loss} at step {step} on rank "
                           f"{self.rank} (job {self.job_name}); see "
                           f"mindformers_train_nonfinite_total")
            if self.plan.stop_on_nonfinite and not self.run_end.stopped:
                self.run.request_stop("on_nonfinite: stop")
                log.warning("mfotel: stopping the run after step %d (on_nonfinite: stop)", step)
        if norm is not None and not isfinite(norm):
            st.nonfinite["grad_norm"] += 1
            if "grad_norm" in names:
                st.grad_norm = norm
        for listener in self._on_nonfinite:
            try:
                listener.on_nonfinite(sample)
            except Exception as exc:  # noqa: BLE001 - an optional part must not stop the others
                self.count_error("callback", exc)

    def _record(self, sample: StepSample, record: Record, st: TrainState, wall: float) -> None:
        """Seed metrics of a record step; throughput and step_time are means over the steps
        since the previous record (wall time between the two step ends)."""
        out, plan = sample.outputs, self.plan
        lr = out.learning_rate
        if lr is None and plan.reads_lr:
            lr = self.read_learning_rate()
        row = {"loss": out.loss, "learning_rate": lr, "grad_norm": out.grad_norm,
               "throughput": record.throughput, "step_time": record.step_time}
        # the configured order is the line's order; step_time is a histogram (every step)
        values = row if plan.all else {name: row[name] for name in plan.names}
        for name, as_is in plan.gauges:
            value = row[name]
            if value is not None and (as_is or isfinite(value)):
                setattr(st, name, value)
        if plan.throughput and plan.seq_length:
            self._device_throughput(record, st)
        lines = self.lines
        if lines is not None:   # files: the account at `wall`, as `mfotel goodput` reads it
            account = self.account
            lines.submit(sample.step, st.epoch or 0, values, wall, account.line_values()
                         if account is not None and lines.keeps_records else None)
        for listener in self._on_record:
            try:
                listener.on_record(sample, values)
            except Exception as exc:  # noqa: BLE001 - an optional part must not stop the others
                self.count_error("callback", exc)

    def _device_throughput(self, record: Record, st: TrainState) -> None:
        """Tokens/s per device and MFU over the record interval (README, Time figures)."""
        plan = self.plan
        per_step, seq = plan.device_samples, plan.seq_length
        if not (per_step and seq and record.elapsed > 0 and record.steps):
            return
        st.device_tokens = per_step * seq * record.steps / record.elapsed
        if plan.flops_per_token and plan.peak_flops:
            st.mfu = mfu(st.device_tokens, plan.flops_per_token, plan.peak_flops)
