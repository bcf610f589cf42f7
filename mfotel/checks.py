"""The checks before a run, composed: the monitor settings (config/, a leaf), the endpoint's
web-config file loaded as the endpoint loads it, the launcher's ranks per node, and an
integration's checks of the whole document (passed in: the core imports no integration).

    report = check_file("train.yaml")                   # `mfotel check`, one file
    log_path = check_start(cfg, rank=0, job_name="job") # OTelMonitor, at construction

`mfotel check` passes mfotel.integrations.mindformers_check's `document_check` for a
mindformers YAML (native monitor_config, the callback entry, CPU pitfalls).
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from .config import ConfigError, MonitorConfig, check_writable
from .config import check as config_check
from .config.settings import SECTION
from .endpoint.webconfig import load_web_config
from .identity import identity_from_env

#: Ranks per node assumed for the port plan when neither the command nor the launcher says.
ASSUMED_RANKS_PER_NODE = 8


def ranks_per_node(given: int | None, world_size: int | None,
                   env: Mapping[str, str] | None = None) -> tuple[int, str]:
    """The ranks one node serves, and where that number comes from (for the port plan)."""
    if given:
        return given, "--ranks-per-node"
    local_world = identity_from_env(env).local_world_size
    if local_world:
        return local_world, "the launcher's environment"
    assumed = min(world_size or ASSUMED_RANKS_PER_NODE, ASSUMED_RANKS_PER_NODE)
    return assumed, "assumed; set --ranks-per-node"


def web_config_problems(cfg: MonitorConfig, prefix: str = SECTION) -> list[ConfigError]:
    """The endpoint's web-config file, loaded as the start loads it (a bad file would
    otherwise pass the check and stop the run at train begin)."""
    prom = cfg.prometheus
    if not (cfg.enable and prom.port and prom.web_config_file):
        return []
    try:
        load_web_config(prom.web_config_file)
    except ConfigError as exc:
        return [exc]
    return []


def check_file(path: str | Path, ranks: int | None = None, world_size: int | None = None,
               env: Mapping[str, str] | None = None,
               document_check: config_check.DocumentCheck | None = None
               ) -> config_check.CheckReport:
    """Every problem of the training YAML `path` that can be found before a run.

    `ranks`: ranks per node (default: the launcher's, else assumed); `env`: default os.environ;
    `document_check`: an integration's check of the whole document (mfotel.config.check).
    """
    count, source = ranks_per_node(ranks, world_size, env)
    report = config_check.check_file(path, count, source, world_size, env, document_check)
    if report.config is not None:
        report.errors += [str(e) for e in web_config_problems(report.config, report.where)]
    return report


def check_start(cfg: MonitorConfig, rank: int, job_name: str) -> Path | None:
    """What OTelMonitor checks at construction, before training: the file sink's directory
    (created) and the endpoint's web-config file. Raises ConfigError; the log path or None."""
    path = check_writable(cfg, rank, job_name)
    if cfg.prometheus.web_config_file:
        load_web_config(cfg.prometheus.web_config_file)
    return path
