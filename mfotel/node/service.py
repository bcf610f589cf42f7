"""The node agent inside mfotel-instrument: settings, the endpoint, file_sd, the linger.

`NodeService` is the supervisor's observer (`supervise.Supervisor(observer=...)`): it starts
the agent once the job's signals are blocked, hears the processes the supervisor reaps and
the cancels it passes on, opens the node endpoint when the first rank appears (a plain
command that starts no rank opens nothing), and when the job ended keeps serving the ranks'
final facts for `linger` seconds if a Prometheus scraped it meanwhile: so every server of an
HA pair scrapes how each rank ended, instead of one of them seeing a running rank vanish.

The ranks tell the agent who they are: `rendezvous` makes the job's node directory (private
to its user, mode 0700, removed by `close`) and names it in `MFOTEL_NODE_DIR` of the command's
environment; each rank under mfotel announces itself there at train begin
(mfotel.node_link), and the agent guesses only the ranks that do not.

Settings come from the ranks' own monitor config (the same YAML: bind address, web-config,
limits, rank port, job name, file_sd), so the node endpoint is exactly as reachable and as
protected as the ranks':

    cfg = training_config(["msrun", ..., "run_mindformer.py", "--config", "llama.yaml"])
    service = NodeService(cfg)      # node_port: prometheus.node_port, else port - 1
"""
from __future__ import annotations

import os
import shutil
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from ..cluster.discovery import WILDCARD_HOSTS, target_groups, write_target_file
from ..config import ConfigError, MonitorConfig, read_yaml, resolve_otel_env
from ..config.settings import SECTION
from ..config.source import (
    callback_entries,
    config_from_document,
    is_mindformers_document,
    safe_job_name,
)
from ..node_link import ENV_DIR
from .agent import DEFAULT_PROBE_INTERVAL, AgentSettings, NodeAgent
from .endpoint import NodeEndpoint, scheme
from .metrics import NodeCollector
from .supervise import note

#: After the job, how long the ranks' final facts are served by default: one scrape and one
#: evaluation (15 s each, shipped) and the critical route's group_wait (10 s) must see a rank
#: that ended still reported, or its page would go out resolved.
NODE_LINGER_SECONDS = 60.0
#: How long the end of the job waits for the agent to settle the last exits.
_SETTLE_SECONDS = 2.0


def config_argument(argv: Sequence[str]) -> str | None:
    """The YAML of a `--config x.yaml` / `--config=x.yaml` argument (mindformers' launchers)."""
    for i, arg in enumerate(argv):
        path = argv[i + 1] if arg == "--config" and i + 1 < len(argv) else (
            arg.split("=", 1)[1] if arg.startswith("--config=") else None)
        if path and path.endswith((".yaml", ".yml")):
            return path
    return None


def training_config(command: Sequence[str], path: str | None = None) -> MonitorConfig:
    """The ranks' monitor settings: from `path`, else from the command's `--config` YAML when
    it holds mfotel settings, else the defaults; OTEL_* variables applied as the ranks do.

    ConfigError for a file that cannot be read or holds invalid mfotel settings (the ranks
    would refuse it too).
    """
    explicit = path is not None
    path = path or config_argument(command)
    cfg = MonitorConfig()
    if path is not None and (explicit or Path(path).is_file()):
        document = read_yaml(path)
        if explicit or _holds_settings(document):
            cfg = config_from_document(document, str(path))
            stem = safe_job_name(Path(path).stem)
            if cfg.job_name is None and stem:
                cfg = cfg.with_job_name(stem)  # as the ranks name their job: the YAML's stem
    return resolve_otel_env(cfg, default_job_name=cfg.job_name or "mindformers").config


def _holds_settings(document: object) -> bool:
    """A mindformers YAML with an OTelMonitor entry, or a YAML with a monitor_config block."""
    if not isinstance(document, dict):
        return False
    return bool(callback_entries(document)) or (
        SECTION in document and not is_mindformers_document(document))


def node_port(cfg: MonitorConfig) -> int:
    """prometheus.node_port; by default the port below the ranks' (9463); 0: off."""
    prom = cfg.prometheus
    if prom.node_port is not None:
        return prom.node_port
    return prom.port - 1 if prom.port > 1 else 0


#: A node directory's name: this prefix, the host's name, its launcher's pid, a random suffix
#: (dashes between).
NODE_DIR_PREFIX = "mfotel-node-"


def _node_dir_stem() -> str:
    """The start of this host's node directories' names (a pid means something on this host
    only: containers may share a /tmp, each with its own pids)."""
    return f"{NODE_DIR_PREFIX}{socket.gethostname()}-"


def _remove_stale_node_dirs(parent: Path) -> None:
    """Remove this user's node directories of this host in `parent` whose launcher is gone
    (one killed before its close(), e.g. by SIGKILL, leaves its directory behind); a directory
    whose pid runs (its launcher, or the pid reused) stays."""
    stem = _node_dir_stem()
    try:
        found = [p for p in parent.iterdir() if p.name.startswith(stem)]
    except OSError:
        return
    for folder in found:
        pid = folder.name[len(stem):].split("-", 1)[0]
        if not pid.isdigit():
            continue
        try:
            info = folder.lstat()  # a symbolic link is no directory of ours
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except OSError:  # gone meanwhile, or a pid of another user: running
            continue


class NodeService:
    """The node agent, its endpoint and its target file, for one job (see module docstring)."""

    def __init__(self, cfg: MonitorConfig, linger: float | None = None,
                 probe_interval: float = DEFAULT_PROBE_INTERVAL) -> None:
        self.cfg = cfg
        self.port = node_port(cfg)
        self.linger = NODE_LINGER_SECONDS if linger is None else linger
        self.settings = AgentSettings(
            rank_port=cfg.prometheus.port, rank_scheme=scheme(cfg.prometheus, cfg.source),
            job_name=cfg.job_name or "mindformers", probe_interval=probe_interval)
        self.agent: NodeAgent | None = None
        self.node_dir: Path | None = None  # where the ranks announce themselves
        self.endpoint: NodeEndpoint | None = None
        self.target_file: Path | None = None
        self._opened = threading.Lock()
        self._tried = False

    def rendezvous(self, env: dict[str, str]) -> dict[str, str]:
        """`env` (the command's) naming the node directory the ranks announce themselves in,
        made now (mode 0700: the job's user's alone; removed by close(), or by a later
        launcher once its own is gone). Unchanged when it cannot be made: the agent then
        guesses every rank."""
        _remove_stale_node_dirs(Path(tempfile.gettempdir()))
        try:
            self.node_dir = Path(tempfile.mkdtemp(prefix=f"{_node_dir_stem()}{os.getpid()}-"))
        except OSError as exc:
            note(f"cannot create the node directory ({exc.strerror or exc}); the node agent "
                 "guesses which process is which rank. Fix: set TMPDIR to a writable directory")
            return env
        self.settings = replace(self.settings, node_dir=self.node_dir)
        return {**env, ENV_DIR: str(self.node_dir)}

    # ------------------------------------------------------------------ the supervisor's calls
    def started(self, supervisor_pid: int) -> None:
        """The command runs; signals are blocked (the agent's threads inherit the mask)."""
        agent = NodeAgent(supervisor_pid, self.settings, on_rank=self.open)
        self.agent = agent  # before its first scan: a rank found there opens the endpoint
        agent.start()

    def reaped(self, pid: int, status: int) -> None:
        if self.agent is not None:
            self.agent.reaped(pid, status)

    def cancelling(self) -> None:
        if self.agent is not None:
            self.agent.cancelling()

    def ended(self) -> float:
        """The job ended: seconds to keep serving its ranks' final facts (0: none)."""
        if self.agent is None:
            return 0.0
        deadline = time.monotonic() + _SETTLE_SECONDS
        while not self.agent.settled() and time.monotonic() < deadline:
            time.sleep(0.05)
        scraped = self.endpoint is not None and self.endpoint.scrapes.count > 0
        return self.linger if scraped and self.agent.has_ranks else 0.0

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()
        if self.endpoint is not None:
            self.endpoint.close()
        if self.target_file is not None:
            self.target_file.unlink(missing_ok=True)
        if self.node_dir is not None:
            shutil.rmtree(self.node_dir, ignore_errors=True)

    # ------------------------------------------------------------------ the endpoint
    def open(self) -> None:
        """Serve the node endpoint (once, when the first rank appears)."""
        with self._opened:
            if self._tried or not self.port or self.agent is None:
                return
            self._tried = True
            endpoint = NodeEndpoint(NodeCollector(self.agent.views), self.cfg.prometheus,
                                    self.port, self.cfg.source)
            if not endpoint.start():
                return
            self.endpoint = endpoint
            self.agent.stacks.opened(endpoint)  # /stacks; node.json for the ranks' pages
            note(f"node endpoint {endpoint.url} (each rank's process state, exit cause, CPU, "
                 f"memory; lingers {self.linger:g} s after the job once scraped)")
            self.target_file = self._write_target(endpoint)

    def _write_target(self, endpoint: NodeEndpoint) -> Path | None:
        """The node target, beside the ranks' file_sd file(s)."""
        template = self.cfg.file_sd.path
        if not template:
            return None
        host = self.cfg.prometheus.host
        host = socket.gethostname() if host in WILDCARD_HOSTS else host
        job_name = self.cfg.job_name or "mindformers"
        if "{rank}" in template:
            path = Path(template.format(rank=f"node-{host}", job_name=job_name))
        else:
            ranks = Path(template.format(rank=0, job_name=job_name))
            path = ranks.with_name(f"{ranks.stem}.node-{host}{ranks.suffix}")
        groups = target_groups([host], 1, endpoint.port, dict(self.cfg.file_sd.labels),
                               endpoint.scheme)
        try:
            return write_target_file(path.expanduser().absolute(), groups)
        except OSError as exc:
            note(f"cannot write the node's file_sd target {path} ({exc.strerror or exc}); "
                 "Prometheus will not find the node endpoint there. Fix: make the directory "
                 "of monitor_config.file_sd.path writable")
            return None


def with_node_port(cfg: MonitorConfig, port: int | None) -> MonitorConfig:
    """`cfg` with `--node-port` applied (None: as configured)."""
    if port is None:
        return cfg
    return replace(cfg, prometheus=replace(cfg.prometheus, node_port=port))


def training_config_or_exit(command: Sequence[str], path: str | None) -> MonitorConfig:
    try:
        return training_config(command, path)
    except ConfigError as exc:
        note(f"{exc}")
        raise SystemExit(2) from None
