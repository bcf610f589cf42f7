"""OpenTelemetry environment variables: explicit config key > OTEL_* variable > default.

    resolved = resolve_otel_env(cfg)   # reads os.environ
    resolved.config                    # the effective settings
    resolved.sources                   # {"otlp.endpoint": "OTEL_EXPORTER_OTLP_ENDPOINT", ...}
    resolved.warnings                  # invalid variables (ignored, as the spec says) and
                                       # variables a written key overrides, one line each

As the OTel SDK specification asks, a variable whose value cannot be used is warned about and
ignored; a key written in the YAML always wins over its variable, and says so (a copied block
must not switch the environment off without a word). `OTEL_METRICS_EXPORTER` selects the
exporters (`prometheus`: the /metrics endpoint, `otlp`: the push, `none`: neither);
`OTEL_SDK_DISABLED=true` turns off the OTel export (no /metrics endpoint, no OTLP push); the
`[Monitor]` lines stay either way.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import unquote, urlsplit

from .errors import ConfigError, did_you_mean, show
from .fields import Field
from .keys import JOB_NAME, OTLP, OTLP_ENDPOINT, PROMETHEUS
from .redact import MASK, is_secret_name, redact_url
from .settings import DEFAULT_JOB_NAME, MonitorConfig

ENV = "environment"
OTLP_PATH = "/v1/metrics"
#: The OTLP/HTTP exporter's default endpoint (OpenTelemetry's), for OTEL_METRICS_EXPORTER=otlp
#: without an endpoint anywhere.
DEFAULT_OTLP_ENDPOINT = "http://localhost:4318" + OTLP_PATH
#: (variable, config key(s) it sets, comma-separated; unit): docs/otel.md's table is this one.
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
    ("OTEL_METRICS_EXPORTER", "prometheus.port, otlp.endpoint",
     "none | prometheus | otlp | a comma list"),
    ("OTEL_SDK_DISABLED", "-", "true | false"),
)
#: OTEL_METRICS_EXPORTER's values mfotel honours; the specification's others it warns about.
EXPORTERS = ("none", "prometheus", "otlp")
SPEC_ONLY_EXPORTERS = ("console", "logging", "otlp/stdout")
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
            for variable in variables:
                text = self.env.get(variable, "").strip()
                if text:
                    self.overridden(variable, text, key)
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

    def overridden(self, variable: str, text: str, key: str) -> None:
        """One line: `variable` is set, but the key written in the config wins over it."""
        setting = _setting(self.cfg, key)
        self.warnings.append(
            f"{variable}={_variable_shown(variable, text)} is set but {self.cfg.prefix}.{key}: "
            f"{_written(setting, key)} ({self.cfg.source}) wins{_effect(key, setting)}. Fix: "
            f"remove {key} from {self.cfg.prefix} to let the variable through, or unset "
            f"{variable}")


def _setting(cfg: MonitorConfig, key: str) -> Any:
    value: Any = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def _written(value: Any, key: str) -> str:
    """A setting as YAML would show it, secrets masked."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, Mapping):
        secret = key == "otlp.headers"
        return "{" + ", ".join(f"{k}: {MASK if secret or is_secret_name(k) else v}"
                               for k, v in value.items()) + "}"
    text = redact_url(value) if isinstance(value, str) and "://" in value else str(value)
    return text if len(text) <= 200 else text[:199] + "…"


def _variable_shown(variable: str, text: str) -> str:
    """A variable's value as it may be printed: header values and URL passwords masked."""
    if variable.endswith("_HEADERS") or variable == "OTEL_RESOURCE_ATTRIBUTES":
        pairs, _ = parse_key_values(text, variable)
        return ",".join(f"{k}={MASK if variable.endswith('_HEADERS') or is_secret_name(k) else v}"
                        for k, v in pairs.items())
    return _written(text, variable)


def _effect(key: str, value: Any) -> str:
    """What the winning key does, for the keys that switch an export on or off."""
    if key == "otlp.endpoint":
        return ": the push is off" if value is None else \
            f": the push goes to {redact_url(metrics_url(value))}"
    if key == "prometheus.port":
        return ": the /metrics endpoint is off" if not value else \
            f": the ranks serve port {value} + local rank"
    return ""


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
    if env_service and "job_name" in cfg.given:
        r.overridden("OTEL_RESOURCE_ATTRIBUTES", f"service.name={env_service}", "job_name")
    elif job_name is None and env_service:
        job_name = r.value("job_name", ("OTEL_RESOURCE_ATTRIBUTES",), JOB_NAME,
                           lambda _: env_service)
    changes: dict[str, Any] = {"job_name": job_name or cfg.job_name or default_job_name}
    if attributes:
        changes["resource_attributes"] = {**attributes, **cfg.resource_attributes}
        r.sources["resource_attributes"] = "OTEL_RESOURCE_ATTRIBUTES"
        for name in (k for k in attributes if k in cfg.resource_attributes):
            secret = is_secret_name(name)
            env_value = MASK if secret else attributes[name]
            written = MASK if secret else _written(cfg.resource_attributes[name], name)
            r.warnings.append(
                f"OTEL_RESOURCE_ATTRIBUTES sets {name}={env_value} but {cfg.prefix}."
                f"resource_attributes.{name}: {written} ({cfg.source}) wins. Fix: remove "
                f"{name} from resource_attributes to let the variable through")

    host = r.value("prometheus.host", ("OTEL_EXPORTER_PROMETHEUS_HOST",),
                   PROMETHEUS.keys["host"])
    port = r.value("prometheus.port", ("OTEL_EXPORTER_PROMETHEUS_PORT",),
                   PROMETHEUS.keys["port"], _port)
    prom = {k: v for k, v in (("host", host), ("port", port)) if v is not None}
    otlp = _otlp(r)
    if prom:
        changes["prometheus"] = replace(cfg.prometheus, **prom)
    if otlp:
        changes["otlp"] = replace(cfg.otlp, **otlp)
    effective = replace(cfg, **changes)
    disabled = _sdk_disabled(env, r.warnings)
    if not disabled:
        effective = _select_exporters(r, effective)
    if effective.otlp.endpoint:
        effective = replace(effective, otlp=replace(effective.otlp,
                                                    endpoint=metrics_url(effective.otlp.endpoint)))
        r.warnings += _protocol_warnings(env)
    if disabled:
        effective = replace(effective, prometheus=replace(effective.prometheus, port=0),
                            otlp=replace(effective.otlp, endpoint=None))
        r.sources["prometheus.port"] = r.sources["otlp.endpoint"] = "OTEL_SDK_DISABLED"
    return Resolved(effective, r.sources, r.warnings, disabled)


def exporters_selected(env: Mapping[str, str], warnings: list[str]) -> frozenset[str] | None:
    """OTEL_METRICS_EXPORTER's usable values (an empty set for `none`), or None when it is
    unset or nothing in it is usable; the rest is warned about and ignored (the spec's enum
    rule). `none` with other exporters is ignored: it means no exporter at all."""
    variable = "OTEL_METRICS_EXPORTER"
    names = list(dict.fromkeys(part.strip().lower()
                               for part in env.get(variable, "").split(",") if part.strip()))
    usable = [name for name in names if name in EXPORTERS]
    for name in names:
        if name in SPEC_ONLY_EXPORTERS:
            warnings.append(f"{ENV}: {variable}: {show(name)} is an OpenTelemetry exporter "
                            f"mfotel does not offer (its console output is the [Monitor] "
                            f"lines); ignored. Fix: use prometheus, otlp or none")
        elif name not in EXPORTERS:
            warnings.append(f"{ENV}: {variable}: unknown exporter {show(name)}"
                            f"{did_you_mean(name, EXPORTERS)}; ignored, as OpenTelemetry "
                            f"specifies for unknown values. Fix: use prometheus, otlp, "
                            f"prometheus,otlp or none")
    if "none" in usable and len(usable) > 1:
        warnings.append(f"{ENV}: {variable}: 'none' together with other exporters; 'none' is "
                        f"ignored. Fix: write none alone, or only the exporters you want")
        usable.remove("none")
    if not usable:
        return None
    return frozenset(usable) - {"none"}


def _select_exporters(r: _Resolver, effective: MonitorConfig) -> MonitorConfig:
    """`effective` with OTEL_METRICS_EXPORTER applied under the keys written in the config:
    `prometheus` keeps the /metrics endpoint, `otlp` the push (to the OTLP default endpoint
    when none is set anywhere), an exporter not listed is off."""
    variable = "OTEL_METRICS_EXPORTER"
    selected = exporters_selected(r.env, r.warnings)
    if selected is None:
        return effective
    shown = ",".join(sorted(selected)) or "none"
    given = r.cfg.given
    prom, otlp = effective.prometheus, effective.otlp
    serves = bool(prom.port)
    if serves != ("prometheus" in selected):
        if "prometheus.port" in given:
            r.overridden(variable, shown, "prometheus.port")
        else:
            if not serves:  # the endpoint is off by the environment (port 0): nothing to use
                r.warnings.append(f"{ENV}: {variable}={shown} selects prometheus but "
                                  f"{r.sources.get('prometheus.port')}=0 turns the endpoint "
                                  f"off. Fix: unset one of them")
            else:
                prom = replace(prom, port=0)
                r.sources["prometheus.port"] = variable
                _unused(r, ("OTEL_EXPORTER_PROMETHEUS_PORT", "OTEL_EXPORTER_PROMETHEUS_HOST"),
                        shown, "prometheus")
    pushes = bool(otlp.endpoint)
    if pushes != ("otlp" in selected):
        if "otlp.endpoint" in given:
            r.overridden(variable, shown, "otlp.endpoint")
        elif pushes:
            otlp = replace(otlp, endpoint=None)
            _unused(r, ("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"),
                    shown, "otlp")
            r.sources["otlp.endpoint"] = variable
        else:
            otlp = replace(otlp, endpoint=DEFAULT_OTLP_ENDPOINT)
            r.sources["otlp.endpoint"] = variable
    return replace(effective, prometheus=prom, otlp=otlp)


def _unused(r: _Resolver, variables: tuple[str, ...], shown: str, exporter: str) -> None:
    """Variables of an exporter OTEL_METRICS_EXPORTER leaves out: said, then ignored."""
    for name in variables:
        text = r.env.get(name, "").strip()
        if text:
            r.warnings.append(f"{ENV}: {name}={_variable_shown(name, text)} is set but "
                              f"OTEL_METRICS_EXPORTER={shown} does not select {exporter}; "
                              f"ignored. Fix: add {exporter} to OTEL_METRICS_EXPORTER or "
                              f"unset {name}")


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
    for variable in ("OTEL_EXPORTER_OTLP_METRICS_HEADERS", "OTEL_EXPORTER_OTLP_HEADERS"):
        text = r.env.get(variable, "").strip()
        if text and "otlp.headers" in r.cfg.given:
            r.overridden(variable, text, "otlp.headers")
        elif text:
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
