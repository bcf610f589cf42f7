"""What a step end changes (mfotel.step_record): one table of runs, each a list of step ends
(a Tick as the step clock yields it, the step's outputs) and what they must leave: the exposed
state, the listeners' events, the monitor lines, warnings and stop requests. Real instruments
on an in-memory meter; no MindSpore (and a test that the step path cannot import it)."""
from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider

from mfotel.config import parse_config
from mfotel.contract import STATUS_CANCELLED, STATUS_INITIALISING, STATUS_RUNNING
from mfotel.extract import StepOutputs
from mfotel.instruments import Instruments
from mfotel.listeners import StepListener, StepSample
from mfotel.run_end import RunEnd
from mfotel.step_clock import Record, Tick
from mfotel.step_record import RecordPlan, StepRecorder

NAN, INF = math.nan, math.inf
WALL = 1000.0   # step n ends at WALL + n


@dataclass
class End:
    """One step end of a case: the Tick's fields, the outputs, the hook's context."""

    step: int
    outputs: dict[str, Any] = field(default_factory=dict)
    advanced: int = 1
    seconds: float | None = None
    outside: float | None = None
    samples: int = 0
    record: Record | None = None
    epoch: int = 1
    total: int | None = None


def rec(elapsed: float = 1.0, steps: int = 1, samples: int = 0, throughput: float | None = None,
        step_time: float | None = None) -> Record:
    return Record(elapsed, steps, samples, throughput, step_time)


class Heard(StepListener):
    """Every event, in order."""

    def __init__(self, events: list[tuple]) -> None:
        self.events = events

    def on_nonfinite(self, sample: StepSample) -> None:
        self.events.append(("nonfinite", sample.step))

    def on_record(self, sample: StepSample, values) -> None:
        self.events.append(("record", sample.step, dict(values)))


class EveryStep(Heard):
    def on_step_begin(self, wall: float) -> None:
        self.events.append(("begin", wall))

    def on_step(self, sample: StepSample) -> None:
        self.events.append(("step", sample.step, sample.recorded, sample.previous_step))


class Broken(StepListener):
    def on_step(self, sample: StepSample) -> None:
        raise RuntimeError("listener bug")


@dataclass
class Case:
    name: str
    ends: list[End]
    settings: dict[str, Any] = field(default_factory=dict)
    plan: dict[str, Any] = field(default_factory=dict)   # device_samples, flops_per_token
    listeners: tuple[type, ...] = (Heard,)
    status: int = STATUS_INITIALISING     # before the first end
    state: dict[str, Any] = field(default_factory=dict)   # TrainState fields after the last
    events: list[tuple] | None = None     # None: not checked
    lines: list[tuple] | None = None      # (step, epoch, values); None: not checked
    warned: set[str] = field(default_factory=set)
    stops: list[str] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    lr_reads: int | None = None
    durations: int | None = None          # step times queued for the histogram


CASES = [
    Case("the first step: running, its step, timestamp, epoch and progress",
         [End(1, {"loss": 2.0}, epoch=1, total=10)],
         state=dict(status=STATUS_RUNNING, step=1, steps=1, last_step_timestamp=WALL + 1,
                    epoch=1, progress=0.1, loss_finite=1, loss=None), events=[], lines=None),
    Case("sink mode: steps count what each end advanced; progress stops at 1",
         [End(4, advanced=4, total=10), End(12, advanced=8, total=10)],
         state=dict(step=12, steps=12, progress=1.0, loss_finite=None)),
    Case("step time queued for the histogram, time outside summed, samples and tokens",
         [End(1, seconds=0.5, samples=8), End(2, seconds=0.25, outside=0.125, samples=8),
          End(3, outside=0.25)],
         settings=dict(seq_length=16, metrics=["loss", "step_time"]),
         state=dict(step_outside=0.375, samples=16, tokens=256), durations=2),
    Case("no batch size: samples and tokens stay absent",
         [End(1, seconds=0.5)], settings=dict(seq_length=16),
         state=dict(samples=None, tokens=None)),
    Case("loss scale: overflows counted, a non-finite scale never exposed",
         [End(1, {"overflow": True, "loss_scale": 1024.0}),
          End(2, {"overflow": False, "loss_scale": INF}),
          End(3, {"overflow": True, "loss_scale": 512.0})],
         state=dict(overflow=2, loss_scale=512.0)),
    Case("a NaN loss: counted, exposed as it is, its first step kept, warned, heard",
         [End(1, {"loss": 1.0}), End(2, {"loss": NAN}), End(3, {"loss": INF})],
         state=dict(loss=INF, loss_finite=0, first_nonfinite_step=2,
                    nonfinite={"loss": 2, "grad_norm": 0}),
         events=[("nonfinite", 2), ("nonfinite", 3)], lines=[], warned={"nonfinite"}),
    Case("a NaN loss outside the configured metrics is counted, not exposed",
         [End(1, {"loss": NAN})], settings=dict(metrics=["grad_norm"]),
         state=dict(loss=None, loss_finite=0, nonfinite={"loss": 1, "grad_norm": 0}),
         warned={"nonfinite"}),
    Case("on_nonfinite: stop asks once",
         [End(1, {"loss": NAN}), End(2, {"loss": NAN})], settings=dict(on_nonfinite="stop"),
         stops=["on_nonfinite: stop"], warned={"nonfinite"}),
    Case("a NaN gradient norm: counted and heard; the loss is still finite",
         [End(5, {"loss": 1.5, "grad_norm": NAN})],
         settings=dict(metrics=["loss", "grad_norm"]),
         state=dict(grad_norm=NAN, loss_finite=1, first_nonfinite_step=None,
                    nonfinite={"loss": 0, "grad_norm": 1}),
         events=[("nonfinite", 5)], warned=set()),
    Case("record step: the configured order, gauges only when finite, loss as it is",
         [End(1, {"loss": 2.0, "grad_norm": 0.5}),
          End(2, {"loss": 1.5, "grad_norm": 0.25}, record=rec(2.0, 2, step_time=1.0)),
          End(4, {"loss": NAN, "grad_norm": 0.125}, epoch=2, record=rec(2.0, 2))],
         settings=dict(metrics=["grad_norm", "loss", "step_time"]),
         state=dict(loss=NAN, grad_norm=0.125),
         events=[("record", 2, {"grad_norm": 0.25, "loss": 1.5, "step_time": 1.0}),
                 ("nonfinite", 4),
                 ("record", 4, {"grad_norm": 0.125, "loss": NAN, "step_time": None})],
         lines=[(2, 1, {"grad_norm": 0.25, "loss": 1.5, "step_time": 1.0}),
                (4, 2, {"grad_norm": 0.125, "loss": NAN, "step_time": None})],
         warned={"nonfinite"}),
    Case("every seed metric: the whole row, throughput and step time from the record",
         [End(10, {"loss": 1.0, "grad_norm": 2.0, "learning_rate": 0.5},
              record=rec(4.0, 10, 80, throughput=20.0, step_time=0.4))],
         settings=dict(metrics=["loss", "learning_rate", "grad_norm", "throughput",
                                "step_time"]),
         state=dict(loss=1.0, learning_rate=0.5, grad_norm=2.0, throughput=20.0),
         lines=[(10, 1, {"loss": 1.0, "learning_rate": 0.5, "grad_norm": 2.0,
                         "throughput": 20.0, "step_time": 0.4})], lr_reads=0),
    Case("the learning rate is read at record steps only, when the outputs lack it",
         [End(1, {"loss": 1.0}), End(2, {"loss": 1.0}, record=rec()), End(3, {"loss": 1.0}),
          End(4, {"loss": 1.0}, record=rec())],
         settings=dict(metrics=["learning_rate"]), state=dict(learning_rate=0.01),
         lines=[(2, 1, {"learning_rate": 0.01}), (4, 1, {"learning_rate": 0.01})],
         lr_reads=2),
    Case("tokens per device and MFU over the record interval",
         [End(4, record=rec(2.0, 4, 32, throughput=16.0))],
         settings=dict(metrics=["throughput"], seq_length=128, peak_flops=1e12),
         plan=dict(device_samples=4.0, flops_per_token=1e9),
         state=dict(throughput=16.0, device_tokens=1024.0, mfu=1.024)),
    Case("tokens per device without MFU when the FLOPs per token are unknown",
         [End(4, record=rec(2.0, 4, 32, throughput=16.0))],
         settings=dict(metrics=["throughput"], seq_length=128, peak_flops=1e12),
         plan=dict(device_samples=4.0), state=dict(device_tokens=1024.0, mfu=None)),
    Case("only listeners that override on_step hear every step; a failing one is counted",
         [End(1, {"loss": 1.0}), End(2, {"loss": NAN}, record=rec())],
         settings=dict(metrics=["loss"]), listeners=(Broken, EveryStep),
         events=[("step", 1, False, 0), ("nonfinite", 2), ("record", 2, {"loss": NAN}),
                 ("step", 2, True, 1)],
         errors={"callback": 2}, warned={"nonfinite"}),
    Case("steps after a signal show running again",
         [End(7, {"loss": 1.0})], status=STATUS_CANCELLED, state=dict(status=STATUS_RUNNING)),
]


def run_case(case: Case) -> dict[str, Any]:
    instruments = Instruments(MeterProvider().get_meter("test"),
                              {"job_name": "job", "rank": "0"},
                              parse_config(case.settings).metrics)
    instruments.state.status = case.status
    warned: dict[str, str] = {}
    end = RunEnd(instruments, warned.setdefault)
    stops: list[str] = []
    lines: list[tuple] = []
    errors: dict[str, int] = {}
    lr_reads: list[int] = []

    class Control:   # the monitor's RunControl: a stop goes through the run's end, once
        def request_stop(self, reason: str) -> None:
            end.stop(lambda: stops.append(reason))

        def optimizer(self) -> Any:
            return None

        def learning_rate_changed(self) -> None:
            pass

    class Lines:
        keeps_records = True

        def submit(self, step: int, epoch: int, values: dict, wall: float,
                   record: dict | None = None) -> None:
            assert wall == WALL + step and record is None   # no time account here
            lines.append((step, epoch, dict(values)))

    def read_lr() -> float:
        lr_reads.append(1)
        return 0.01

    def count(stage: str, exc: BaseException) -> None:
        errors[stage] = errors.get(stage, 0) + 1
    cfg = parse_config(case.settings)
    recorder = StepRecorder(instruments, RecordPlan.of(cfg, **case.plan), Control(), end,
                            lines=Lines(), read_learning_rate=read_lr,  # type: ignore[arg-type]
                            warn_once=warned.setdefault, count_error=count, rank=3,
                            job_name="job")
    events: list[tuple] = []
    recorder.attach([kind(events) if kind is not Broken else kind()
                     for kind in case.listeners])
    previous = 0
    for e in case.ends:
        if EveryStep in case.listeners:
            recorder.begin(WALL + e.step - 0.5)
        tick = Tick(e.step, previous, e.advanced, e.seconds, e.outside, e.samples, e.record)
        recorder.end(tick, StepOutputs(**e.outputs), e.epoch, e.total, WALL + e.step)
        previous = e.step
    return dict(instruments=instruments, warned=warned, stops=stops, lines=lines,
                errors=errors, events=[ev for ev in events if ev[0] != "begin"],
                begins=[ev for ev in events if ev[0] == "begin"], lr_reads=len(lr_reads))


def same(got: Any, want: Any) -> bool:
    if isinstance(want, float) and isinstance(got, float):
        return got == pytest.approx(want, nan_ok=True)
    if isinstance(want, dict) and isinstance(got, dict):
        return list(got) == list(want) and all(same(got[k], want[k]) for k in want)
    if isinstance(want, (list, tuple)) and isinstance(got, (list, tuple)):
        return len(got) == len(want) and all(map(same, got, want))
    return got == want


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_step_record(case: Case):
    done = run_case(case)
    state = done["instruments"].state
    for name, want in case.state.items():
        assert same(getattr(state, name), want), (name, getattr(state, name), want)
    if case.events is not None:
        assert same(done["events"], case.events), done["events"]
    if case.lines is not None:
        assert same(done["lines"], case.lines), done["lines"]
    assert set(done["warned"]) == case.warned
    assert done["stops"] == case.stops
    assert done["errors"] == case.errors
    if case.lr_reads is not None:
        assert done["lr_reads"] == case.lr_reads
    if case.durations is not None:
        assert done["instruments"].pending_step_durations == case.durations
    if EveryStep in case.listeners:   # the step-begin hook: its timestamp, and the listener
        assert done["begins"] == [("begin", WALL + e.step - 0.5) for e in case.ends]
        assert state.step_begin_timestamp == WALL + case.ends[-1].step - 0.5


def test_the_nonfinite_warning_names_the_step_rank_and_job():
    done = run_case(Case("", [End(9, {"loss": NAN})]))
    assert done["warned"]["nonfinite"] == ("mfotel: loss is nan at step 9 on rank 3 (job job); "
                                           "see mindformers_train_nonfinite_total")


def test_each_step_end_marks_the_state_changed_and_a_closing_run_keeps_its_status():
    done = run_case(Case("", [End(1), End(2)]))
    instruments = done["instruments"]
    assert instruments.version == 2 and instruments.pending_step_durations == 0
    end = RunEnd(instruments, lambda key, message: None)
    end.begin(STATUS_CANCELLED)
    instruments.state.status = STATUS_CANCELLED    # shown by the close
    plan = RecordPlan.of(parse_config({}))
    recorder = StepRecorder(instruments, plan, None, end)  # type: ignore[arg-type]
    recorder.end(Tick(3, 2, 1, None, None, 0, None), StepOutputs(), 1, None, WALL + 3)
    assert instruments.state.status == STATUS_CANCELLED and instruments.state.step == 3


def test_the_step_path_imports_without_mindspore():
    """The per-step path and the run's assembly import neither MindSpore nor mindformers (the
    callback is the only adapter): a fresh interpreter imports them and looks."""
    code = ("import sys\n"
            "import mfotel.step_record, mfotel.step_clock, mfotel.extract, mfotel.listeners\n"
            "import mfotel.run_parts, mfotel.run_end, mfotel.lifecycle, mfotel.mindspore_reads\n"
            "loaded = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('mindspore', 'mindformers'))\n"
            "assert not loaded, loaded\n"
            "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ok"]


def test_the_time_account_hears_each_step_and_evaluation_and_the_lines_carry_it(monkeypatch):
    """With the process's time account: each step's begin and end (the hook's wall times),
    an evaluation when it returns; a record's line (to the files: LineWriter.keeps_records)
    carries the account as of its step's end, which is the line's time (what `mfotel goodput`
    reads)."""
    from types import SimpleNamespace

    from mfotel import step_record
    from mfotel.time_account import LINE_FIELDS, TimeAccount
    instruments = Instruments(MeterProvider().get_meter("test"), {"job_name": "job", "rank": "0"},
                              parse_config({}).metrics)
    account = TimeAccount(WALL - 100)
    lines: list[tuple[int, float, dict]] = []

    class Lines:   # a file among the sinks: the account goes along
        keeps_records = True

        def submit(self, step: int, epoch: int, values: dict, wall: float,
                   record: dict | None = None) -> None:
            lines.append((step, wall, {**values, **(record or {})}))
    recorder = StepRecorder(instruments, RecordPlan.of(parse_config({"metrics": ["loss"]})),
                            None, RunEnd(instruments, lambda key, message: None),  # type: ignore[arg-type]
                            lines=Lines(), account=account)  # type: ignore[arg-type]
    for step, (begin, end) in enumerate([(0.5, 1.0), (1.25, 2.0), (2.5, 3.0)], start=1):
        recorder.begin(WALL + begin)
        record = rec() if step == 2 else None
        recorder.end(Tick(step, step - 1, 1, None, None, 0, record), StepOutputs(loss=1.0), 1,
                     None, WALL + end)
    assert account.totals == pytest.approx(dict(startup=101.0, step=1.25, input=0.75,
                                                checkpoint=0.0, evaluation=0.0, stall=0.0))
    step, wall, values = lines[0]
    assert (step, wall) == (2, WALL + 2.0)
    assert list(values) == ["loss", *LINE_FIELDS]
    assert values["account_steps"] == 2 and values["account_input"] == 0.25
    assert wall - sum(values[f] for f in LINE_FIELDS[1:]) == WALL - 100   # the process start
    monkeypatch.setattr(step_record, "time", SimpleNamespace(time=lambda: WALL + 10.0))
    recorder.evaluated(2.5, 4.0, 3)
    assert account.totals["evaluation"] == 4.0 and account.totals["input"] == 0.75 + 3.0
    assert account.last_event == WALL + 10.0
