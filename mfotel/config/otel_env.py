"""OpenTelemetry environment variables: explicit config key > OTEL_* variable > default.

    resolved = resolve_otel_env(cfg)          # reads os.environ
    resolved.config                           # the effective settings
    resolved.sources                          # {"otlp.endpoint": "OTEL_EXPORTER_OTLP_ENDPOINT", ...}
    resolved.warnings                         # invalid variables, ignored (as the spec says)

As the OTel SDK specification asks, a variable whose value cannot be used is warned about and
ignored; a key written in the YAML always wins over its variable. `OTEL_SDK_DISABLED=true`
turns off the OTel export (no /metrics endpoint, no OTLP push); the `[Monitor]` lines stay.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping
from urllib.parse import unquote, urlsplit

from .errors import ConfigError, show
from .fields import Field
from .keys import JOB_NAME, OTLP, OTLP_ENDPOINT, PROMETHEUS
from .redact import redact_url
from .settings import DEFAULT_JOB_NAME, MonitorConfig

ENV = "environment"
OTLP_PATH = "/v1/metrics"
#: (variable, config key it sets, unit): the README's table is this one.
VARIABLES: tuple[tuple[str, str, str], ...] = (
    ("OTEL_SERVICE_NAME", "job_name", "text"),
    ("OTEL_RESOURCE_ATTRIBUTES", "resource_attributes", "k=v,k2=v2 (URL-encoded)"),
    ("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "otlp.endpoint", "URL, used as is"),
    ("OTEL_EXPORTER_OTLP_ENDPOINT", "otlp.endpoint", "base URL, /v1/metrics appended"),
    ("OTEL_EXPORTER_OTLP_METRICS_HEADERS", "otlp.headers", "k=v,k2=v2 (URL-encoded)"),
    ("OTEL_EXPORTER_OTLP_HEADERS", "otlp.headers", "k=v,k2=v2 (URL-encoded)"),
    ("OTEL_EXPORTER_OTLP_METRICS_TIMEOUT", "otlp.timeout_seconds", "milliseconds"),
    ("OTEL_EXPORTER_OTLP_TIMEOUT", "otlp.timeout_seconds", "milliseconds"),
    ("OTEL_METRIC_EXPORT_TIMEOUT", "otlp.timeout_seconds", "milliseconds"),
    ("OTEL_METRIC_EXPORT_INTERVAL", "otlp.interval_seconds", "milliseconds"),
    ("OTEL_EXPORTER_PROMETHEUS_HOST", "prometheus.host", "address"),
    ("OTEL_EXPORTER_PROMETHEUS_PORT", "prometheus.port", "port (rank serves port + local rank)"),
    ("OTEL_SDK_DISABLED", "-", "true | false"),
)
PROTOCOL_VARS = ("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")


@dataclass(frozen=True)
class Resolved:
    config: MonitorConfig
    sources: dict[str, str] = field(default_factory=dict)   # key path -> variable
    warnings: list[str] = field(default_factory=list)
    sdk_disabled: bool = False


def metrics_url(endpoint: str) -> str:
    """The URL pushed to: a base URL (no path) gets /v1/metrics, a URL with a path is kept."""
    parts = urlsplit(endpoint)
    if parts.path in ("", "/"):
        return parts._replace(path=OTLP_PATH).geturl()
    return endpoint


def signal_url(base: str) -> str:
    """OTEL_EXPORTER_OTLP_ENDPOINT's rule: /v1/metrics appended to the base URL's path."""
    parts = urlsplit(base)
    return parts._replace(path=parts.path.rstrip("/") + OTLP_PATH).geturl()


def parse_key_values(text: str, variable: str) -> tuple[dict[str, str], list[str]]:
    """`k=v,k2=v2` (W3C baggage style, values URL-encoded) -> mapping, and the bad entries.

    Written here rather than taken from opentelemetry.util.re because that parser logs the
    entries it rejects verbatim, header values (tokens) included.
    """
    pairs, bad = {}, []
    for index, item in enumerate(text.split(",")):
        if not item.strip():
            continue
        name, sep, value = item.partition("=")
        name = unquote(name).strip()
        if not sep or not name:
            bad.append(f"{ENV}: {variable}: entry {index + 1} is not name=value (ignored). "
                       f"Fix: write {variable}=name1=value1,name2=value2")
            continue
        pairs[name] = unquote(value).strip()
    return pairs, bad


class _Resolver:
    """One resolution: which key each variable set, and what was wrong with the others."""

    def __init__(self, cfg: MonitorConfig, env: Mapping[str, str]) -> None:
        self.cfg, self.env = cfg, env
        self.sources: dict[str, str] = {}
        self.warnings: list[str] = []

    def value(self, key: str, variables: tuple[str, ...], check: Field,
              convert: Callable[[str], Any] = lambda text: text) -> Any:
        """The first usable variable's value for `key` (None when the key is given, or none is
        set); unusable variables are warned about and skipped."""
        if key in self.cfg.given:
            return None
        for variable in variables:
            text = self.env.get(variable, "").strip()
            if not text:
                continue
            try:
                value = check.check(convert(text), ENV, variable)
            except (ConfigError, ValueError) as exc:
                problem = exc.problem if isinstance(exc, ConfigError) else \
                    f"{show(redact_url(text))} cannot be read"
                self.warnings.append(f"{ENV}: {variable}: {problem}; ignored, as OpenTelemetry "
                                     f"specifies for invalid values. Fix: unset it or correct it "
                                     f"({key} in the YAML wins over it)")
                continue
            self.sources[key] = variable
            return value
        return None


def _milliseconds(text: str) -> float:
    return float(text) / 1000.0


def resolve_otel_env(cfg: MonitorConfig, env: Mapping[str, str] | None = None,
                     default_job_name: str = DEFAULT_JOB_NAME) -> Resolved:
    """The effective settings: explicit keys of `cfg`, then OTEL_* variables, then defaults."""
    env = os.environ if env is None else env
    r = _Resolver(cfg, env)
    attributes, bad = parse_key_values(env.get("OTEL_RESOURCE_ATTRIBUTES", ""),
                                       "OTEL_RESOURCE_ATTRIBUTES")
    r.warnings += bad
    env_service = attributes.pop("service.name", None)
    job_name = r.value("job_name", ("OTEL_SERVICE_NAME",), JOB_NAME)
    if job_name is None and env_service and "job_name" not in cfg.given:
        job_name = r.value("job_name", ("OTEL_RESOURCE_ATTRIBUTES",), JOB_NAME,
                           lambda _: env_service)
    changes: dict[str, Any] = {"job_name": job_name or cfg.job_name or default_job_name}
    if attributes:
        changes["resource_attributes"] = {**attributes, **cfg.resource_attributes}
        r.sources["resource_attributes"] = "OTEL_RESOURCE_ATTRIBUTES"

    prom = {k: v for k, v in (
        ("host", r.value("prometheus.host", ("OTEL_EXPORTER_PROMETHEUS_HOST",), PROMETHEUS.keys["host"])),
        ("port", r.value("prometheus.port", ("OTEL_EXPORTER_PROMETHEUS_PORT",), PROMETHEUS.keys["port"],
                         _port))) if v is not None}
    otlp = _otlp(r)
    if prom:
        changes["prometheus"] = replace(cfg.prometheus, **prom)
    if otlp:
        changes["otlp"] = replace(cfg.otlp, **otlp)
    effective = replace(cfg, **changes)
    if effective.otlp.endpoint:
        effective = replace(effective, otlp=replace(effective.otlp,
                                                    endpoint=metrics_url(effective.otlp.endpoint)))
        r.warnings += _protocol_warnings(env)
    disabled = _sdk_disabled(env, r.warnings)
    if disabled:
        effective = replace(effective, prometheus=replace(effective.prometheus, port=0),
                            otlp=replace(effective.otlp, endpoint=None))
        r.sources["prometheus.port"] = r.sources["otlp.endpoint"] = "OTEL_SDK_DISABLED"
    return Resolved(effective, r.sources, r.warnings, disabled)


def _port(text: str) -> int:
    if not (text.isascii() and text.isdigit()):
        raise ValueError(text)
    return int(text)


def _otlp(r: _Resolver) -> dict[str, Any]:
    keys = OTLP.keys
    out = {
        "endpoint": r.value("otlp.endpoint", ("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",),
                            keys["endpoint"]) or
        r.value("otlp.endpoint", ("OTEL_EXPORTER_OTLP_ENDPOINT",), OTLP_ENDPOINT, _generic_url),
        "timeout_seconds": r.value("otlp.timeout_seconds", (
            "OTEL_EXPORTER_OTLP_METRICS_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT",
            "OTEL_METRIC_EXPORT_TIMEOUT"), keys["timeout_seconds"], _milliseconds),
        "interval_seconds": r.value("otlp.interval_seconds", ("OTEL_METRIC_EXPORT_INTERVAL",),
                                    keys["interval_seconds"], _milliseconds),
    }
    headers = _headers(r)
    if headers is not None:
        out["headers"] = headers
    return {k: v for k, v in out.items() if v is not None}


def _generic_url(text: str) -> str:
    OTLP_ENDPOINT.check(text, ENV, "OTEL_EXPORTER_OTLP_ENDPOINT")  # the base must be a URL
    return signal_url(text)


def _headers(r: _Resolver) -> dict[str, str] | None:
    if "otlp.headers" in r.cfg.given:
        return None
    for variable in ("OTEL_EXPORTER_OTLP_METRICS_HEADERS", "OTEL_EXPORTER_OTLP_HEADERS"):
        text = r.env.get(variable, "").strip()
        if text:
            headers, bad = parse_key_values(text, variable)
            r.warnings += bad
            r.sources["otlp.headers"] = variable
            return headers
    return None


def _protocol_warnings(env: Mapping[str, str]) -> list[str]:
    for variable in PROTOCOL_VARS:
        protocol = env.get(variable, "").strip()
        if protocol:
            if protocol != "http/protobuf":
                return [f"{ENV}: {variable}: {show(protocol)}: mfotel pushes OTLP over "
                        f"http/protobuf only. Fix: set it to http/protobuf and point "
                        f"otlp.endpoint at the collector's HTTP port (4318)"]
            return []
    return []


def _sdk_disabled(env: Mapping[str, str], warnings: list[str]) -> bool:
    value = env.get("OTEL_SDK_DISABLED", "").strip().lower()
    if value not in ("", "true", "false"):
        warnings.append(f"{ENV}: OTEL_SDK_DISABLED: {show(value)} is neither true nor false; "
                        f"ignored (the SDK stays on). Fix: write true or false")
    return value == "true"


def disabled_notice(resolved: Resolved) -> str | None:
    """The one log line saying what OTEL_SDK_DISABLED turned off, when it did."""
    if not resolved.sdk_disabled:
        return None
    return ("mfotel: OTEL_SDK_DISABLED=true: no OpenTelemetry export (no /metrics endpoint, no "
            "OTLP push); the [Monitor] console/file lines are still written")
