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
import time
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mindspore.train import Callback

from . import contract
from .config import (DEFAULT_JOB_NAME, ConfigError, MonitorConfig, check_writable, load_config,
                     override, parse_config, resolve_otel_env)
from .config.otel_env import disabled_notice
from .extract import StepOutputs, cb_param, is_finite, parse_net_outputs, to_float
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
    warned about once.
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
        self.telemetry: Telemetry | None = None
        self.instruments: Instruments | None = None
        self.sinks: list[tuple[Any, bool]] = []  # (sink, json?)
        self.file_path: Path | None = None
        self._lr = LearningRateReader()
        self._warned: set[str] = set()
        self._batch_size: int | None = self.config.batch_size
        self._total_steps: int | None = None
        self._last_step = 0
        self._step_begin: float | None = None
        self._last_end: float | None = None
        self._record_time: float | None = None
        self._record_samples = 0
        self._stopped = False
        self._closed = False
        self.actions: ActionEngine | None = None  # mfotel.actions.engine
        self.live: LivePage | None = None  # the live page (mfotel.ui), fed at records
        self.final_scraped = False  # whether a scrape saw the final status before shutdown
        # multi-rank (mfotel.identity / mfotel.cluster.discovery)
        self.run: RunIdentity | None = None
        self.file_sd: FileSdWriter | None = None
        self._step_offset: int | None = None  # global step - cur_step_num, set at the first step
        self._begin_step = 0                   # cur_step_num at train begin (resume)
        #: The global step the run resumed from, when an integration knows it (mindformers
        #: skips the dataset by runner_config.initial_step and restarts cur_step_num at 1).
        self.resume_step: int | None = None

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

    # ------------------------------------------------------------------ multi-rank
    def _telemetry_config(self) -> MonitorConfig:
        """The config with identity and run attributes added to the OTel resource."""
        extra = {**self.identity.resource_attributes(), **self.run.resource_attributes(),
                 **self.config.resource_attributes}
        return dataclasses.replace(self.config, resource_attributes=extra)

    def _start_multirank(self, cb: Any, port: int) -> None:
        """Explain a port held by another rank; write the file_sd file; note the resumed step."""
        self._begin_step = int(cb_param(cb, "cur_step_num", 0) or 0)
        from .cluster.discovery import FileSdWriter, check_port_collision
        try:
            if port and self.telemetry.endpoint is None:
                check_port_collision(self.config, self.identity, self.job_name, port)
            self.file_sd = FileSdWriter(self.config, self.identity, self.job_name)
            try:
                written = self.file_sd.write()
            except OSError as exc:
                raise ConfigError(self.config.source, "monitor_config.file_sd.path",
                                  f"cannot write {self.file_sd.path} ({exc.strerror or exc})",
                                  "choose a writable path (a directory Prometheus reads)") from None
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
        self.close()

    # ------------------------------------------------------------------ step logic
    def _step_end(self, run_context: Any) -> None:
        wall, now = time.time(), time.perf_counter()
        cb = run_context.original_args()
        step = self._global_step(cb)
        advanced = max(step - self._last_step, 1)
        begin = self._step_begin if self._step_begin is not None else self._last_end
        step_seconds = (now - begin) / advanced if begin is not None else None
        if self._record_time is None:
            self._record_time = begin if begin is not None else now
        try:
            out = self._parse_outputs(cb)
        except Exception as exc:  # noqa: BLE001
            self._count_error("extract", exc)
            out = StepOutputs()
        st = self.instruments.state
        st.status = contract.STATUS_RUNNING
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
        recorded = self._crossed_record_step(step)
        if recorded:
            self._record(step, st.epoch, cb, out, step_seconds, now)
        if not is_finite(out.loss) and self.config.on_nonfinite == "stop" and not self._stopped:
            self._stopped = True
            run_context.request_stop()
            log.warning("mfotel: stopping the run after step %d (on_nonfinite: stop)", step)
        if self.actions is not None:
            self._apply_actions(run_context, cb, step, out.loss, recorded)
        self._last_step, self._last_end, self._step_begin = step, now, None
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

    def _record(self, step: int, epoch: int, cb: Any, out: StepOutputs,
                step_seconds: float | None, now: float) -> None:
        st, values = self.instruments.state, {}
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
                elapsed = now - (self._record_time or now)
                value = self._record_samples / elapsed if self._batch_size and elapsed > 0 else None
            else:
                value = step_seconds
            values[metric] = value
            if value is not None and math.isfinite(value) and metric != "step_time":
                setattr(st, metric, value)
        self._record_time, self._record_samples = now, 0
        if self.live is not None:
            self.live.history.append(step, values)
        self._write_lines(step, epoch, values)

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
    def close(self) -> None:
        """Final status, linger (if configured), stop the endpoint and flush; idempotent."""
        if self._closed or self.instruments is None or self.telemetry is None:
            return
        self._closed = True
        atexit.unregister(self.close)
        st = self.instruments.state
        completed = not self._stopped and (self._total_steps is None or self._last_step >= self._total_steps)
        st.status = contract.STATUS_COMPLETED if completed else contract.STATUS_FAILED
        self.instruments.touch()
        prom = self.config.prometheus
        if prom.linger_seconds and self.telemetry.endpoint is not None:
            log.info("mfotel: keeping /metrics up for the final scrape (at most %.0f s)",
                     prom.linger_seconds)
            if prom.linger_until_scraped:
                self.final_scraped = self.telemetry.wait_scraped(prom.linger_seconds)
            else:
                time.sleep(prom.linger_seconds)
        for sink, _ in self.sinks:
            if isinstance(sink, FileSink):
                sink.close()
        if self.run is not None:  # multi-rank: run identity and file_sd
            finish_run(self.config.run, self.identity.rank, self.job_name, self.run,
                       self._last_step, completed)
        if self.file_sd is not None and completed:
            self.file_sd.remove()
        self.telemetry.shutdown()
