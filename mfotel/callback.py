"""OTelMonitor: the MindSpore adapter (with cells.py, the core modules that import MindSpore).

    from mfotel import OTelMonitor
    model.train(epochs, dataset, callbacks=[OTelMonitor.from_yaml("train.yaml")])
    # or: OTelMonitor(step_interval=50, metrics=["loss", "learning_rate"], log_rank=0)

The callback translates MindSpore's hooks for the parts that do the work:

| part | module |
|---|---|
| global step, step timing, throughput, record steps | step_clock (pure) |
| the rank's OTel instruments and /metrics endpoint | rank_exporter (telemetry, instruments) |
| values of a step's outputs | extract (pure) |
| console / file lines, written off the training thread | sinks |
| checks against the run at train begin | start_checks |
| optional parts (live page, fast page, actions, ...) | listeners |
| final status and the ordered shutdown | run_end; signals: lifecycle |
| multi-rank setup (taken port, file_sd), when configured | cluster.rank_setup |

Extension hooks for integrations (mfotel.integrations.mindformers uses them): `mark_step_begin`
/ `mark_step_end` move the step's time marks onto another callback's hooks, `parse_outputs`
reads a step's outputs, `count_error` counts and warns once, `add_listener` attaches an
optional part, `resume_step` / `device_samples_per_step` / `flops_per_token` tell what only
the integration knows.
"""
from __future__ import annotations

import atexit
import logging
import os
import time
from collections.abc import Sequence
from importlib import import_module
from math import isfinite
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from mindspore.train import Callback, ModelCheckpoint

from . import contract, lifecycle
from .checkpoints import CheckpointWatch
from .config import (
    DEFAULT_JOB_NAME,
    ConfigError,
    MonitorConfig,
    check_writable,
    load_config,
    override,
    parse_config,
    resolve_otel_env,
)
from .config.otel_env import disabled_notice
from .endpoint.webconfig import endpoint_web_config
from .evaluation import Evaluation
from .extract import NO_OUTPUTS, StepOutputs, cb_param, eval_loss, parse_net_outputs
from .flops import mfu
from .identity import RunIdentity, identity_from_env, rank_port, start_run
from .instruments import AS_IS, Instruments, TrainState
from .listeners import StepListener, StepSample
from .mindspore_reads import LearningRateReader, identity_after_init
from .node_link import Announcement, NodeLink
from .rank_exporter import RankExporter, rank_exporter
from .run_end import Removable, RunEnd, RunParts
from .sinks import ConsoleSink, FileSink, LineWriter, Sink
from .start_checks import mfu_missing, run_shape, start_warnings
from .step_clock import Record, RecordSchedule, StepClock
from .telemetry import Telemetry, local_endpoints_line

if TYPE_CHECKING:  # optional parts, imported when configured (the core never needs them)
    from .actions.engine import ActionEngine
    from .ui import LivePage

__all__ = ["LearningRateReader", "OTelMonitor", "eval_loss"]
log = logging.getLogger("mfotel")


class _RecordPlan(NamedTuple):
    """What a record step reads and sets, worked out once from the configured metrics."""

    names: tuple[str, ...]    # the configured metrics, in the line's order
    all: bool                 # exactly contract.SEED_METRICS, in that order
    gauges: tuple[str, ...]   # those kept in TrainState (step_time is a histogram)
    reads_lr: bool
    throughput: bool

    @classmethod
    def of(cls, metrics: Sequence[str]) -> _RecordPlan:
        names = tuple(metrics)
        return cls(names, names == contract.SEED_METRICS,
                   tuple(name for name in names if name != "step_time"),
                   "learning_rate" in names, "throughput" in names)


class OTelMonitor(Callback):  # type: ignore[misc]  # MindSpore has no type information
    """Exports a MindSpore training run as OpenTelemetry metrics and `[Monitor]` lines.

    Keyword arguments are the `monitor_config` keys (README, Configuration). Failures inside the
    callback never reach training: they are counted in `mfotel_export_errors_total{stage}` and
    warned about once. The run's end always reports a final status: completed, failed (an
    exception left `Model.train`, or it stopped early) or cancelled (SIGTERM / SIGINT, see
    mfotel.lifecycle), and nothing at the end raises into MindSpore.
    """

    def __init__(self, config: MonitorConfig | None = None, **kwargs: Any) -> None:
        super().__init__()
        if config is not None and kwargs:
            raise TypeError("pass either a MonitorConfig or keyword arguments, not both")
        config = config or parse_config(kwargs, source="OTelMonitor(...)", prefix="OTelMonitor")
        resolved = resolve_otel_env(config, default_job_name=self.default_job_name())  # OTEL_*
        for warning in resolved.warnings:
            log.warning("mfotel: %s", warning)
        notice = disabled_notice(resolved)
        if notice and config.enable:
            log.warning(notice)
        self.config = resolved.config
        self.job_name = self.config.job_name or DEFAULT_JOB_NAME
        self.identity = identity_from_env()
        check_writable(self.config, self.identity.rank, self.job_name)
        # TLS / auth files: a bad one is an error before training; loaded once, used at start
        prom = self.config.prometheus
        self._web = endpoint_web_config(prom, self.config.source) \
            if self.config.enable or prom.web_config_file else None
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
        self.exporter: RankExporter | None = None
        self._instruments: Instruments | None = None   # the exporter's, for the step path
        self.run: RunIdentity | None = None
        self.file_path: Path | None = None
        self.checkpoints: list[CheckpointWatch] = []
        self.actions: ActionEngine | None = None   # when `actions` are configured
        self.live: LivePage | None = None          # when the live page is on
        self.file_sd: Removable | None = None      # file_sd targets, when configured
        self._node: NodeLink | None = None         # under mfotel-instrument: its node agent
        self.clock = StepClock(RecordSchedule(self.config.step_interval, self.config.early_steps,
                                              self.config.early_step_interval),
                               self.config.batch_size)
        self._end = RunEnd(self._report_shutdown_failure)
        self._parts: RunParts | None = None
        self._lines: LineWriter | None = None
        self._listeners: tuple[StepListener, ...] = ()
        self._step_listeners: tuple[StepListener, ...] = ()  # those that follow every step
        self._lr = LearningRateReader()
        self._cb: Any = None            # cb_params of the run (one object per Model.train)
        self._optimizer: Any = None     # found in _cb when first asked for
        self._run_context: Any = None
        self._evaluation = Evaluation()  # evaluation inside training (Model.fit)
        self._metrics = _RecordPlan.of(self.config.metrics)

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
    @property
    def instruments(self) -> Instruments | None:
        """The rank's instruments (`instruments.state` holds the exposed values); None
        before train begin."""
        return self.exporter.instruments if self.exporter is not None else None

    @property
    def telemetry(self) -> Telemetry | None:
        """The rank's providers and endpoint; None before train begin."""
        return self.exporter.telemetry if self.exporter is not None else None

    @property
    def final_scraped(self) -> bool:
        """Whether a scrape saw the final status before the endpoint stopped."""
        return self._parts is not None and self._parts.final_scraped

    # ------------------------------------------------------------------ extension hooks
    def count_error(self, stage: str, exc: BaseException) -> None:
        """Count a failure in `mfotel_export_errors_total{stage}` and warn once per stage."""
        if self.exporter is not None:
            self.exporter.instruments.count_error(stage)
        self._warn_once(f"error:{stage}", f"mfotel: {stage} failed ({type(exc).__name__}: {exc}); "
                        f"training continues, further failures are counted in "
                        f"mfotel_export_errors_total{{stage=\"{stage}\"}}")

    def mark_step_begin(self, at: float | None = None) -> None:
        """The step begins now (or at `at`, a time.perf_counter() value)."""
        self.clock.begin(time.perf_counter() if at is None else at)
        instruments = self._instruments
        if instruments is not None:  # inside a step from now (mfotel job-level signals)
            instruments.state.step_begin_timestamp = wall = time.time()
            instruments.version += 1
            if self._node is not None:
                self._node.step_begin(wall)

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
        return self._lines.flush(timeout) if self._lines is not None else True

    def add_listener(self, listener: StepListener) -> None:
        """Attach an optional part (mfotel.listeners); before train begin it is kept for
        every run of this monitor, during a run for that run."""
        if self._parts is None:
            self._extra_listeners.append(listener)
        else:
            self._parts.listeners.append(listener)
            self._attach(self._parts.listeners)

    def _attach(self, listeners: list[StepListener]) -> None:
        self._listeners = tuple(listeners)
        self._step_listeners = tuple(listener for listener in listeners
                                     if type(listener).on_step is not StepListener.on_step)

    # RunControl (mfotel.listeners): what listeners may ask of the run
    def request_stop(self, reason: str) -> None:
        """Stop training after this step (once; the caller logs why)."""
        if self._end.stopped or self._run_context is None:
            return
        self._end.stopped = True
        self._run_context.request_stop()

    def optimizer(self) -> Any:
        """The run's optimizer (`Model(custom_cell)` has it on the train network)."""
        if self._optimizer is None:
            cb = self._cb
            self._optimizer = cb_param(cb, "optimizer") or getattr(
                cb_param(cb, "train_network"), "optimizer", None)
        return self._optimizer

    def learning_rate_changed(self) -> None:
        self._lr = LearningRateReader()  # a list lr's table changed: read it again

    # ------------------------------------------------------------------ helpers
    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)

    def _on_sink_error(self, exc: BaseException) -> None:
        self.count_error("sink", exc)

    # ------------------------------------------------------------------ start
    def on_train_begin(self, run_context: Any) -> None:
        if not self.config.enable:
            return
        self.identity = identity_after_init()
        self._start(run_context)

    def _start(self, run_context: Any) -> None:
        if self.exporter is not None:  # a second Model.train call on this monitor
            self.close()  # a no-op when the first run ended normally
            self._new_run()
        cb = run_context.original_args()
        self._cb, self._run_context = cb, run_context
        cfg, ident = self.config, self.identity
        port = rank_port(cfg.prometheus.port, ident, cfg.source)  # colliding ranks: ConfigError
        self.run = start_run(cfg.run, ident.rank, self.job_name, cfg.source)
        listeners = list(self._extra_listeners)
        if cfg.actions.enabled:  # mfotel.actions.engine; a ConfigError here stops before training
            from .actions.engine import ActionEngine
            self.actions = ActionEngine(cfg.actions, self.job_name, ident.rank, ident.world_size)
            self.actions.start(self.optimizer(), cb_param(cb, "train_network", None))
        exporter = rank_exporter(cfg, ident, self.job_name, run=self.run, web=self._web,
                                 serve=False)
        self.exporter, self._instruments = exporter, exporter.instruments
        # from here on close() ends the run, whatever fails later
        self._parts = parts = RunParts(cfg, ident.rank, self.job_name, exporter, self.run,
                                       checkpoints=self.checkpoints, listeners=listeners)
        st = exporter.instruments.state
        st.start_timestamp = time.time()
        self._watch_checkpoints(cb, exporter.instruments)
        routes: dict[str, Any] = {}
        if cfg.prometheus.ui and exporter.telemetry.port:  # same port, TLS and auth as /metrics
            from .ui import HistoryRecorder, live_page
            self.live = live_page(cfg, ident, self.job_name, st, exporter.telemetry.cert_file)
            routes = self.live.routes()
            listeners.insert(0, HistoryRecorder(self.live.history))
        if cfg.alertmanager_url:  # loaded now, not on the first NaN's step
            fastpage = import_module(".alerting.fastpage", __package__)
            listeners.append(fastpage.FastPage(cfg.alertmanager_url, self.job_name, ident.rank,
                                               lambda: exporter.instruments.count_error(
                                                   "alertmanager")))
        if self.actions is not None:
            self.actions.attach(exporter.instruments)
            listeners.append(self.actions)
        exporter.serve(routes)
        self._set_up_ranks(cb, port, exporter)
        parts.file_sd = self.file_sd
        parts.node_link = self._node = self._join_node(exporter)
        self._lines = parts.lines = self._open_lines()
        self._attach(listeners)
        self._check_run(cb)
        endpoint = exporter.telemetry.endpoint
        log.info("mfotel: job %s rank %d/%d, /metrics %s, live page %s", self.job_name,
                 ident.rank, ident.world_size, endpoint.url if endpoint else "off",
                 endpoint.page_url if endpoint and self.live else "off")
        scheme = "https" if exporter.telemetry.cert_file else "http"
        where = local_endpoints_line(cfg, ident, self.job_name, scheme, self.live is not None,
                                     endpoint is not None)
        if where:  # printed: a plain run configures no logging, and INFO would not show
            print(where, flush=True)
        atexit.register(self.close)
        try:  # last: a failed start leaves the signal handlers alone
            lifecycle.enter(self)
        except Exception as exc:  # noqa: BLE001 - monitoring without them beats no training
            self.count_error("callback", exc)

    def _set_up_ranks(self, cb: Any, port: int, exporter: RankExporter) -> None:
        """Note the resumed step; explain a port held by another rank and write the file_sd
        file (mfotel.cluster, imported only for those)."""
        self.clock.train_begin(int(cb_param(cb, "cur_step_num", 0) or 0),
                               resume_step=self.resume_step)
        served = exporter.telemetry.endpoint is not None
        if not ((port and not served) or self.config.file_sd.path):
            return
        from .cluster.rank_setup import set_up_rank
        try:
            self.file_sd = set_up_rank(self.config, self.identity, self.job_name, port, served,
                                       "https" if exporter.telemetry.cert_file else "http")
        except ConfigError:
            exporter.shutdown()  # an error before training: leave nothing bound
            self.exporter, self._instruments, self._parts = None, None, None
            raise

    def _join_node(self, exporter: RankExporter) -> NodeLink | None:
        """Under mfotel-instrument: tell its node agent who this rank is and where it serves,
        keep the step heartbeat it reads, let it capture the stacks (mfotel.node_link)."""
        ident, endpoint = self.identity, exporter.telemetry.endpoint
        try:
            return NodeLink.join(Announcement(
                os.getpid(), self.job_name, ident.rank, ident.local_rank, ident.world_size,
                endpoint.host if endpoint else "", endpoint.port if endpoint else 0,
                endpoint.scheme if endpoint else "http"))
        except OSError as exc:  # the agent then guesses, as for a rank without mfotel
            self.count_error("node_link", exc)
            return None

    def _open_lines(self) -> LineWriter | None:
        cfg, rank = self.config, self.identity.rank
        if not cfg.logs_on(rank):
            return None
        sinks: list[tuple[Sink, bool]] = []
        if cfg.output.console:
            sinks.append((ConsoleSink(), False))
        if cfg.output.file:
            path = check_writable(cfg, rank, self.job_name)
            assert path is not None
            self.file_path = path
            if (cfg.log_rank is None or len(cfg.log_rank) > 1) and \
                    "{rank}" not in cfg.output.file_path:
                self._warn_once("shared-file", f"mfotel: several ranks log to one file "
                                f"{path}; add {{rank}} to output.file_path")
            sinks.append((FileSink(path), cfg.output.format == "json"))
            print(f"mfotel: rank {rank} writes monitor lines to {path}", flush=True)
        return LineWriter(sinks, rank, self.job_name, self._on_sink_error) if sinks else None

    def _check_run(self, cb: Any) -> None:
        """The run's length and batch size; warnings that need the run (start_checks)."""
        shape = run_shape(cb, self.config.batch_size)
        self.clock.total_steps = shape.total_steps
        self.clock.batch_size = shape.batch_size
        if self.device_samples_per_step is None:
            self.device_samples_per_step = shape.batch_size
        for key, message in start_warnings(self.config, shape, self.identity.world_size,
                                           self.device_samples_per_step, self.flops_per_token):
            self._warn_once(key, message)
        if self.config.peak_flops and self.flops_per_token and \
                not mfu_missing(self.config, self.device_samples_per_step, self.flops_per_token):
            log.info("mfotel: MFU from %.4g FLOPs per token and a peak of %.4g FLOP/s per "
                     "device", self.flops_per_token, self.config.peak_flops)

    def _watch_checkpoints(self, cb: Any, instruments: Instruments) -> None:
        """Time the saves of the run's checkpoint callback (ModelCheckpoint and subclasses)."""
        for callback in cb_param(cb, "list_callback", None) or ():
            if isinstance(callback, ModelCheckpoint) and not self.checkpoints:
                self.checkpoints.append(CheckpointWatch(callback, instruments.state,
                                                        instruments.touch))

    # ------------------------------------------------------------------ every step
    def on_train_step_begin(self, run_context: Any) -> None:
        self.mark_step_begin()

    def on_train_step_end(self, run_context: Any) -> None:
        instruments = self._instruments
        if instruments is None:
            return
        try:
            self._step_end(run_context, instruments)
        except Exception as exc:  # noqa: BLE001 - never raise into training
            self.count_error("callback", exc)

    def _step_end(self, run_context: Any, instruments: Instruments) -> None:
        # the per-step path: kept to assignments (benchmarks/overhead.py); the SDK's work
        # happens at collection, lines are written by their own thread
        wall, now = time.time(), time.perf_counter()
        cb = run_context.original_args()
        self._run_context = run_context
        dict_like = isinstance(cb, dict)  # MindSpore's cb_params: a dict (attributes: slower)
        clock = self.clock
        cur_step = int(cb["cur_step_num"] if dict_like else cb.cur_step_num)
        if not clock.started:
            clock.first_step(cur_step, cb_param(cb, "batch_num"), cb_param(cb, "cur_epoch_num"),
                             cb_param(cb, "epoch_num"))
        tick = clock.end(cur_step, now)
        try:
            out = self.parse_outputs(cb)
        except Exception as exc:  # noqa: BLE001
            self.count_error("extract", exc)
            out = NO_OUTPUTS
        st, step = instruments.state, tick.step
        if st.status != contract.STATUS_RUNNING:
            self._back_to_running(st)
        st.step, st.steps, st.last_step_timestamp = step, st.steps + tick.advanced, wall
        if self._node is not None:
            self._node.step_end(step, wall)
        st.epoch = int((cb.get("cur_epoch_num") if dict_like else
                        cb_param(cb, "cur_epoch_num", 0)) or 0)
        total = clock.total_steps
        if total:
            st.progress = step / total if step < total else 1.0
        if tick.seconds is not None:
            instruments.record_step_seconds(tick.seconds)
        if tick.outside is not None:
            st.step_outside += tick.outside
        if tick.samples:
            st.samples = (st.samples or 0) + tick.samples
            if self.config.seq_length:
                st.tokens = (st.tokens or 0) + tick.samples * self.config.seq_length
        loss, norm = out.loss, out.grad_norm
        loss_ok = loss is None or isfinite(loss)
        finite = loss_ok and (norm is None or isfinite(norm))
        if loss is not None:
            st.loss_finite = int(loss_ok)
        if out.overflow is not None or out.loss_scale is not None:
            self._loss_scale(out, st)
        sample = None
        if tick.record is not None or self._step_listeners or not finite:
            sample = StepSample(step, tick.previous_step, out, tick.record is not None, self)
            if not finite:
                self._nonfinite(sample, st)
            if tick.record is not None:
                self._record(sample, tick.record, st, wall)
            for listener in self._step_listeners:
                try:
                    listener.on_step(sample)
                except Exception as exc:  # noqa: BLE001 - an optional part must not stop others
                    self.count_error("callback", exc)
        instruments.version += 1

    def _back_to_running(self, st: TrainState) -> None:
        """The first step; or steps go on after a signal (a chained handler that stops
        gracefully later or not at all, a KeyboardInterrupt that MindSpore swallowed)."""
        end = self._end
        if st.status in (contract.STATUS_INITIALISING, contract.STATUS_CANCELLED,
                         contract.STATUS_FAILED) and end.closing_thread is None:
            st.status = contract.STATUS_RUNNING
            if end.closing_thread is not None and end.final_status is not None:
                st.status = end.final_status  # close() began meanwhile (the signal watcher)

    @staticmethod
    def _loss_scale(out: StepOutputs, st: TrainState) -> None:
        if out.overflow is not None:
            st.overflow = (st.overflow or 0) + int(out.overflow)
        if out.loss_scale is not None and isfinite(out.loss_scale):
            st.loss_scale = out.loss_scale

    def _nonfinite(self, sample: StepSample, st: TrainState) -> None:
        """A step whose loss or gradient norm is NaN / Inf: count, warn once, stop if asked,
        tell the listeners."""
        step, loss, norm = sample.step, sample.outputs.loss, sample.outputs.grad_norm
        metrics = self.config.metrics  # a NaN between two records is exposed too, as it is
        if loss is not None and not isfinite(loss):
            st.nonfinite["loss"] += 1
            if "loss" in metrics:
                st.loss = loss
            if st.first_nonfinite_step is None:
                st.first_nonfinite_step = step
            self._warn_once("nonfinite", f"mfotel: loss is {loss} at step {step} on rank "
                            f"{self.identity.rank} (job {self.job_name}); see "
                            f"mindformers_train_nonfinite_total")
            if self.config.on_nonfinite == "stop" and not self._end.stopped:
                self.request_stop("on_nonfinite: stop")
                log.warning("mfotel: stopping the run after step %d (on_nonfinite: stop)", step)
        if norm is not None and not isfinite(norm):
            st.nonfinite["grad_norm"] += 1
            if "grad_norm" in metrics:
                st.grad_norm = norm
        for listener in self._listeners:
            try:
                listener.on_nonfinite(sample)
            except Exception as exc:  # noqa: BLE001 - an optional part must not stop the others
                self.count_error("callback", exc)

    def _record(self, sample: StepSample, record: Record, st: TrainState, wall: float) -> None:
        """Seed metrics of a record step; throughput and step_time are means over the steps
        since the previous record (wall time between the two step ends)."""
        out, metrics = sample.outputs, self._metrics
        lr = out.learning_rate
        if lr is None and metrics.reads_lr:
            lr = self._lr(self._optimizer if self._optimizer is not None else self.optimizer())
        row = {"loss": out.loss, "learning_rate": lr, "grad_norm": out.grad_norm,
               "throughput": record.throughput, "step_time": record.step_time}
        # the configured order is the line's order; step_time is a histogram (every step)
        values = row if metrics.all else {name: row[name] for name in metrics.names}
        for name in metrics.gauges:
            value = row[name]
            if value is not None and (isfinite(value) or name in AS_IS):
                setattr(st, name, value)
        if metrics.throughput and self.config.seq_length:
            self._record_device_throughput(record, st)
        if self._lines is not None:
            self._lines.submit(sample.step, st.epoch or 0, values, wall)
        for listener in self._listeners:
            try:
                listener.on_record(sample, values)
            except Exception as exc:  # noqa: BLE001 - an optional part must not stop the others
                self.count_error("callback", exc)

    def _record_device_throughput(self, record: Record, st: TrainState) -> None:
        """Tokens/s per device and MFU over the record interval (README, Time figures)."""
        per_step, seq = self.device_samples_per_step, self.config.seq_length
        if not (per_step and seq and record.elapsed > 0 and record.steps):
            return
        st.device_tokens = per_step * seq * record.steps / record.elapsed
        if self.flops_per_token and self.config.peak_flops:
            st.mfu = mfu(st.device_tokens, self.flops_per_token, self.config.peak_flops)

    # ------------------------------------------------------------------ evaluation
    def on_eval_begin(self, run_context: Any) -> None:
        self._evaluation.begin(time.perf_counter())

    def on_eval_step_end(self, run_context: Any) -> None:
        if self.exporter is None:
            return
        try:
            self._evaluation.batch(cb_param(run_context.original_args(), "net_outputs", None))
        except Exception as exc:  # noqa: BLE001 - never raise into training
            self.count_error("callback", exc)

    def on_eval_end(self, run_context: Any) -> None:
        if self.exporter is None:
            return
        try:
            self.record_eval(*self._evaluation.end(
                cb_param(run_context.original_args(), "metrics", None), time.perf_counter()))
        except Exception as exc:  # noqa: BLE001 - never raise into training
            self.count_error("callback", exc)

    def record_eval(self, loss: float | None, seconds: float | None) -> None:
        """An evaluation that ran after the last completed training step."""
        if self.exporter is None:
            return
        st, last = self.exporter.instruments.state, self.clock.last_step
        if loss is not None:
            st.eval_loss, st.eval_step = loss, last
        if seconds is not None:
            st.eval_duration = seconds
        self.exporter.instruments.touch()
        log.info("mfotel: evaluation after step %d: loss %s, %.3f s", last,
                 "unknown" if loss is None else f"{loss:.6g}", seconds or 0.0)

    # ------------------------------------------------------------------ end
    def on_train_end(self, run_context: Any) -> None:
        try:
            self.close()
        except Exception as exc:  # noqa: BLE001 - a subclass's close; later callbacks must run
            self.count_error("shutdown", exc)

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        """MindSpore enters every callback around `Model.train`: when training raised, the run
        ends here with status failed (cancelled for KeyboardInterrupt or after a signal),
        before the exception leaves train() (atexit may be far away, or never come)."""
        if exc is not None and self._end.error is None:
            self._end.error = exc
            try:
                self.close()
            except Exception as error:  # noqa: BLE001 - the training error must propagate
                self.count_error("shutdown", error)

    def on_signal(self, signum: int, failure: str | None = None) -> None:
        """A terminating signal arrived (mfotel.lifecycle): show status cancelled at once, or
        failed when `failure` explains it (MindSpore SIGTERMs itself when a dataset worker
        dies). Runs in a signal handler or the watcher thread, hence assignments only; a run
        already ending keeps its final status."""
        status = self._end.on_signal(signum, failure)
        if status is not None and self.exporter is not None:
            self.exporter.instruments.state.status = status
            self.exporter.instruments.version += 1

    @property
    def closing_thread(self) -> int | None:
        """Ident of the thread running close(), once it began (mfotel.lifecycle)."""
        return self._end.closing_thread

    @property
    def closed(self) -> bool:
        """Whether close() has nothing left to do (it finished, or nothing was started)."""
        return self._end.closed or self._parts is None

    def close_seconds(self) -> float:
        """The longest close() may take: the last lines (flushed before the linger, then the
        writer stopped), the linger, and the final OTLP push of each provider."""
        return (3 * LineWriter.FLUSH_SECONDS + self.config.prometheus.linger_seconds
                + 2 * self.config.otlp.timeout_seconds)

    def close(self) -> None:
        """Final status, last lines, linger (if configured), stop the endpoint and flush;
        idempotent (mfotel.run_end).

        Every step runs even when an earlier one fails: a failure is counted in
        `mfotel_export_errors_total{stage="shutdown"}` and warned about once, never raised
        (KeyboardInterrupt, a second Ctrl-C during the linger, cuts the linger short).
        """
        parts, end = self._parts, self._end
        if parts is None:
            return
        last_step = self.clock.last_step
        if not end.begin(end.decide(self.clock.total_steps, last_step)):
            return
        end.shutdown(parts.shutdown_steps(end, last_step, self, self.close))

    def _report_shutdown_failure(self, name: str, exc: BaseException) -> None:
        if self.exporter is not None:
            self.exporter.instruments.count_error("shutdown")
        self._warn_once(f"shutdown:{name}", f"mfotel: {name} failed at the end of training "
                        f"({type(exc).__name__}: {exc}); the other shutdown steps ran, "
                        f"failures are counted in mfotel_export_errors_total"
                        f"{{stage=\"shutdown\"}}")
