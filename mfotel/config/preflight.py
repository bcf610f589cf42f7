"""Checks against the machine, not the document: writable directories and the port plan.

    path = check_writable(cfg, rank, job_name)          # at start: creates the log directory
    errors, warnings = preflight(cfg, ranks_per_node=8) # `mfotel check`: leaves nothing behind

Both try rather than ask: access() says yes to root for a directory under /proc that no one can
create, so a directory is proven creatable by creating a temporary one (removed at once) and a
port free by binding it.
"""
from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

from .errors import ConfigError
from .ports import port_in_use
from .settings import SECTION, MonitorConfig, fill

MAX_PORT = 65535
FIRST_UNPRIVILEGED_PORT = 1024
#: Default ports of the neighbours a rank's range should not cover.
WELL_KNOWN_PORTS = {3000: "Grafana", 4317: "OTLP/gRPC", 4318: "OTLP/HTTP", 9090: "Prometheus",
                    9093: "Alertmanager", 9094: "Alertmanager cluster", 9100: "node_exporter"}
_LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1", "0.0.0.0", "")


def check_writable(cfg: MonitorConfig, rank: int, job_name: str) -> Path | None:
    """Create the file sink's directory and prove it writable; the resolved path, or None."""
    if not (cfg.enable and cfg.output.file):
        return None
    path = cfg.output.resolved_file_path(rank, job_name)
    key = f"{SECTION}.output.file_path"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(cfg.source, key,
                          f"cannot create directory {path.parent} ({exc.strerror})",
                          "choose a writable file_path or fix the directory's permissions"
                          ) from None
    problem = writable_problem(path)  # also a FIFO or directory at the path: never opened
    if problem is not None:
        raise ConfigError(cfg.source, key, problem,
                          "choose a writable file_path (a regular file) or fix the permissions")
    return path


def writable_problem(path: Path) -> str | None:
    """Why `path` could not be created and written, or None; found by trying and leaving
    nothing behind: an existing file is opened for appending (nothing written), else a
    temporary file (in an existing directory) or directory (under the nearest existing
    parent) is created and removed."""
    if path.exists():
        if not path.is_file():
            return f"{path} exists and is not a regular file"
        try:
            with open(path, "ab"):
                pass
        except OSError as exc:
            return f"{path} cannot be opened for writing ({exc.strerror})"
        return None
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{ancestor} is not a directory, so {path.parent} cannot be created"
    try:
        if ancestor == path.parent:
            with tempfile.NamedTemporaryFile(dir=ancestor, prefix=".mfotel-check-"):
                pass
        else:
            os.rmdir(tempfile.mkdtemp(dir=ancestor, prefix=".mfotel-check-"))
    except OSError as exc:
        if ancestor == path.parent:
            return f"cannot create a file in the directory {ancestor} ({exc.strerror})"
        return f"cannot create the directory {path.parent} under {ancestor} ({exc.strerror})"
    return None


def output_paths(cfg: MonitorConfig, job_name: str, rank: int = 0) -> list[tuple[str, Path]]:
    """(key path, file) of every file the run writes, for `rank`."""
    paths: list[tuple[str, Path]] = []
    if cfg.output.file:
        paths.append(("output.file_path", cfg.output.resolved_file_path(rank, job_name)))
    sd_path = cfg.file_sd.resolved_path(rank, job_name)
    if sd_path is not None and cfg.prometheus.port:
        paths.append(("file_sd.path", sd_path))
    if cfg.run.state_file:
        paths.append(("run.state_file", fill(cfg.run.state_file, rank, job_name)))
    return paths


def _local_port(url: str | None, hosts: tuple[str, ...]) -> int | None:
    """The port of `url` when it points at this machine (or at `hosts`), else None."""
    if not url:
        return None
    try:
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return None
    return port if (parts.hostname or "") in hosts else None


def port_plan(cfg: MonitorConfig, ranks_per_node: int, prefix: str
              ) -> tuple[list[ConfigError], list[str]]:
    """Errors and warnings of the ports a node's ranks serve: base .. base + ranks - 1."""
    base = cfg.prometheus.port
    errors: list[ConfigError] = []
    warnings: list[str] = []
    if not base:
        return errors, warnings
    key = f"{prefix}.prometheus.port"
    last = base + ranks_per_node - 1
    if last > MAX_PORT:
        highest = MAX_PORT - ranks_per_node + 1
        fix = f"use a base port of at most {highest}" if highest >= FIRST_UNPRIVILEGED_PORT \
            else (f"{ranks_per_node} ranks cannot each have a port on one node: check the ranks "
                  f"per node (one node's ranks, e.g. 8); at most "
                  f"{MAX_PORT - FIRST_UNPRIVILEGED_PORT + 1} fit above port "
                  f"{FIRST_UNPRIVILEGED_PORT - 1}")
        errors.append(ConfigError(cfg.source, key, f"{ranks_per_node} ranks per node serve ports "
                                  f"{base}..{last} (port + local rank), past {MAX_PORT}", fix))
        return errors, warnings
    hosts = (*_LOCAL_HOSTS, socket.gethostname(), cfg.prometheus.host)
    for name, url in (("alertmanager_url", cfg.alertmanager_url),
                      ("otlp.endpoint", cfg.otlp.endpoint)):
        port = _local_port(url, hosts)
        if port is not None and base <= port <= last:
            errors.append(ConfigError(cfg.source, key, f"local rank {port - base} would serve "
                                      f"port {port}, which {prefix}.{name} uses on this host",
                                      f"move the ranks' range {base}..{last} or the {name} port"))
    for port, owner in WELL_KNOWN_PORTS.items():
        if base <= port <= last:
            warnings.append(f"{cfg.source}: {key}: the ranks' ports {base}..{last} include "
                            f"{port}, {owner}'s default port: a rank will fail to bind if "
                            f"{owner} runs on the node")
    if base < FIRST_UNPRIVILEGED_PORT:
        warnings.append(f"{cfg.source}: {key}: ports below {FIRST_UNPRIVILEGED_PORT} need root "
                        f"or CAP_NET_BIND_SERVICE; the ranks serve {base}..{last}")
    warnings += ports_taken(cfg, ranks_per_node, key)
    return errors, warnings


def ports_taken(cfg: MonitorConfig, ranks_per_node: int, key: str) -> list[str]:
    """A warning for each planned port that cannot be bound now on the configured host (a
    port may free up before the run: a warning, not an error)."""
    base, host = cfg.prometheus.port, cfg.prometheus.host
    warnings = []
    for local_rank in range(ranks_per_node):
        try:
            taken = port_in_use(host, base + local_rank)
        except OSError:  # not an address of this machine, a privileged port: bind tells no more
            break
        if taken is not None:
            warnings.append(f"{cfg.source}: {key}: local rank {local_rank} would serve port "
                            f"{base + local_rank} on {host or '0.0.0.0'}, which is in use now "
                            f"({taken}): that rank's endpoint will fail to start if it still is. "
                            f"Fix: stop that process or move the ranks' range "
                            f"{base}..{base + ranks_per_node - 1}")
    return warnings


def certificate_problems(cfg: MonitorConfig, prefix: str = SECTION) -> list[ConfigError]:
    """The endpoint's certificate and key files, unreadable ones (its web-config file is
    loaded by mfotel.checks, with the endpoint's own parser: config/ imports no endpoint)."""
    prom = cfg.prometheus
    if not prom.port:
        return []
    return [ConfigError(cfg.source, f"{prefix}.prometheus.{key}", f"{path} cannot be read",
                        "point it at a readable PEM file")
            for key in ("certfile", "keyfile")
            if (path := getattr(prom, key)) and not os.access(path, os.R_OK)]


def preflight(cfg: MonitorConfig, job_name: str, ranks_per_node: int, prefix: str = SECTION,
              world_size: int | None = None) -> tuple[list[ConfigError], list[str]]:
    """What would fail at start on this machine: unwritable outputs and the port plan."""
    errors, warnings = port_plan(cfg, ranks_per_node, prefix) if cfg.enable else ([], [])
    if not cfg.enable:
        return errors, warnings
    for key, path in output_paths(cfg, job_name):
        problem = writable_problem(path)
        if problem:
            errors.append(ConfigError(cfg.source, f"{prefix}.{key}", f"{problem} (checked for "
                                      "rank 0 on this machine)",
                                      "choose a writable path or fix the directory's permissions"))
    errors += certificate_problems(cfg, prefix)
    hosts = cfg.file_sd.hosts
    if world_size and hosts and cfg.file_sd.mode == "job" \
            and len(hosts) * ranks_per_node < world_size:
        errors.append(ConfigError(cfg.source, f"{prefix}.file_sd.hosts", f"{len(hosts)} hosts x "
                                  f"{ranks_per_node} ranks per node is fewer than the "
                                  f"{world_size} ranks of the job", "list every node once"))
    return errors, warnings
