"""OTel instruments of the metric contract, fed from plain Python state.

Gauges and counters are *observable* instruments reading `TrainState`: the training thread
only assigns attributes (well under a microsecond each) and the SDK does its work when a
reader collects. Step durations are appended to a queue and handed to the SDK histogram at
collection time, which keeps the SDK's ~10 us per record off the training thread; when no
reader collected for PENDING_LIMIT steps (no scrape, no OTLP push), a short-lived thread
hands them over, so memory stays bounded and the training thread never does.

The loss and the gradient norm are kept as they are (NaN, +Inf, -Inf). The OTel SDK drops
non-finite measurements, so their instruments observe the last finite value (what an OTLP
push carries), and `nonfinite_values()` tells /metrics what to show instead, at collection.
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from math import isfinite

from opentelemetry.metrics import CallbackOptions, Histogram, Meter, Observation

from .contract import CONTRACT, STATUS_INITIALISING, STEP_TIME_BUCKETS, MetricSpec

#: Label values pre-created at 0 so that `increase()` sees the very first event.
NONFINITE_METRICS = ("loss", "grad_norm")
ERROR_STAGES = ("callback", "extract", "sink", "server", "scrape", "otlp", "alertmanager",
                "shutdown", "node_link")
PENDING_LIMIT = 4096
#: Cardinality `health`: these are exposed only by the metric ranks (one per data-parallel
#: group); every rank keeps its health signals and an +Inf-only step-time histogram.
#: A native metric's series: label set -> (labels, value).
_NativeSeries = dict[frozenset[tuple[str, str]], tuple[dict[str, str], float]]
#: Gauges /metrics exposes as they are, NaN and Inf included (mfotel.telemetry).
AS_IS = ("loss", "grad_norm")
RANK_VALUE_KEYS = frozenset({"loss", "learning_rate", "grad_norm", "throughput",
                             "device_tokens", "mfu"})


@dataclass(slots=True)  # assigned every step: slots, not a dict
class TrainState:
    """Current values; None means "not reported" (the series is absent). `loss` and
    `grad_norm` are as the step gave them, NaN/Inf included."""

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
    step_outside: float = 0.0               # seconds outside the timed steps, summed
    step_begin_timestamp: float | None = None  # unix time the current / last step began
    loss_finite: int | None = None
    overflow: int | None = None
    loss_scale: float | None = None
    epoch: int | None = None
    progress: float | None = None
    status: int = STATUS_INITIALISING
    first_nonfinite_step: int | None = None
    start_timestamp: float | None = None
    end_timestamp: float | None = None      # when the final status was set
    end_reason: str | None = None           # completed, failed, stopped, cancelled
    # the time account (mfotel.time_account): its `totals` (phase -> seconds, a live view)
    # and its origin; absent until an account is attached
    time: Mapping[str, float] = field(default_factory=dict)
    process_start_timestamp: float | None = None
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
        self._native: dict[str, _NativeSeries] = {}
        self._native_lock = threading.Lock()
        self._histogram: Histogram | None = None
        self._as_is: list[MetricSpec] = []   # created gauges of AS_IS
        #: step durations waiting for the histogram (append / popleft: thread-safe); the
        #: training thread appends itself (mfotel.step_record) and calls hand_over() at
        #: PENDING_LIMIT; None when the histogram is not exposed
        self.step_durations: deque[float] | None = deque()
        self._recording = threading.Lock()   # one thread at a time hands durations over
        self._handing_over = False           # a hand-over thread runs
        self.cardinality = cardinality  # full | health (multi-rank scale)
        for spec in CONTRACT:
            if spec.seed_metric is None or spec.seed_metric in self.selected:
                if seed_values or spec.key not in RANK_VALUE_KEYS:
                    self._create(spec)
        if self._histogram is None:
            self.step_durations = None

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
        if spec.key in AS_IS:
            self._as_is.append(spec)

    def _observer(self, key: str) -> Callable[[CallbackOptions], list[Observation]]:
        state, attrs = self.state, self.attributes
        if key == "rank_info":
            info = self._info_attributes

            def observe_info(options: CallbackOptions) -> list[Observation]:
                self.flush()  # collection runs observable callbacks before reading storage
                return [Observation(1, info)]
            return observe_info
        if key == "actions":  # mfotel.actions.engine: (action, source) -> count
            return lambda options: [
                Observation(count, {**attrs, "action": action, "source": source})
                for (action, source), count in list(state.actions.items())]
        if key == "end_timestamp":
            return lambda options: [] if state.end_timestamp is None else [
                Observation(state.end_timestamp, {**attrs, "reason": state.end_reason or ""})]
        if key in ("nonfinite", "export_errors", "time"):
            label = {"nonfinite": "metric", "export_errors": "stage", "time": "phase"}[key]
            return lambda options: [Observation(count, {**attrs, label: name})
                                    for name, count in list(getattr(state, key).items())]

        if key in AS_IS:
            return self._last_finite_observer(key)

        def observe(options: CallbackOptions) -> list[Observation]:
            value = getattr(state, key)
            return [] if value is None else [Observation(value, attrs)]
        return observe

    def _last_finite_observer(self, key: str) -> Callable[[CallbackOptions], list[Observation]]:
        """Observes the last finite value of `key`: a NaN observed would remove the series
        from the OTel readers until the next finite one."""
        state, attrs = self.state, self.attributes
        last: list[float] = []   # the last finite value, once there is one

        def observe(options: CallbackOptions) -> list[Observation]:
            value = getattr(state, key)
            if value is not None and isfinite(value):
                last[:] = [value]
            return [] if value is None else [Observation(v, attrs) for v in last]
        return observe

    def nonfinite_values(self) -> list[tuple[MetricSpec, dict[str, str], float]]:
        """(spec, labels, value) of each AS_IS gauge whose value is NaN/Inf now: what /metrics
        shows in place of the last finite value the OTel instrument carries."""
        state = self.state
        return [(spec, self.attributes, value) for spec in self._as_is
                if (value := getattr(state, spec.key)) is not None and not isfinite(value)]

    # ------------------------------------------------------------ recording
    def touch(self) -> None:
        """Mark the state changed, so the next scrape re-collects."""
        self.version += 1

    def record_step_seconds(self, seconds: float) -> None:
        """Queue one step duration for the histogram (recorded into the SDK at collection)."""
        pending = self.step_durations
        if pending is not None:
            pending.append(seconds)
            if len(pending) >= PENDING_LIMIT:
                self.hand_over()

    def hand_over(self) -> None:
        """PENDING_LIMIT durations wait and no reader collected them: a short-lived thread
        hands them to the SDK (memory stays bounded, the training thread never does it)."""
        if not self._handing_over:
            self._handing_over = True
            threading.Thread(target=self._hand_over, name="mfotel-histogram",
                             daemon=True).start()

    @property
    def pending_step_durations(self) -> int:
        """Step durations queued for the histogram (handed over at the next collection)."""
        return len(self.step_durations or ())

    def _hand_over(self) -> None:
        try:
            self.flush()
        finally:
            self._handing_over = False

    def flush(self) -> None:
        """Hand queued step durations to the SDK histogram (any thread; a collection waits for
        a hand-over under way, so it sees every duration queued before it)."""
        with self._recording:
            pending, histogram, attributes = self.step_durations, self._histogram, \
                self.attributes
            while pending and histogram is not None:
                histogram.record(pending.popleft(), attributes)

    def count_error(self, stage: str) -> None:
        """One more error swallowed at `stage` (mfotel_export_errors_total{stage})."""
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
