"""OTelMonitor: the MindSpore adapter (with cells.py, the core modules that import MindSpore).

    from mfotel import OTelMonitor
    model.train(epochs, dataset, callbacks=[OTelMonitor.from_yaml("train.yaml")])
    # or: OTelMonitor(step_interval=50, metrics=["loss", "learning_rate"], log_rank=0)

The callback translates MindSpore's hooks (cb_params, run_context) for the parts that do the
work, none of which imports MindSpore: step_clock (global step, timing, records) and extract
(a step's outputs), step_record (what a step end changes), run_parts (the run's parts,
assembled at train begin), run_end (the final status, the ordered shutdown) and lifecycle
(signals). docs/architecture.md shows them all.

Extension hooks for integrations (mfotel.integrations.mindformers uses them): `mark_step_begin`
/ `mark_step_end` move the step's time marks onto another callback's hooks, `parse_outputs`
reads a step's outputs, `count_error` counts and warns once, `add_listener` attaches an
optional part, `resume_step` / `device_samples_per_step` / `flops_per_token` tell what only
the integration knows.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from mindspore.train import Callback, ModelCheckpoint

from .config import DEFAULT_JOB_NAME, MonitorConfig, load_config, override, parse_config
from .evaluation import Evaluation
from .extract import NO_OUTPUTS, StepOutputs, cb_param, eval_loss, parse_net_outputs
from .identity import identity_from_env
from .listeners import StepListener
from .mindspore_reads import LearningRateReader, identity_after_init
from .run_parts import OfRun, RunParts, assemble, checked_settings, failure_warning
from .start_checks import run_shape
from .step_clock import RecordSchedule, StepClock
from .step_record import RecordPlan, StepRecorder

__all__ = ["LearningRateReader", "OTelMonitor", "eval_loss"]
log = logging.getLogger("mfotel")
_perf, _wall = time.perf_counter, time.time   # every step: one global each


class OTelMonitor(Callback):  # type: ignore[misc]  # MindSpore has no type information
    """Exports a MindSpore training run as OpenTelemetry metrics and `[Monitor]` lines.

    Keyword arguments are the `monitor_config` keys (README, Configuration). Failures inside the
    callback never reach training: they are counted in `mfotel_export_errors_total{stage}` and
    warned about once. The run's end always reports a final status: completed, failed (an
    exception left `Model.train`, or it stopped early) or cancelled (SIGTERM / SIGINT, see
    mfotel.lifecycle), and nothing at the end raises into MindSpore (mfotel.run_end).
    """

    def __init__(self, config: MonitorConfig | None = None, **kwargs: Any) -> None:
        super().__init__()
        if config is not None and kwargs:
            raise TypeError("pass either a MonitorConfig or keyword arguments, not both")
        config = config or parse_config(kwargs, source="OTelMonitor(...)", prefix="OTelMonitor")
        self.identity = identity_from_env()
        self.config, self.job_name, self._web = checked_settings(
            config, self.default_job_name(), self.identity.rank)
        self._warned: set[str] = set()
        #: Samples one device trains per step, for tokens/s per device (default: batch_size,
        #: each rank training its own batch); integrations that know the parallel layout set it.
        self.device_samples_per_step: float | None = None
        #: Model FLOPs per token for MFU: the config's, or an integration's estimate.
        self.flops_per_token: float | None = self.config.flops_per_token
        #: The global step the run resumed from, when an integration knows it (mindformers
        #: skips the dataset by runner_config.initial_step and restarts cur_step_num at 1).
        self.resume_step: int | None = None
        #: Optional parts attached before training (add_listener); kept across runs.
        self._extra_listeners: list[StepListener] = []
        self._new_run()

    def _new_run(self) -> None:
        """The state of one `Model.train` call (a second call on the same monitor starts anew)."""
        self._parts: RunParts | None = None   # assembled at train begin (mfotel.run_parts)
        self._recorder: StepRecorder | None = None   # its recorder, read every step
        self.clock = StepClock(RecordSchedule(self.config.step_interval, self.config.early_steps,
                                              self.config.early_step_interval),
                               self.config.batch_size)
        self._lr = LearningRateReader()
        self._cb: Any = None            # cb_params of the run (one object per Model.train)
        self._optimizer: Any = None     # found in _cb when first asked for
        self._run_context: Any = None
        self._evaluation = Evaluation()  # evaluation inside training (Model.fit)

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> OTelMonitor:
        """From a YAML file's `monitor_config` block; keyword arguments override its keys."""
        cfg = load_config(path)
        if overrides:
            cfg = override(cfg, overrides, source="from_yaml overrides")
        return cls(cfg)

    def default_job_name(self) -> str:
        """The job name when neither job_name nor OTEL_SERVICE_NAME gives one."""
        return DEFAULT_JOB_NAME

    # ------------------------------------------------------------------ the run's parts
    exporter = OfRun(lambda parts: parts.exporter)
    instruments = OfRun(lambda parts: parts.exporter.instruments)  # .state: the exposed values
    telemetry = OfRun(lambda parts: parts.exporter.telemetry)
    run = OfRun(lambda parts: parts.run)
    live = OfRun(lambda parts: parts.live)
    actions = OfRun(lambda parts: parts.actions)
    #: whether a scrape saw the final status before the endpoint stopped
    final_scraped = OfRun(lambda parts: parts.end.final_scraped)

    # ------------------------------------------------------------------ extension hooks
    def count_error(self, stage: str, exc: BaseException) -> None:
        """Count a failure in `mfotel_export_errors_total{stage}` and warn once per stage."""
        if self._parts is not None:
            self._parts.exporter.instruments.count_error(stage)
        self._warn_once(f"error:{stage}", failure_warning(stage, exc))

    def mark_step_begin(self, at: float | None = None) -> None:
        """The step begins now (or at `at`, a time.perf_counter() value)."""
        self.clock.in_step_since = _perf() if at is None else at  # StepClock.begin, inline
        recorder = self._recorder
        if recorder is not None:  # inside a step from now (mfotel job-level signals)
            recorder.begin(_wall())

    def mark_step_end(self, at: float | None = None) -> None:
        """The step's own work ended now (or at `at`), before other callbacks' step-end work;
        without it the step ends when this callback's step-end hook runs."""
        self.clock.mark_end(time.perf_counter() if at is None else at)

    def parse_outputs(self, cb: Any) -> StepOutputs:
        """This step's outputs from `cb_params` (integrations override it: mindformers fixes
        the loss of pipeline / micro-batch runs)."""
        return parse_net_outputs(cb["net_outputs"] if isinstance(cb, dict) else cb.net_outputs)

    def flush_lines(self, timeout: float | None = None) -> bool:
        """Wait until the monitor lines recorded so far are written (a thread writes them,
        off the training thread); False if `timeout` seconds passed first."""
        lines = self._parts.lines if self._parts is not None else None
        return lines.flush(timeout) if lines is not None else True

    def add_listener(self, listener: StepListener) -> None:
        """Attach an optional part (mfotel.listeners); before train begin it is kept for
        every run of this monitor, during a run for that run."""
        if self._parts is None:
            self._extra_listeners.append(listener)
        else:
            self._parts.add_listener(listener)

    # RunControl (mfotel.listeners): what listeners may ask of the run
    def request_stop(self, reason: str) -> None:
        """Stop training after this step (once; the caller logs why)."""
        if self._parts is not None and self._run_context is not None:
            self._parts.end.stop(self._run_context.request_stop)

    def optimizer(self) -> Any:
        """The run's optimizer (`Model(custom_cell)` has it on the train network)."""
        if self._optimizer is None:
            cb = self._cb
            self._optimizer = cb_param(cb, "optimizer") or getattr(
                cb_param(cb, "train_network"), "optimizer", None)
        return self._optimizer

    def learning_rate_changed(self) -> None:
        self._lr = LearningRateReader()  # a list lr's table changed: read it again
        if self._recorder is not None:
            self._recorder.read_learning_rate = self._learning_rate

    def _learning_rate(self) -> float | None:
        read = self._lr.find(self.optimizer())  # found: the recorder calls it itself from now
        if read is not None and self._recorder is not None:
            self._recorder.read_learning_rate = read
        return None if read is None else read()

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)

    # ------------------------------------------------------------------ start
    def on_train_begin(self, run_context: Any) -> None:
        if not self.config.enable:
            return
        self.identity = identity_after_init()
        if self._parts is not None:  # a second Model.train call on this monitor
            self.close()  # a no-op when the first run ended normally
            self._new_run()
        cb = run_context.original_args()
        self._cb, self._run_context = cb, run_context
        shape = run_shape(cb, self.config.batch_size)
        self.clock.train_begin(int(cb_param(cb, "cur_step_num", 0) or 0), shape.total_steps,
                               self.resume_step)
        self.clock.batch_size = shape.batch_size
        if self.device_samples_per_step is None:
            self.device_samples_per_step = shape.batch_size
        checkpoint = next((c for c in cb_param(cb, "list_callback", None) or ()
                           if isinstance(c, ModelCheckpoint)), None)
        self._parts = assemble(
            self.config, self.identity, self.job_name, self, shape=shape,
            plan=RecordPlan.of(self.config, self.device_samples_per_step, self.flops_per_token),
            warn_once=self._warn_once, read_learning_rate=self._learning_rate, web=self._web,
            listeners=self._extra_listeners, checkpoint_callback=checkpoint,
            train_network=cb_param(cb, "train_network", None), close=self.close)
        self._recorder = self._parts.recorder

    # ------------------------------------------------------------------ every step
    def on_train_step_begin(self, run_context: Any) -> None:
        self.clock.in_step_since = _perf()  # mark_step_begin, inline: every step
        recorder = self._recorder
        if recorder is not None:
            recorder.begin(_wall())

    def on_train_step_end(self, run_context: Any) -> None:
        # every step: MindSpore's counters and outputs read once (benchmarks/overhead.py)
        recorder = self._recorder
        if recorder is None:
            return
        try:
            wall, now = _wall(), _perf()
            cb = run_context.original_args()
            self._run_context = run_context
            dict_like = isinstance(cb, dict)  # MindSpore's cb_params (attributes: slower)
            clock = self.clock
            cur_step = int(cb["cur_step_num"] if dict_like else cb.cur_step_num)
            if not clock.started:
                clock.first_step(cur_step, cb_param(cb, "batch_num"),
                                 cb_param(cb, "cur_epoch_num"), cb_param(cb, "epoch_num"))
            tick = clock.end(cur_step, now)
            try:
                out = self.parse_outputs(cb)
            except Exception as exc:  # noqa: BLE001
                self.count_error("extract", exc)
                out = NO_OUTPUTS
            epoch = int((cb.get("cur_epoch_num") if dict_like else
                         cb_param(cb, "cur_epoch_num", 0)) or 0)
            recorder.end(tick, out, epoch, clock.total_steps, wall)
        except Exception as exc:  # noqa: BLE001 - never raise into training
            self.count_error("callback", exc)

    # ------------------------------------------------------------------ evaluation
    def on_eval_begin(self, run_context: Any) -> None:
        self._evaluation.begin(time.perf_counter())

    def on_eval_step_end(self, run_context: Any) -> None:
        if self._parts is None:
            return
        try:
            self._evaluation.batch(cb_param(run_context.original_args(), "net_outputs", None))
        except Exception as exc:  # noqa: BLE001 - never raise into training
            self.count_error("callback", exc)

    def on_eval_end(self, run_context: Any) -> None:
        if self._parts is None:
            return
        try:
            self.record_eval(*self._evaluation.end(
                cb_param(run_context.original_args(), "metrics", None), time.perf_counter()))
        except Exception as exc:  # noqa: BLE001 - never raise into training
            self.count_error("callback", exc)

    def record_eval(self, loss: float | None, seconds: float | None) -> None:
        """An evaluation that ran after the last completed training step."""
        if self._parts is not None:
            self._parts.recorder.evaluated(loss, seconds, self.clock.last_step)

    # ------------------------------------------------------------------ end (mfotel.run_end)
    def on_train_end(self, run_context: Any) -> None:
        try:
            self.close()
        except Exception as exc:  # noqa: BLE001 - a subclass's close; later callbacks must run
            self.count_error("shutdown", exc)

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        """MindSpore enters every callback around `Model.train`: when training raised, the run
        ends here with status failed (cancelled for KeyboardInterrupt or after a signal),
        before the exception leaves train() (atexit may be far away, or never come)."""
        if exc is not None and self._parts is not None and self._parts.end.fail(exc):
            try:
                self.close()
            except Exception as error:  # noqa: BLE001 - the training error must propagate
                self.count_error("shutdown", error)

    def close(self) -> None:
        """Final status, last lines, linger (if configured), stop the endpoint and flush;
        idempotent. Every step runs even when an earlier one fails: a failure is counted in
        `mfotel_export_errors_total{stage="shutdown"}` and warned about once, never raised
        (KeyboardInterrupt, a second Ctrl-C during the linger, cuts the linger short)."""
        parts = self._parts
        if parts is not None:
            parts.end.finish(parts, self.clock.total_steps, self.clock.last_step)
