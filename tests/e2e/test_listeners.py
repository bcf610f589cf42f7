"""The listener contract (mfotel.listeners) on a real tiny MindSpore training (CPU): which
listener hears of which step, what a failing listener costs, and what a listener may ask."""
from __future__ import annotations

import math

import mindspore.dataset as ds
import pytest

from mfotel import OTelMonitor
from mfotel.demo.training import SyntheticRegression, build_model
from mfotel.listeners import StepListener, StepSample

pytestmark = pytest.mark.slow
STEPS, NAN_AT = 12, 8


class Recorder(StepListener):
    """Remembers every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.values: dict[int, dict] = {}

    def on_record(self, sample: StepSample, values) -> None:
        self.calls.append(("record", sample.step))
        self.values[sample.step] = dict(values)

    def on_nonfinite(self, sample: StepSample) -> None:
        assert not math.isfinite(sample.outputs.loss)
        self.calls.append(("nonfinite", sample.step))

    def on_close(self) -> None:
        self.calls.append(("close", -1))


class EveryStep(Recorder):
    def on_step(self, sample: StepSample) -> None:
        self.calls.append(("step", sample.step))


class Broken(StepListener):
    def on_step(self, sample: StepSample) -> None:
        raise RuntimeError("listener bug")


class StopAt(StepListener):
    def __init__(self, step: int) -> None:
        self.step, self.optimizer = step, None

    def on_step(self, sample: StepSample) -> None:
        self.optimizer = sample.run.optimizer()
        if sample.step == self.step:
            sample.run.request_stop("enough")


def train(monitor: OTelMonitor, nan_at: int | None = NAN_AT) -> None:
    data = ds.GeneratorDataset(SyntheticRegression(STEPS, 8, nan_at_step=nan_at), ["x", "y"],
                               shuffle=False).batch(8)
    build_model(STEPS, 8, "constant").train(1, data, callbacks=[monitor],
                                            dataset_sink_mode=False)


def monitor(port: int) -> OTelMonitor:
    return OTelMonitor(step_interval=4, metrics=["loss", "learning_rate"], job_name="listen",
                       output={"console": False},
                       prometheus={"host": "127.0.0.1", "port": port, "linger_seconds": 0})


def test_listeners_hear_records_nonfinite_steps_and_the_close(port, in_tmp):
    mon, quiet, every, broken = monitor(port), Recorder(), EveryStep(), Broken()
    for listener in (quiet, broken, every):
        mon.add_listener(listener)
    train(mon)
    nonfinite = [("nonfinite", s) for s in range(NAN_AT, STEPS + 1)]   # stays NaN after
    records = [("record", s) for s in (4, 8, 12)]
    assert sorted(quiet.calls[:-1], key=lambda c: (c[1], c[0])) == \
        sorted(nonfinite + records, key=lambda c: (c[1], c[0]))
    assert quiet.calls[-1] == ("close", -1)
    assert quiet.values[4]["learning_rate"] == pytest.approx(0.01)
    assert [s for kind, s in every.calls if kind == "step"] == list(range(1, STEPS + 1))
    # order within a step: non-finite first, then the record, then on_step
    assert every.calls.index(("nonfinite", 8)) < every.calls.index(("record", 8)) < \
        every.calls.index(("step", 8))
    errors = mon.instruments.state.export_errors
    assert errors["callback"] == STEPS    # the broken listener, counted; the others still ran
    assert mon.instruments.state.status == 2   # on_nonfinite: warn, the run completed


def test_a_listener_may_stop_the_run(port, in_tmp):
    mon, stopper = monitor(port), StopAt(5)
    mon.add_listener(stopper)
    train(mon, nan_at=None)
    assert mon.instruments.state.step == 5 and mon.instruments.state.status == 3
    assert stopper.optimizer is not None and hasattr(stopper.optimizer, "learning_rate")
