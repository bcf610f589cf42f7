"""OTelMonitor: the MindSpore training callback (the only core module importing MindSpore).

    from mfotel import OTelMonitor
    model.train(epochs, dataset, callbacks=[OTelMonitor.from_yaml("train.yaml")])
    # or: OTelMonitor(step_interval=50, metrics=["loss", "learning_rate"], log_rank=0)
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
import math
import threading
import time
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mindspore.train import Callback, ModelCheckpoint

from . import contract, lifecycle
from .checkpoints import CheckpointWatch
from .config import (DEFAULT_JOB_NAME, ConfigError, MonitorConfig, check_writable, load_config,
                     override, parse_config, resolve_otel_env)
from .config.otel_env import disabled_notice
from .extract import StepOutputs, cb_param, is_finite, parse_net_outputs, to_float
from .flops import mfu
from .identity import RankIdentity, RunIdentity, finish_run, identity_from_env, rank_port, start_run
from .instruments import Instruments
from .sinks import ConsoleSink, FileSink, format_json, format_line
from .telemetry import Telemetry
from .webconfig import load_web_config

if TYPE_CHECKING:  # optional parts, imported when configured (the core never needs them)
    from .actions.engine import ActionEngine
    from .cluster.discovery import FileSdWriter
    from .ui import LivePage

log = logging.getLogger("mfotel")


def _identity_after_init() -> RankIdentity:
    """Environment identity, corrected by MindSpore's communication layer once init() ran."""
    identity = identity_from_env()
    try:
        from mindspore.communication import (_comm_helper, get_group_size, get_local_rank,
                                             get_local_rank_size, get_rank)
        if not getattr(_comm_helper, "_is_initialized", lambda: True)():
            return identity  # without init() these echo the environment (local size 1)
        return identity.with_communication(get_rank(), get_local_rank(), get_group_size(),
                                           get_local_rank_size())
    except Exception:  # noqa: BLE001 - not initialised: a single process
        return identity


def eval_loss(results: Any) -> float | None:
    """The `loss` of an evaluation result (`Model.eval`'s metrics), any case, at the top or one
    level down: `{"loss": 2.1}` (MindSpore's `nn.Loss` metric named loss) or mindformers'
    `{"PerplexityMetric": {"loss": 2.1, "PPL": 8.2}}`."""
    if not isinstance(results, dict):
        return None
    nested = [v for _, v in sorted(results.items(), key=lambda kv: str(kv[0])) if isinstance(v, dict)]
    for found in (results, *nested):
        for key in sorted((k for k in found if str(k).lower() == "loss"), key=str):
            try:
                return to_float(found[key])
            except (TypeError, ValueError):
                return None
    return None


class LearningRateReader:
    """The learning rate a step actually used (get_lr() already returns the next step's)."""

    def __init__(self) -> None:
        self._table: Any = None

    def __call__(self, optimizer: Any) -> float | None:
        if optimizer is None:
            return None
        lr = optimizer.learning_rate
        if getattr(optimizer, "is_group_lr", False):
            lr = lr[0]
        if not getattr(optimizer, "dynamic_lr", False):
            return to_float(lr)
        used_step = max(int(to_float(optimizer.global_step)) - 1, 0)
        table = getattr(lr, "learning_rate", None)  # list lr: _IteratorLearningRate
        if table is not None and getattr(table, "ndim", 0) == 1:
            if self._table is None:
                self._table = table.asnumpy()
            return float(self._table[min(used_step, len(self._table) - 1)])
        from mindspore import Tensor, int32
        return to_float(lr(Tensor(used_step, int32)))


class OTelMonitor(Callback):
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
        if disabled_notice(resolved) and config.enable:
            log.warning(disabled_notice(resolved))
        self.config = resolved.config
        self.job_name = self.config.job_name or DEFAULT_JOB_NAME
        self.identity = identity_from_env()
        check_writable(self.config, self.identity.rank, self.job_name)
        if self.config.prometheus.web_config_file:  # a bad file is an error before training
            load_web_config(self.config.prometheus.web_config_file)
        self._warned: set[str] = set()
        #: Samples one device trains per step, for tokens/s per device (default: batch_size,
        #: each rank training its own batch); integrations that know the parallel layout set it.
        self.device_samples_per_step: float | None = None
        #: Model FLOPs per token for MFU: the config's, or an integration's estimate.
        self.flops_per_token: float | None = self.config.flops_per_token
        #: The global step the run resumed from, when an integration knows it (mindformers
        #: skips the dataset by runner_config.initial_step and restarts cur_step_num at 1).
        self.resume_step: int | None = None
        self._new_run()

    def _new_run(self) -> None:
        """The state of one `Model.train` call (a second call on the same monitor starts anew)."""
        self.telemetry: Telemetry | None = None
        self.instruments: Instruments | None = None
        self.sinks: list[tuple[Any, bool]] = []  # (sink, json?)
        self.file_path: Path | None = None
        self._lr = LearningRateReader()
        self._batch_size: int | None = self.config.batch_size
        self._total_steps: int | None = None
        self._last_step = 0
        # Time figures (README, Time figures): perf_counter() marks of the current step's
        # begin and end (an integration may move them onto another callback's hooks), of the
        # previous step end, and of the last record
        self._step_begin: float | None = None
        self._step_end_mark: float | None = None
        self._last_end: float | None = None
        self._record_time: float | None = None
        self._record_samples = 0
        self._record_steps = 0
        self.checkpoints: list[CheckpointWatch] = []
        self._eval_begin: float | None = None
        self._eval_losses: list[float] = []
        self._stopped = False
        # the end of the run (close): once, from whichever thread gets there first
        self._close_once = threading.Lock()
        self.closing_thread: int | None = None  # ident of the thread running close()
        self._closed = False
        self._signalled: int | None = None      # SIGTERM / SIGINT received (mfotel.lifecycle)
        self._child_failure: str | None = None  # a dead child explains the SIGTERM
        self._final_status_value: int | None = None  # decided when close() begins
        self._error: BaseException | None = None  # what left Model.train, if anything
        self.actions: ActionEngine | None = None  # mfotel.actions.engine
        self.live: LivePage | None = None  # the live page (mfotel.ui), fed at records
        self.final_scraped = False  # whether a scrape saw the final status before shutdown
        # multi-rank (mfotel.identity / mfotel.cluster.discovery)
        self.run: RunIdentity | None = None
        self.file_sd: FileSdWriter | None = None
        self._step_offset: int | None = None  # global step - cur_step_num, set at the first step
        self._begin_step = 0                   # cur_step_num at train begin (resume)

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> "OTelMonitor":
        """From a YAML file's `monitor_config` block; keyword arguments override its keys."""
        cfg = load_config(path)
        if overrides:
            cfg = override(cfg, overrides, source="from_yaml overrides")
        return cls(cfg)

    def default_job_name(self) -> str:
        """The job name when neither job_name nor OTEL_SERVICE_NAME gives one."""
        return DEFAULT_JOB_NAME

    # ------------------------------------------------------------------ helpers
    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)

    def _count_error(self, stage: str, exc: BaseException) -> None:
        if self.instruments is not None:
            self.instruments.count_error(stage)
        self._warn_once(f"error:{stage}", f"mfotel: {stage} failed ({type(exc).__name__}: {exc}); "
                        f"training continues, further failures are counted in "
                        f"mfotel_export_errors_total{{stage=\"{stage}\"}}")

    # ------------------------------------------------------------------ MindSpore hooks
    def on_train_begin(self, run_context: Any) -> None:
        if not self.config.enable:
            return
        cb = run_context.original_args()
        self.identity = _identity_after_init()
        self._start(cb)

    def _start(self, cb: Any) -> None:
        if self.instruments is not None:  # a second Model.train call on this monitor
            self.close()  # a no-op when the first run ended normally
            self._new_run()
        cfg, ident = self.config, self.identity
        port = rank_port(cfg.prometheus.port, ident, cfg.source)  # colliding ranks: ConfigError
        self.run = start_run(cfg.run, ident.rank, self.job_name, cfg.source)
        if cfg.actions.enabled:  # mfotel.actions.engine; a ConfigError here stops before training
            from .actions.engine import ActionEngine
            self.actions = ActionEngine(cfg.actions, self.job_name, ident.rank, ident.world_size)
            self.actions.start(self._optimizer(cb), cb_param(cb, "train_network", None))
        self.telemetry = Telemetry(self._telemetry_config(), ident, self.job_name,
                                   on_error=self._on_telemetry_error)
        meter = self.telemetry.start()
        self.instruments = Instruments(meter, {"job_name": self.job_name, "rank": str(ident.rank)},
                                       cfg.metrics, {**ident.labels(), **self.run.labels()},
                                       self.telemetry.native_meter, cardinality=cfg.cardinality,
                                       seed_values=cfg.exports_seed_metrics(ident.rank))
        if self.actions is not None:
            self.instruments.state.actions = self.actions.counts
            # control-file problems (also those met at start) -> mfotel_export_errors_total
            self.instruments.state.export_errors[self.actions.ERROR_STAGE] = self.actions.errors
            self.actions.on_error = self._on_telemetry_error
        self.instruments.state.start_timestamp = time.time()
        self._watch_checkpoints(cb)
        if cfg.prometheus.ui and self.telemetry.port:  # same port, TLS and auth as /metrics
            from .ui import live_page
            self.live = live_page(cfg, ident, self.job_name, self.instruments.state,
                                  self.telemetry.cert_file)
            self.telemetry.extra_routes.update(self.live.routes())
        self.telemetry.serve(lambda: self.instruments.version,
                             lambda: self.instruments.native_version)
        self._start_multirank(cb, port)
        self._open_sinks()
        self._read_run_shape(cb)
        endpoint = self.telemetry.endpoint
        log.info("mfotel: job %s rank %d/%d, /metrics %s, live page %s", self.job_name,
                 ident.rank, ident.world_size, endpoint.url if endpoint else "off",
                 endpoint.page_url if endpoint and self.live else "off")
        if cfg.alertmanager_url:
            import_module(".alerting.fastpage", __package__)  # not on the first NaN's step
        atexit.register(self.close)
        try:  # last: a failed start leaves the signal handlers alone
            lifecycle.enter(self)
        except Exception as exc:  # noqa: BLE001 - monitoring without them beats no training
            self._count_error("callback", exc)

    # ------------------------------------------------------------------ multi-rank
    def _telemetry_config(self) -> MonitorConfig:
        """The config with identity and run attributes added to the OTel resource."""
        extra = {**self.identity.resource_attributes(), **self.run.resource_attributes(),
                 **self.config.resource_attributes}
        return dataclasses.replace(self.config, resource_attributes=extra)

    def _start_multirank(self, cb: Any, port: int) -> None:
        """Explain a port held by another rank; write the file_sd file; note the resumed step.

        mfotel.cluster is imported only when needed: a busy port, or a file_sd path."""
        self._begin_step = int(cb_param(cb, "cur_step_num", 0) or 0)
        written = None
        try:
            if port and self.telemetry.endpoint is None:
                from .cluster.discovery import check_port_collision
                check_port_collision(self.config, self.identity, self.job_name, port)
            if self.config.file_sd.path:
                from .cluster.discovery import FileSdWriter
                self.file_sd = FileSdWriter(self.config, self.identity, self.job_name)
                try:
                    written = self.file_sd.write()
                except OSError as exc:
                    raise ConfigError(self.config.source, "monitor_config.file_sd.path",
                                      f"cannot write {self.file_sd.path} ({exc.strerror or exc})",
                                      "choose a writable path (a directory Prometheus reads)"
                                      ) from None
        except ConfigError:
            self.telemetry.shutdown()  # an error before training: leave nothing bound
            self.instruments = None
            raise
        if written is not None:
            log.info("mfotel: rank %d wrote Prometheus file_sd targets to %s",
                     self.identity.rank, written)

    def _global_step(self, cb: Any) -> int:
        """cur_step_num, continued from the resumed step: Model.train(initial_epoch=k) restarts
        cur_step_num at 1, a fault-repair resume starts it at the resumed step, and integrations
        that skip data themselves (mindformers' initial_step) set `resume_step`."""
        step = int(cb.cur_step_num)
        if self._step_offset is None:
            per_epoch, epoch = cb_param(cb, "batch_num", 0), cb_param(cb, "cur_epoch_num", 1)
            per_epoch = per_epoch if isinstance(per_epoch, int) else 0
            epoch = epoch if isinstance(epoch, int) else 1
            epoch_start = (epoch - 1) * per_epoch
            self._step_offset = epoch_start - self._begin_step if step <= epoch_start else 0
            if self.resume_step is not None:
                self._step_offset = max(self.resume_step - self._begin_step, 0)
            self._last_step = self._begin_step + self._step_offset
            epochs = cb_param(cb, "epoch_num", None)
            if self._last_step and isinstance(epochs, int) and per_epoch:
                self._total_steps = (epochs + epoch - 1) * per_epoch
        return step + self._step_offset

    def _on_telemetry_error(self, stage: str) -> None:
        if self.instruments is not None:
            self.instruments.count_error(stage)

    def _open_sinks(self) -> None:
        cfg, rank = self.config, self.identity.rank
        if not cfg.logs_on(rank):
            return
        if cfg.output.console:
            self.sinks.append((ConsoleSink(), False))
        if cfg.output.file:
            self.file_path = check_writable(cfg, rank, self.job_name)
            assert self.file_path is not None
            if (cfg.log_rank is None or len(cfg.log_rank) > 1) and "{rank}" not in cfg.output.file_path:
                self._warn_once("shared-file", f"mfotel: several ranks log to one file "
                                f"{self.file_path}; add {{rank}} to output.file_path")
            self.sinks.append((FileSink(self.file_path), cfg.output.format == "json"))
            print(f"mfotel: rank {rank} writes monitor lines to {self.file_path}", flush=True)

    def _read_run_shape(self, cb: Any) -> None:
        cfg, ident = self.config, self.identity
        epochs, per_epoch = cb_param(cb, "epoch_num", None), cb_param(cb, "batch_num", None)
        if isinstance(epochs, int) and isinstance(per_epoch, int) and epochs * per_epoch > 0:
            self._total_steps = epochs * per_epoch
            if cfg.step_interval > self._total_steps:
                self._warn_once("interval", f"mfotel: step_interval {cfg.step_interval} is larger "
                                f"than the run's {self._total_steps} steps: seed metrics will never "
                                f"be recorded. Fix: lower monitor_config.step_interval")
        if cfg.log_rank is not None and all(r >= ident.world_size for r in cfg.log_rank):
            self._warn_once("log_rank", f"mfotel: log_rank {list(cfg.log_rank)} is outside the "
                            f"world size {ident.world_size}: no rank writes monitor lines. "
                            f"Fix: use a rank below {ident.world_size} or -1")
        if self._batch_size is None:
            dataset = cb_param(cb, "train_dataset", None)
            try:
                self._batch_size = int(dataset.get_batch_size()) if dataset is not None else None
            except Exception:  # noqa: BLE001 - some datasets cannot tell
                self._batch_size = None
        if "throughput" in cfg.metrics and not self._batch_size:
            self._warn_once("batch", "mfotel: throughput needs the batch size, which this run "
                            "does not report. Fix: set monitor_config.batch_size")
        if self.device_samples_per_step is None:
            self.device_samples_per_step = self._batch_size
        self._check_mfu()

    def _check_mfu(self) -> None:
        """Say at start why MFU cannot be computed, when peak_flops asks for it."""
        cfg = self.config
        if not cfg.peak_flops:
            return
        missing = [what for what, ok in (
            ("throughput in monitor_config.metrics", "throughput" in cfg.metrics),
            ("the sequence length (monitor_config.seq_length)", cfg.seq_length),
            ("the batch size (monitor_config.batch_size)", self.device_samples_per_step),
            ("the model's FLOPs per token (monitor_config.flops_per_token)",
             self.flops_per_token)) if not ok]
        if missing:
            self._warn_once("mfu", f"mfotel: peak_flops is set but MFU needs {', '.join(missing)}"
                            f"; mindformers_train_model_flops_utilization_ratio stays absent")
        else:
            log.info("mfotel: MFU from %.4g FLOPs per token and a peak of %.4g FLOP/s per device",
                     self.flops_per_token, cfg.peak_flops)

    def _watch_checkpoints(self, cb: Any) -> None:
        """Time the saves of the run's checkpoint callback (ModelCheckpoint and subclasses)."""
        for callback in cb_param(cb, "list_callback", None) or ():
            if isinstance(callback, ModelCheckpoint) and not self.checkpoints:
                self.checkpoints.append(CheckpointWatch(callback, self.instruments.state,
                                                        self.instruments.touch))

    def on_train_step_begin(self, run_context: Any) -> None:
        self._step_begin = time.perf_counter()

    def on_train_step_end(self, run_context: Any) -> None:
        if self.instruments is None:
            return
        try:
            self._step_end(run_context)
        except Exception as exc:  # noqa: BLE001 - never raise into training
            self._count_error("callback", exc)

    def on_train_end(self, run_context: Any) -> None:
        try:
            self.close()
        except Exception as exc:  # noqa: BLE001 - a subclass's close; later callbacks must run
            self._count_error("shutdown", exc)

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        """MindSpore enters every callback around `Model.train`: when training raised, the run
        ends here with status failed (cancelled for KeyboardInterrupt or after a signal),
        before the exception leaves train() (atexit may be far away, or never come)."""
        if exc is not None and self._error is None:
            self._error = exc
            try:
                self.close()
            except Exception as error:  # noqa: BLE001 - the training error must propagate
                self._count_error("shutdown", error)

    # Evaluation inside training (`Model.fit(..., valid_dataset=...)`). MindSpore 2.9's own
    # `eval_results["eval_loss"]` is the last batch's loss (its loss metric is created anew for
    # every batch), so the loss is a `loss` metric when the Model has one, else the mean of the
    # eval network's scalar first output over the batches.
    def on_eval_begin(self, run_context: Any) -> None:
        self._eval_begin, self._eval_losses = time.perf_counter(), []

    def on_eval_step_end(self, run_context: Any) -> None:
        if self.instruments is None:
            return
        try:
            outputs = cb_param(run_context.original_args(), "net_outputs", None)
            first = outputs[0] if isinstance(outputs, (tuple, list)) and outputs else outputs
            value = to_float(first) if getattr(first, "size", 1) == 1 else None
        except Exception:  # noqa: BLE001 - an output that is no loss: nothing to average
            value = None
        if value is not None:
            self._eval_losses.append(value)

    def on_eval_end(self, run_context: Any) -> None:
        if self.instruments is None:
            return
        try:
            loss = eval_loss(cb_param(run_context.original_args(), "metrics", None))
            if loss is None and self._eval_losses:
                loss = sum(self._eval_losses) / len(self._eval_losses)
            begin = self._eval_begin
            self.record_eval(loss, time.perf_counter() - begin if begin is not None else None)
        except Exception as exc:  # noqa: BLE001 - never raise into training
            self._count_error("callback", exc)
        finally:
            self._eval_begin, self._eval_losses = None, []

    def record_eval(self, loss: float | None, seconds: float | None) -> None:
        """An evaluation that ran after the last completed training step."""
        st = self.instruments.state
        if loss is not None:
            st.eval_loss, st.eval_step = loss, self._last_step
        if seconds is not None:
            st.eval_duration = seconds
        self.instruments.touch()
        log.info("mfotel: evaluation after step %d: loss %s, %.3f s", self._last_step,
                 "unknown" if loss is None else f"{loss:.6g}", seconds or 0.0)

    # ------------------------------------------------------------------ step logic
    def _step_end(self, run_context: Any) -> None:
        wall, now = time.time(), time.perf_counter()
        cb = run_context.original_args()
        step = self._global_step(cb)
        advanced = max(step - self._last_step, 1)
        begin = self._step_begin if self._step_begin is not None else self._last_end
        mark = self._step_end_mark  # an integration's end mark, if it belongs to this step
        end = mark if mark is not None and begin is not None and begin <= mark <= now else now
        step_seconds = (end - begin) / advanced if begin is not None else None
        if self._record_time is None:
            self._record_time = begin if begin is not None else now
        try:
            out = self._parse_outputs(cb)
        except Exception as exc:  # noqa: BLE001
            self._count_error("extract", exc)
            out = StepOutputs()
        st = self.instruments.state
        # the first step; or steps go on after a signal (a chained handler that stops
        # gracefully later or not at all, a KeyboardInterrupt that MindSpore swallowed)
        if st.status in (contract.STATUS_INITIALISING, contract.STATUS_CANCELLED,
                         contract.STATUS_FAILED) and self.closing_thread is None:
            st.status = contract.STATUS_RUNNING
            if self.closing_thread is not None:  # close() began meanwhile (the signal watcher)
                st.status = self._final_status_value
        st.step, st.steps, st.last_step_timestamp = step, st.steps + advanced, wall
        st.epoch = int(cb_param(cb, "cur_epoch_num", 0) or 0)
        if self._total_steps:
            st.progress = min(step / self._total_steps, 1.0)
        self._health(step, out)
        if step_seconds is not None:
            self.instruments.record_step_seconds(step_seconds)
        if self._batch_size:
            samples = self._batch_size * advanced
            st.samples = (st.samples or 0) + samples
            if self.config.seq_length:
                st.tokens = (st.tokens or 0) + samples * self.config.seq_length
            self._record_samples += samples
        self._record_steps += advanced
        recorded = self._crossed_record_step(step)
        if recorded:
            self._record(step, st.epoch, cb, out, now)
        if not is_finite(out.loss) and self.config.on_nonfinite == "stop" and not self._stopped:
            self._stopped = True
            run_context.request_stop()
            log.warning("mfotel: stopping the run after step %d (on_nonfinite: stop)", step)
        if self.actions is not None:
            self._apply_actions(run_context, cb, step, out.loss, recorded)
        self._last_step, self._last_end, self._step_begin = step, now, None
        self._step_end_mark = None
        self.instruments.touch()

    def _parse_outputs(self, cb: Any) -> StepOutputs:
        """StepOutputs of this step (mindformers' subclass fixes pipeline/micro-batch loss)."""
        return parse_net_outputs(cb.net_outputs)

    def _crossed_record_step(self, step: int) -> bool:
        return any(self.config.is_record_step(s) for s in range(self._last_step + 1, step + 1))

    @staticmethod
    def _optimizer(cb: Any) -> Any:
        return cb_param(cb, "optimizer") or getattr(cb_param(cb, "train_network"), "optimizer", None)

    def _apply_actions(self, run_context: Any, cb: Any, step: int, loss: float | None,
                       recorded: bool) -> None:
        """Local rules and the control file (mfotel.actions.engine), after this step's record."""
        for request in self.actions.step_end(step, loss, recorded, self._optimizer(cb)):
            if request.action == "stop" and not self._stopped:
                self._stopped = True
                run_context.request_stop()
            elif request.action == "scale_lr":
                self._lr = LearningRateReader()  # a list lr's table changed: read it again

    def _health(self, step: int, out: StepOutputs) -> None:
        st = self.instruments.state
        if out.loss is not None:
            finite = math.isfinite(out.loss)
            st.loss_finite = int(finite)
            if not finite:
                st.nonfinite["loss"] += 1
                if self.live is not None:
                    self.live.history.mark_nonfinite("loss", step, out.loss, self._last_step)
                if st.first_nonfinite_step is None:
                    st.first_nonfinite_step = step
                    if self.config.alertmanager_url:  # fast path: page before the next scrape
                        from .alerting.fastpage import loss_alert, page_async  # loaded at start
                        page_async(self.config.alertmanager_url,
                                   loss_alert(self.job_name, self.identity.rank, step, out.loss),
                                   lambda: self.instruments.count_error("alertmanager"))
                self._warn_once("nonfinite", f"mfotel: loss is {out.loss} at step {step} on rank "
                                f"{self.identity.rank} (job {self.job_name}); see "
                                f"mindformers_train_nonfinite_total")
        if not is_finite(out.grad_norm):
            st.nonfinite["grad_norm"] += 1
            if self.live is not None:
                self.live.history.mark_nonfinite("grad_norm", step, out.grad_norm, self._last_step)
        if out.overflow is not None:
            st.overflow = (st.overflow or 0) + int(out.overflow)
        if out.loss_scale is not None and math.isfinite(out.loss_scale):
            st.loss_scale = out.loss_scale

    def _record(self, step: int, epoch: int, cb: Any, out: StepOutputs, now: float) -> None:
        """Seed metrics of a record step; throughput and step_time are means over the steps
        since the previous record (wall time between the two step ends)."""
        st, values = self.instruments.state, {}
        elapsed = now - (self._record_time or now)
        for metric in self.config.metrics:
            if metric == "loss":
                value = out.loss
            elif metric == "learning_rate":
                value = out.learning_rate
                if value is None:
                    value = self._lr(self._optimizer(cb))
            elif metric == "grad_norm":
                value = out.grad_norm
            elif metric == "throughput":
                value = self._record_samples / elapsed if self._batch_size and elapsed > 0 else None
                self._record_device_throughput(elapsed)
            else:
                value = elapsed / self._record_steps if elapsed > 0 and self._record_steps else None
            values[metric] = value
            if value is not None and math.isfinite(value) and metric != "step_time":
                setattr(st, metric, value)
        self._record_time, self._record_samples, self._record_steps = now, 0, 0
        if self.live is not None:
            self.live.history.append(step, values)
        self._write_lines(step, epoch, values)

    def _record_device_throughput(self, elapsed: float) -> None:
        """Tokens/s per device and MFU over the record interval (README, Time figures)."""
        per_step, seq = self.device_samples_per_step, self.config.seq_length
        if not (per_step and seq and elapsed > 0 and self._record_steps):
            return
        st = self.instruments.state
        st.device_tokens = per_step * seq * self._record_steps / elapsed
        if self.flops_per_token and self.config.peak_flops:
            st.mfu = mfu(st.device_tokens, self.flops_per_token, self.config.peak_flops)

    def _write_lines(self, step: int, epoch: int, values: dict[str, float | None]) -> None:
        if not self.sinks:
            return
        text = format_line(step, values)
        for sink, as_json in self.sinks:
            try:
                sink.write(format_json(step, epoch, self.identity.rank, self.job_name, values)
                           if as_json else text)
            except Exception as exc:  # noqa: BLE001 - a full disk must not stop training
                self._count_error("sink", exc)

    # ------------------------------------------------------------------ end
    def on_signal(self, signum: int, failure: str | None = None) -> None:
        """A terminating signal arrived (mfotel.lifecycle): show status cancelled at once, or
        failed when `failure` explains it (MindSpore SIGTERMs itself when a dataset worker
        dies). Runs in a signal handler or the watcher thread, hence assignments only; a run
        already ending keeps its final status."""
        if self._signalled is None:
            self._signalled = signum
        if failure is not None and self._child_failure is None:
            self._child_failure = failure
        if self.closing_thread is None and self.instruments is not None:
            self.instruments.state.status = (contract.STATUS_FAILED if self._child_failure
                                             else contract.STATUS_CANCELLED)
            self.instruments.touch()

    @property
    def closed(self) -> bool:
        """Whether close() has nothing left to do (it finished, or nothing was started)."""
        return self._closed or self.instruments is None or self.telemetry is None

    def close_seconds(self) -> float:
        """The longest close() may take: the linger and the final OTLP push of each provider."""
        return self.config.prometheus.linger_seconds + 2 * self.config.otlp.timeout_seconds

    def _final_status(self) -> int:
        completed = not self._stopped and (self._total_steps is None or
                                           self._last_step >= self._total_steps)
        if self._error is not None:  # Ctrl-C, or a chained signal handler's sys.exit()
            cancelled = isinstance(self._error, KeyboardInterrupt) or \
                (isinstance(self._error, SystemExit) and self._signalled is not None and
                 self._child_failure is None)
            return contract.STATUS_CANCELLED if cancelled else contract.STATUS_FAILED
        if completed:
            return contract.STATUS_COMPLETED
        if self._signalled is not None and self._child_failure is None:
            return contract.STATUS_CANCELLED
        return contract.STATUS_FAILED

    def close(self) -> None:
        """Final status, linger (if configured), stop the endpoint and flush; idempotent.

        Every step runs even when an earlier one fails: a failure is counted in
        `mfotel_export_errors_total{stage="shutdown"}` and warned about once, never raised
        (KeyboardInterrupt, a second Ctrl-C during the linger, cuts the linger short).
        """
        if self.instruments is None or self.telemetry is None:
            return
        status = self._final_status()
        if not self._close_once.acquire(blocking=False):
            return
        self._final_status_value = status
        self.closing_thread = threading.get_ident()  # after the status: see _step_end
        if self._child_failure is not None:
            self._warn_once("child", f"mfotel: SIGTERM after {self._child_failure} (MindSpore "
                            f"ends a run whose dataset worker died that way): status failed")
        try:
            self._shutdown_step("status", lambda: self._set_status(status))
            self._shutdown_step("linger", self._linger)
        finally:
            # the final save (end) happened before, or never will
            self._shutdown_step("checkpoint watch", self._detach_checkpoints)
            completed = status == contract.STATUS_COMPLETED
            self._shutdown_step("file sinks", self._close_sinks)
            if self.run is not None:  # multi-rank: run identity and file_sd
                self._shutdown_step("run state", lambda: finish_run(
                    self.config.run, self.identity.rank, self.job_name, self.run,
                    self._last_step, completed))
            if self.file_sd is not None and completed:
                self._shutdown_step("file_sd", self.file_sd.remove)
            self._shutdown_step("telemetry", self.telemetry.shutdown)
            self._shutdown_step("atexit", lambda: atexit.unregister(self.close))
            self._closed = True
            # last: may re-deliver a signal that arrived during the linger (ends the process)
            self._shutdown_step("signal handlers", lambda: lifecycle.leave(self))

    def _shutdown_step(self, name: str, step: Any) -> None:
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - the end of training must not raise into MindSpore
            if self.instruments is not None:
                self.instruments.count_error("shutdown")
            self._warn_once(f"shutdown:{name}", f"mfotel: {name} failed at the end of training "
                            f"({type(exc).__name__}: {exc}); the other shutdown steps ran, "
                            f"failures are counted in mfotel_export_errors_total"
                            f"{{stage=\"shutdown\"}}")

    def _set_status(self, status: int) -> None:
        self.instruments.state.status = status
        self.instruments.touch()

    def _linger(self) -> None:
        prom = self.config.prometheus
        if not prom.linger_seconds or self.telemetry.endpoint is None:
            return
        log.info("mfotel: keeping /metrics up for the final scrape (at most %.0f s)",
                 prom.linger_seconds)
        if prom.linger_until_scraped:
            self.final_scraped = self.telemetry.wait_scraped(prom.linger_seconds)
        else:
            time.sleep(prom.linger_seconds)

    def _detach_checkpoints(self) -> None:
        for watch in self.checkpoints:
            watch.detach()

    def _close_sinks(self) -> None:
        for sink, _ in self.sinks:
            if isinstance(sink, FileSink):
                sink.close()
