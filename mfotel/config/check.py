"""Everything wrong with a training YAML's monitor settings, at once, before a run.

    report = check_file("train.yaml", ranks_per_node=8)
    report.errors      # one line each: file, key path, value, fix
    report.warnings
    report.config      # the effective settings (OTEL_* applied), when the document has them

A plain YAML's `monitor_config`, or a mindformers YAML's OTelMonitor callback entry, then what
would fail at start on this machine (writable outputs, the port plan) and the OTEL_*
environment. What needs more than config/ is composed by mfotel.checks (`mfotel check`): the
endpoint's web-config file, the launcher's ranks per node, and an integration's checks of the
whole document, passed in as `document_check`.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from .errors import ConfigError
from .keys import parse_config
from .otel_env import OTLP_PATH, resolve_otel_env
from .preflight import preflight
from .settings import SECTION, MonitorConfig
from .source import (
    callback_entries,
    config_from_document,
    entry_settings,
    is_mindformers_document,
    missing_entry_error,
    read_yaml,
    safe_job_name,
)

#: An integration's problems with a whole training document (source, document) -> lines,
#: e.g. mfotel.integrations.mindformers_check for a mindformers YAML. When given, it reports
#: the OTelMonitor entry's own problems too.
DocumentCheck = Callable[[str, Mapping[str, Any]], list[str]]


@dataclass
class CheckReport:
    path: str
    where: str = SECTION                  # monitor_config, or callbacks[i] of a mindformers YAML
    config: MonitorConfig | None = None
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    sources: dict[str, str] = field(default_factory=dict)  # key path -> OTEL_* variable
    notes: list[str] = field(default_factory=list)


def _entry_settings(document: Mapping[str, Any], source: str, report: CheckReport,
                    reported: bool) -> tuple[MonitorConfig | None, str]:
    """The OTelMonitor callback entry's settings; its problems into `report` unless
    `reported` (a document check named them already)."""
    entries = callback_entries(document)
    if not entries:
        if not reported:
            report.errors += [str(e) for e in missing_entry_error(document, source).errors]
        return None, SECTION
    prefix = f"callbacks[{entries[0][0]}]"
    try:
        return parse_config(entry_settings(entries[0][1]), source, prefix), prefix
    except ConfigError as exc:
        if not reported:
            report.errors += [str(e) for e in exc.errors]
        return None, prefix


def _settings(document: Any, source: str, report: CheckReport,
              document_check: DocumentCheck | None) -> tuple[MonitorConfig | None, str]:
    """The document's monitor settings and where they are written; problems into `report`."""
    if isinstance(document, Mapping) and is_mindformers_document(document):
        if document_check is not None:
            report.errors += document_check(source, document)
        return _entry_settings(document, source, report, reported=document_check is not None)
    try:
        return config_from_document(document, source), SECTION
    except ConfigError as exc:
        report.errors += [str(e) for e in exc.errors]
        return None, SECTION


def check_file(path: str | Path, ranks_per_node: int, ranks_source: str = "--ranks-per-node",
               world_size: int | None = None, env: Mapping[str, str] | None = None,
               document_check: DocumentCheck | None = None) -> CheckReport:
    """Every problem of `path` (see the module docstring); `env` defaults to os.environ.

    `ranks_source` says where `ranks_per_node` came from, for the port plan's note.
    """
    report = CheckReport(str(path))
    try:
        document = read_yaml(path)
    except ConfigError as exc:
        report.errors.append(str(exc))
        return report
    cfg, prefix = _settings(document, str(path), report, document_check)
    report.where = prefix
    if cfg is None:
        return report
    if cfg.job_name is None:
        stem = safe_job_name(Path(path).stem)
        cfg = cfg.with_job_name(stem) if stem else cfg
    resolved = resolve_otel_env(cfg, os.environ if env is None else env)
    report.config, report.sources = resolved.config, resolved.sources
    report.warnings += resolved.warnings
    errors, warnings = preflight(resolved.config, resolved.config.job_name or "", ranks_per_node,
                                 prefix, world_size)
    report.errors += [str(e) for e in errors]
    report.warnings += warnings
    endpoint = resolved.config.otlp.endpoint
    if endpoint and not urlsplit(endpoint).path.rstrip("/").endswith(OTLP_PATH):
        report.warnings.append(f"{path}: {prefix}.otlp.endpoint: pushes to the path "
                               f"{urlsplit(endpoint).path!r} as written; an OpenTelemetry "
                               f"Collector listens on {OTLP_PATH} (give the base URL to get it)")
    port = resolved.config.prometheus.port
    report.notes.append(f"ports: the {ranks_per_node} ranks of a node serve {port}.."
                        f"{port + ranks_per_node - 1} ({ranks_source})" if port
                        else "ports: /metrics endpoint off (port 0)")
    if resolved.sdk_disabled:
        report.notes.append("OTEL_SDK_DISABLED=true: no /metrics endpoint and no OTLP push; "
                            "the [Monitor] lines are still written")
    return report
