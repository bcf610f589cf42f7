"""`mfotel check`: everything wrong with a training YAML, at once, before a run.

    report = check_file("train.yaml", ranks_per_node=8)
    report.errors      # one line each: file, key path, value, fix
    report.warnings
    report.config      # the effective settings (OTEL_* applied), when the document has them

A plain YAML's `monitor_config`, or a mindformers YAML (native `monitor_config`, the
OTelMonitor callback entry, CPU pitfalls: mfotel.integrations.mindformers_check, imported only
for such a file), then what would fail at start on this machine (writable outputs, the port
plan) and the OTEL_* environment.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import urlsplit

from .errors import ConfigError
from .keys import parse_config
from .otel_env import OTLP_PATH, resolve_otel_env
from .preflight import preflight
from .settings import SECTION, MonitorConfig
from .source import (callback_entries, config_from_document, entry_settings,
                     is_mindformers_document, read_yaml, safe_job_name)

#: Ranks per node assumed for the port plan when neither the command nor the launcher says.
ASSUMED_RANKS_PER_NODE = 8


@dataclass
class CheckReport:
    path: str
    where: str = SECTION                  # monitor_config, or callbacks[i] of a mindformers YAML
    config: MonitorConfig | None = None
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    sources: dict[str, str] = field(default_factory=dict)  # key path -> OTEL_* variable
    notes: list[str] = field(default_factory=list)


def _ranks_per_node(given: int | None, world_size: int | None) -> tuple[int, str]:
    if given:
        return given, "--ranks-per-node"
    from ..identity import identity_from_env  # lazily: identity imports config
    local_world = identity_from_env().local_world_size
    if local_world:
        return local_world, "the launcher's environment"
    assumed = min(world_size or ASSUMED_RANKS_PER_NODE, ASSUMED_RANKS_PER_NODE)
    return assumed, "assumed; set --ranks-per-node"


def _settings(document: Any, source: str, report: CheckReport,
              use_mindformers: bool | None) -> tuple[MonitorConfig | None, str]:
    """The document's monitor settings and where they are written; problems into `report`."""
    if isinstance(document, Mapping) and is_mindformers_document(document):
        from ..integrations.mindformers_check import mindformers_problems, _mindformers_installed
        if use_mindformers is None:
            use_mindformers = _mindformers_installed()
        report.errors += mindformers_problems(source, document, use_mindformers)
        entries = callback_entries(document)
        if not entries:
            return None, SECTION
        prefix = f"callbacks[{entries[0][0]}]"
        try:  # its problems are among mindformers_problems already
            return parse_config(entry_settings(entries[0][1]), source, prefix), prefix
        except ConfigError:
            return None, prefix
    try:
        return config_from_document(document, source), SECTION
    except ConfigError as exc:
        report.errors += [str(e) for e in exc.errors]
        return None, SECTION


def check_file(path: str | Path, ranks_per_node: int | None = None,
               world_size: int | None = None, use_mindformers: bool | None = None,
               env: Mapping[str, str] | None = None) -> CheckReport:
    """Every problem of `path` (see the module docstring); `env` defaults to os.environ."""
    report = CheckReport(str(path))
    try:
        document = read_yaml(path)
    except ConfigError as exc:
        report.errors.append(str(exc))
        return report
    cfg, prefix = _settings(document, str(path), report, use_mindformers)
    report.where = prefix
    if cfg is None:
        return report
    if cfg.job_name is None:
        stem = safe_job_name(Path(path).stem)
        cfg = cfg.with_job_name(stem) if stem else cfg
    resolved = resolve_otel_env(cfg, os.environ if env is None else env)
    report.config, report.sources = resolved.config, resolved.sources
    report.warnings += resolved.warnings
    ranks, why = _ranks_per_node(ranks_per_node, world_size)
    errors, warnings = preflight(resolved.config, resolved.config.job_name or "", ranks, prefix,
                                 world_size)
    report.errors += [str(e) for e in errors]
    report.warnings += warnings
    endpoint = resolved.config.otlp.endpoint
    if endpoint and not urlsplit(endpoint).path.rstrip("/").endswith(OTLP_PATH):
        report.warnings.append(f"{path}: {prefix}.otlp.endpoint: pushes to the path "
                               f"{urlsplit(endpoint).path!r} as written; an OpenTelemetry "
                               f"Collector listens on {OTLP_PATH} (give the base URL to get it)")
    port = resolved.config.prometheus.port
    report.notes.append(f"ports: the {ranks} ranks of a node serve {port}..{port + ranks - 1} "
                        f"({why})" if port else "ports: /metrics endpoint off (port 0)")
    if resolved.sdk_disabled:
        report.notes.append("OTEL_SDK_DISABLED=true: no /metrics endpoint and no OTLP push; "
                            "the [Monitor] lines are still written")
    return report
