"""How optional parts follow a run: a small listener contract (no MindSpore import).

The step path (mfotel.step_record) records the metric contract itself, the job-level series
included; everything optional (the live page's history, the fast page on the first
non-finite loss, the actions engine, the node agent's step heartbeat) attaches as a
`StepListener` and is called in the order attached:

    class Printer(StepListener):
        def on_record(self, sample, values):
            print(sample.step, values["loss"])

    monitor.add_listener(Printer())     # before training, or from an integration at train begin

A listener runs on the training thread: it keeps its work small (assignments, a queue put)
and never raises (a failure is counted in `mfotel_export_errors_total{stage="callback"}`).
Each hook calls only the listeners that override it: `on_step_begin` and `on_step` cost every
step, the others come with the steps that matter to them (records, non-finite values).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol

from .extract import StepOutputs


class RunControl(Protocol):
    """What a listener may ask of the run (OTelMonitor implements it)."""

    def request_stop(self, reason: str) -> None:
        """Stop training after this step (once; a reason is logged)."""

    def optimizer(self) -> Any:
        """The run's optimizer, or None."""

    def learning_rate_changed(self) -> None:
        """The optimizer's learning rate was changed in place: read it anew."""


class StepSample(NamedTuple):
    """One completed step, as listeners see it."""

    step: int               # global step
    previous_step: int      # the step before it (a sink advances several)
    outputs: StepOutputs    # loss, grad norm, ... of this step (may be non-finite)
    recorded: bool          # a record step (seed metrics recorded, lines written)
    run: RunControl


class StepListener:
    """Base class: override what you need; every method is a no-op here."""

    def on_step_begin(self, wall: float) -> None:
        """Every step's begin (unix time `wall`). Only listeners that override it are called."""

    def on_step(self, sample: StepSample) -> None:
        """Every step, after the contract's series were updated (last of the step's calls).
        Only listeners that override it are called every step."""

    def on_nonfinite(self, sample: StepSample) -> None:
        """A step whose loss or gradient norm is NaN or Inf (first of the step's calls)."""

    def on_record(self, sample: StepSample, values: Mapping[str, float | None]) -> None:
        """At a record step, with the seed metrics recorded (None: not available)."""

    def on_close(self) -> None:
        """The run ends (after the final status, before the endpoint stops)."""
