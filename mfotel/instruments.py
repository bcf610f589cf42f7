"""OTel instruments of the metric contract, fed from plain Python state.

Gauges and counters are *observable* instruments reading `TrainState`: the training thread
only assigns attributes (well under a microsecond each) and the SDK does its work when a
reader collects. Step durations are appended to a list and handed to the SDK histogram at
collection time (or every PENDING_LIMIT steps), which keeps the SDK's ~10 us per-record
attribute hashing off the training thread.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Iterable

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from .contract import CONTRACT, STATUS_INITIALISING, STEP_TIME_BUCKETS, MetricSpec

#: Label values pre-created at 0 so that `increase()` sees the very first event.
NONFINITE_METRICS = ("loss", "grad_norm")
ERROR_STAGES = ("callback", "extract", "sink", "server", "otlp", "alertmanager")
PENDING_LIMIT = 4096
#: Cardinality `health`: these are exposed only by the metric ranks (one per data-parallel
#: group); every rank keeps its health signals and an +Inf-only step-time histogram.
RANK_VALUE_KEYS = frozenset({"loss", "learning_rate", "grad_norm", "throughput",
                             "device_tokens", "mfu"})


@dataclass
class TrainState:
    """Current values; None means "not reported" (the series is absent)."""

    loss: float | None = None
    learning_rate: float | None = None
    grad_norm: float | None = None
    throughput: float | None = None
    device_tokens: float | None = None      # tokens/s per device over the record interval
    mfu: float | None = None                # model FLOPs utilisation, 0..1
    samples: int | None = None
    tokens: int | None = None
    step: int | None = None
    steps: int = 0
    last_step_timestamp: float | None = None
    loss_finite: int | None = None
    overflow: int | None = None
    loss_scale: float | None = None
    epoch: int | None = None
    progress: float | None = None
    status: int = STATUS_INITIALISING
    first_nonfinite_step: int | None = None
    start_timestamp: float | None = None
    # checkpoints (mfotel.checkpoints) and evaluation; absent when the run has none
    last_checkpoint_timestamp: float | None = None
    checkpoint_duration: float | None = None
    checkpoints: int | None = None
    checkpoint_interval_steps: int | None = None
    checkpoint_interval_seconds: float | None = None
    eval_loss: float | None = None
    eval_step: int | None = None
    eval_duration: float | None = None
    nonfinite: dict[str, int] = field(default_factory=lambda: dict.fromkeys(NONFINITE_METRICS, 0))
    export_errors: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ERROR_STAGES, 0))
    actions: dict[tuple[str, str], int] = field(default_factory=dict)  # (action, source)


class Instruments:
    """Creates the contract's instruments on `meter`, all labelled with `attributes`.

        inst = Instruments(meter, {"job_name": "llama", "rank": "0"}, selected=("loss",))
        inst.state.loss = 2.3          # visible at the next collection
        inst.record_step_seconds(0.12)
    """

    def __init__(self, meter: Meter, attributes: dict[str, str], selected: Iterable[str],
                 identity_labels: dict[str, str] | None = None,
                 native_meter: Meter | None = None, *, cardinality: str = "full",
                 seed_values: bool = True) -> None:
        self.meter = meter
        self.native_meter = native_meter or meter
        self.version = 0         # bumped whenever state changes; keys the exposition cache
        self.native_version = 0  # bumped by set_native
        self.attributes = dict(attributes)
        self.state = TrainState()
        self.selected = frozenset(selected)
        self._info_attributes = {**self.attributes, **(identity_labels or {})}
        self._native: dict[str, dict[frozenset, tuple[dict[str, str], float]]] = {}
        self._native_lock = threading.Lock()
        self._histogram = None
        self._pending_seconds: list[float] = []
        self.cardinality = cardinality  # full | health (multi-rank scale)
        for spec in CONTRACT:
            if spec.seed_metric is None or spec.seed_metric in self.selected:
                if seed_values or spec.key not in RANK_VALUE_KEYS:
                    self._create(spec)

    # ------------------------------------------------------------ creation
    def _create(self, spec: MetricSpec) -> None:
        if spec.kind == "histogram":
            self._histogram = self.meter.create_histogram(
                spec.otel_name, unit=spec.unit, description=spec.description,
                explicit_bucket_boundaries_advisory=(
                    [] if self.cardinality == "health" else list(STEP_TIME_BUCKETS)))
            return
        factory = (self.meter.create_observable_counter if spec.kind == "counter"
                   else self.meter.create_observable_gauge)
        factory(spec.otel_name, callbacks=[self._observer(spec.key)], unit=spec.unit,
                description=spec.description)

    def _observer(self, key: str) -> Callable[[CallbackOptions], list[Observation]]:
        state, attrs = self.state, self.attributes
        if key == "rank_info":
            info = self._info_attributes

            def observe_info(options: CallbackOptions) -> list[Observation]:
                self.flush()  # collection runs observable callbacks before reading storage
                return [Observation(1, info)]
            return observe_info
        if key == "actions":  # mfotel.actions.engine: (action, source) -> count
            return lambda options: [Observation(count, {**attrs, "action": action, "source": source})
                                    for (action, source), count in list(state.actions.items())]
        if key in ("nonfinite", "export_errors"):
            label = "metric" if key == "nonfinite" else "stage"
            return lambda options: [Observation(count, {**attrs, label: name})
                                    for name, count in getattr(state, key).items()]

        def observe(options: CallbackOptions) -> list[Observation]:
            value = getattr(state, key)
            return [] if value is None else [Observation(value, attrs)]
        return observe

    # ------------------------------------------------------------ recording
    def touch(self) -> None:
        """Mark the state changed, so the next scrape re-collects."""
        self.version += 1

    def record_step_seconds(self, seconds: float) -> None:
        """Queue one step duration for the histogram (recorded into the SDK at collection)."""
        if self._histogram is not None:
            self._pending_seconds.append(seconds)
            if len(self._pending_seconds) >= PENDING_LIMIT:
                self.flush()

    def flush(self) -> None:
        """Hand queued step durations to the SDK histogram (any thread)."""
        pending, self._pending_seconds = self._pending_seconds, []
        for seconds in pending:
            self._histogram.record(seconds, self.attributes)

    def count_error(self, stage: str) -> None:
        errors = self.state.export_errors
        errors[stage] = errors.get(stage, 0) + 1
        self.version += 1

    def set_native(self, name: str, value: float, labels: dict[str, str] | None = None) -> None:
        """Expose `mindformers_train_<name>{labels}` (mindformers-native metrics bridge).

        `labels` must have bounded values (e.g. a filtered `param` name).
        """
        labels = {**self.attributes, **(labels or {})}
        key = frozenset(labels.items())
        with self._native_lock:
            series = self._native.get(name)
            if series is None:
                series = self._native[name] = {}
                self.native_meter.create_observable_gauge(
                    f"mindformers.train.{name}", callbacks=[self._native_observer(name)],
                    description=f"mindformers native metric {name}")
            series[key] = (labels, float(value))
            self.native_version += 1

    def _native_observer(self, name: str) -> Callable[[CallbackOptions], list[Observation]]:
        def observe(options: CallbackOptions) -> list[Observation]:
            with self._native_lock:
                items = list(self._native[name].values())
            return [Observation(value, labels) for labels, value in items
                    if value == value and abs(value) != float("inf")]
        return observe
