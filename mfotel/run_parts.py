"""A run's parts, assembled from its settings at train begin (no MindSpore).

    parts = assemble(cfg, identity, "llama", monitor, plan=RecordPlan.of(cfg), shape=shape,
                     warn_once=warn_once, close=monitor.close)
    parts.recorder.end(tick, outputs, epoch, total_steps, wall)   # every step (step_record)
    parts.end.finish(parts, total_steps, last_step)               # the monitor's close()

The optional parts are imported only when the settings ask for them, each plainly inside the
function (tests/unit/test_core_imports.py: ATTACHMENTS). `assemble` builds them in this
order, for these reasons:

1. The port (`rank_port`: two ranks of the job on one port is a ConfigError) and the run
   identity (`start_run` counts the attempt) before anything binds or starts.
2. The actions engine, started: a setup that cannot work is a ConfigError before any part.
3. The exporter, not serving yet: every other part reads or counts into its state, the
   process's time account (mfotel.time_account) included.
4. The parts that add routes or listen: the checkpoint watch, the live page (its routes;
   its history first among the listeners, so the page has a record before others act on
   it), the fast page (loaded now, not on the first NaN's step), the actions engine.
5. Serve: /metrics and the live page's routes, on one port.
6. Once the endpoint's fate is known: the multi-rank setup (a port another rank holds is
   explained as a ConfigError; file_sd targets name the scheme served) and the node link (it
   tells the node agent the address, port and scheme).
7. The monitor lines last (it prints where the file goes), then the warnings that need the
   run, and the line that says where /metrics is.
8. Armed, once whole: the run ends at interpreter exit and at SIGTERM / SIGINT whatever
   becomes of training (mfotel.run_end); the signal handlers last, so that a failed start
   leaves them alone, and a failure to install them is counted (stage callback), not raised.

Any failure undoes what was built (ExitStack: the endpoint stopped, the node link closed,
the lines' thread stopped, the checkpoint callback restored) and raises: nothing stays bound.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, Protocol, TypeVar

from .checkpoints import CheckpointWatch
from .config import DEFAULT_JOB_NAME, MonitorConfig, check_writable, resolve_otel_env
from .config.otel_env import disabled_notice
from .endpoint.webconfig import WebConfig, endpoint_web_config
from .identity import RankIdentity, RunIdentity, rank_port, start_run
from .listeners import RunControl, StepListener
from .node_link import Announcement, NodeLink
from .rank_exporter import RankExporter, rank_exporter
from .run_end import RunEnd, close_seconds
from .sinks import ConsoleSink, FileSink, LineWriter, Sink
from .start_checks import RunShape, mfu_missing, start_warnings
from .step_record import RecordPlan, StepRecorder
from .telemetry import Endpoint, local_endpoints_line
from .time_account import TimeAccount, process_account

if TYPE_CHECKING:  # optional parts, imported when configured (the core never needs them)
    from .actions.engine import ActionEngine
    from .ui import LivePage

log = logging.getLogger("mfotel")
WarnOnce = Callable[[str, str], None]
T = TypeVar("T")


class Removable(Protocol):
    """A file the run wrote that a normal end removes (mfotel.cluster.discovery.FileSdWriter)."""

    def remove(self) -> None: ...


@dataclass
class RunParts:
    """One run's parts (`assemble` builds them; mfotel.run_end shuts them down)."""

    config: MonitorConfig
    rank: int
    job_name: str
    exporter: RankExporter
    run: RunIdentity
    end: RunEnd
    recorder: StepRecorder
    listeners: list[StepListener]   # in the order they are called
    lines: LineWriter | None = None
    file_path: Path | None = None   # the monitor lines' file
    checkpoint: CheckpointWatch | None = None
    file_sd: Removable | None = None
    node_link: NodeLink | None = None   # under mfotel-instrument: its node agent
    live: LivePage | None = None
    actions: ActionEngine | None = None
    account: TimeAccount | None = None   # the process's (mfotel.time_account), closed at the end

    def add_listener(self, listener: StepListener) -> None:
        self.listeners.append(listener)
        self.recorder.attach(self.listeners)


class HasParts(Protocol):
    _parts: RunParts | None   # assembled at train begin (OTelMonitor)


class OfRun(Generic[T]):
    """An attribute of a monitor read from its run's parts; None before train begin:

        class OTelMonitor(Callback):
            exporter = OfRun(lambda parts: parts.exporter)
    """

    def __init__(self, read: Callable[[RunParts], T]) -> None:
        self.read = read

    def __get__(self, monitor: HasParts | None, owner: type | None = None) -> T | None:
        parts = monitor._parts if monitor is not None else None
        return self.read(parts) if parts is not None else None


def failure_warning(stage: str, exc: BaseException) -> str:
    """The warning of the first failure at `stage` (`mfotel_export_errors_total{stage}`)."""
    return (f"mfotel: {stage} failed ({type(exc).__name__}: {exc}); training continues, "
            f"further failures are counted in mfotel_export_errors_total{{stage=\"{stage}\"}}")


def assemble(cfg: MonitorConfig, identity: RankIdentity, job_name: str, control: RunControl, *,
             plan: RecordPlan, shape: RunShape, warn_once: WarnOnce,
             read_learning_rate: Callable[[], float | None] = lambda: None,
             web: WebConfig | None = None, listeners: Sequence[StepListener] = (),
             checkpoint_callback: Any = None, train_network: Any = None,
             close: Callable[[], None] | None = None) -> RunParts:
    """The parts of one run of rank `identity` (the order and its reasons: the module
    docstring). `control` is what listeners may ask of the run (the monitor); `plan` what a
    step records; `shape` the run's length and batch size; `listeners` those attached before
    train begin; `checkpoint_callback` the run's checkpoint callback to time, if any;
    `close` the monitor's close(), armed (None: the caller arms `parts.end` itself)."""
    port = rank_port(cfg.prometheus.port, identity, cfg.source)
    run = start_run(cfg.run, identity.rank, job_name, cfg.source)
    actions = None
    if cfg.actions.enabled:
        from .actions.engine import ActionEngine
        actions = ActionEngine(cfg.actions, job_name, identity.rank, identity.world_size)
        actions.start(control.optimizer(), train_network)
    with ExitStack() as undo:
        exporter = rank_exporter(cfg, identity, job_name, run=run, web=web, serve=False)
        undo.callback(exporter.shutdown)
        instruments = exporter.instruments
        instruments.state.start_timestamp = time.time()
        account = process_account()   # one a process, whatever the runs (mfotel.time_account)
        instruments.state.time, instruments.state.process_start_timestamp = \
            account.totals, account.origin

        def count(stage: str, exc: BaseException) -> None:
            instruments.count_error(stage)
            warn_once(f"error:{stage}", failure_warning(stage, exc))
        checkpoint = None
        if checkpoint_callback is not None:
            checkpoint = CheckpointWatch(checkpoint_callback, instruments.state,
                                         instruments.touch, account)
            undo.callback(checkpoint.detach)
        attached, routes, live = list(listeners), {}, None
        telemetry = exporter.telemetry
        if cfg.prometheus.ui and telemetry.port:  # same port, TLS and auth as /metrics
            from .ui import HistoryRecorder, live_page
            live = live_page(cfg, identity, job_name, instruments.state, telemetry.cert_file)
            routes = live.routes()
            attached.insert(0, HistoryRecorder(live.history))
        if cfg.alertmanager_url:
            from .alerting.fastpage import FastPage
            attached.append(FastPage(cfg.alertmanager_url, job_name, identity.rank,
                                     lambda: instruments.count_error("alertmanager")))
        if actions is not None:
            actions.attach(instruments)
            attached.append(actions)
        exporter.serve(routes)
        endpoint, scheme = telemetry.endpoint, "https" if telemetry.cert_file else "http"
        file_sd = _set_up_ranks(cfg, identity, job_name, port, endpoint is not None, scheme)
        node_link = _join_node(identity, job_name, endpoint, count)
        if node_link is not None:
            undo.callback(node_link.close)
            attached.append(node_link)
        lines, file_path = _open_lines(cfg, identity.rank, job_name, warn_once,
                                       lambda exc: count("sink", exc))
        if lines is not None:
            undo.callback(lines.close)
        end = RunEnd(instruments, warn_once)
        recorder = StepRecorder(instruments, plan, control, end, lines=lines,
                                read_learning_rate=read_learning_rate, warn_once=warn_once,
                                count_error=count, rank=identity.rank, job_name=job_name,
                                account=account)
        recorder.attach(attached)
        parts = RunParts(cfg, identity.rank, job_name, exporter, run, end, recorder, attached,
                         lines, file_path, checkpoint, file_sd, node_link, live, actions,
                         account)
        _check_run(cfg, identity, shape, plan, warn_once)
        _tell_where(parts, identity, endpoint, scheme)
        undo.pop_all()
    if close is not None:
        try:
            end.arm(close, close_seconds(cfg))
        except Exception as exc:  # noqa: BLE001 - monitoring without them beats no training
            count("callback", exc)
    return parts


class Settings(NamedTuple):
    config: MonitorConfig     # explicit keys, then OTEL_* variables, then defaults
    job_name: str
    web: WebConfig | None     # the endpoint's TLS / auth, loaded once


def checked_settings(config: MonitorConfig, default_job_name: str, rank: int) -> Settings:
    """A monitor's settings, checked when it is built, before training: OTEL_* variables
    applied (each problem warned), the output file writable, the endpoint's TLS / auth files
    loaded (a bad one is a ConfigError now, not at train begin)."""
    resolved = resolve_otel_env(config, default_job_name=default_job_name)
    for warning in resolved.warnings:
        log.warning("mfotel: %s", warning)
    notice = disabled_notice(resolved)
    if notice and config.enable:
        log.warning(notice)
    cfg = resolved.config
    job_name = cfg.job_name or DEFAULT_JOB_NAME
    check_writable(cfg, rank, job_name)
    prom = cfg.prometheus
    web = endpoint_web_config(prom, cfg.source) if cfg.enable or prom.web_config_file else None
    return Settings(cfg, job_name, web)


def _set_up_ranks(cfg: MonitorConfig, identity: RankIdentity, job_name: str, port: int,
                  served: bool, scheme: str) -> Removable | None:
    """Explain a port held by another rank, write the file_sd file (mfotel.cluster, imported
    only for those)."""
    if not ((port and not served) or cfg.file_sd.path):
        return None
    from .cluster.rank_setup import set_up_rank
    return set_up_rank(cfg, identity, job_name, port, served, scheme)


def _join_node(identity: RankIdentity, job_name: str, endpoint: Endpoint | None,
               count: Callable[[str, BaseException], None]) -> NodeLink | None:
    """Under mfotel-instrument: tell its node agent who this rank is and where it serves,
    keep the step heartbeat it reads, let it capture the stacks (mfotel.node_link)."""
    try:
        return NodeLink.join(Announcement(
            os.getpid(), job_name, identity.rank, identity.local_rank, identity.world_size,
            endpoint.host if endpoint else "", endpoint.port if endpoint else 0,
            endpoint.scheme if endpoint else "http"))
    except OSError as exc:  # the agent then guesses, as for a rank without mfotel
        count("node_link", exc)
        return None


def _open_lines(cfg: MonitorConfig, rank: int, job_name: str, warn_once: WarnOnce,
                on_error: Callable[[BaseException], None]
                ) -> tuple[LineWriter | None, Path | None]:
    """The monitor lines' writer (None when this rank writes none) and their file."""
    if not cfg.logs_on(rank):
        return None, None
    sinks: list[tuple[Sink, bool]] = []
    path = None
    if cfg.output.console:
        sinks.append((ConsoleSink(), False))
    if cfg.output.file:
        path = check_writable(cfg, rank, job_name)
        assert path is not None
        if (cfg.log_rank is None or len(cfg.log_rank) > 1) and \
                "{rank}" not in cfg.output.file_path:
            warn_once("shared-file", f"mfotel: several ranks log to one file {path}; add "
                      f"{{rank}} to output.file_path")
        sinks.append((FileSink(path), cfg.output.format == "json"))
        print(f"mfotel: rank {rank} writes monitor lines to {path}", flush=True)
    return (LineWriter(sinks, rank, job_name, on_error) if sinks else None), path


def _check_run(cfg: MonitorConfig, identity: RankIdentity, shape: RunShape, plan: RecordPlan,
               warn_once: WarnOnce) -> None:
    """Warnings that need the run (mfotel.start_checks); how MFU is computed, when it is."""
    for key, message in start_warnings(cfg, shape, identity.world_size, plan.device_samples,
                                       plan.flops_per_token):
        warn_once(key, message)
    if cfg.peak_flops and plan.flops_per_token and \
            not mfu_missing(cfg, plan.device_samples, plan.flops_per_token):
        log.info("mfotel: MFU from %.4g FLOPs per token and a peak of %.4g FLOP/s per "
                 "device", plan.flops_per_token, cfg.peak_flops)


def _tell_where(parts: RunParts, identity: RankIdentity, endpoint: Endpoint | None,
                scheme: str) -> None:
    cfg, job_name, live = parts.config, parts.job_name, parts.live
    log.info("mfotel: job %s rank %d/%d, /metrics %s, live page %s", job_name,
             identity.rank, identity.world_size, endpoint.url if endpoint else "off",
             endpoint.page_url if endpoint and live else "off")
    where = local_endpoints_line(cfg, identity, job_name, scheme, live is not None,
                                 endpoint is not None)
    if where:  # printed: a plain run configures no logging, and INFO would not show
        print(where, flush=True)
