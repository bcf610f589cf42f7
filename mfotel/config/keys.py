"""The keys of `monitor_config`: one declaration per key gives the validator and the JSON Schema.

    cfg = parse_config({"step_interval": 50})   # the block, or the callback's keyword arguments
    schema = json_schema("plain")               # what `mfotel schema` prints

Every problem of a block is reported at once: one ConfigError, one line per problem, each
naming the source, the key path, the bad value and the fix.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields, replace
from typing import Any

from ..contract import SEED_METRICS
from .errors import ConfigError, show
from .fields import (
    DAY_SECONDS,
    Bool,
    Choice,
    Constraint,
    FilePath,
    Int,
    ListOf,
    Number,
    Optional,
    Ranks,
    Section,
    StringMap,
    Template,
    Text,
    Url,
)
from .redact import redact_headers, redact_named, redact_url
from .settings import (
    ACTIONS,
    CARDINALITY_LEVELS,
    FILE_SD_MODES,
    NATIVE_MONITOR_KEYS,
    SECTION,
    ActionsConfig,
    FileSdConfig,
    MonitorConfig,
    NonfiniteRule,
    OtlpConfig,
    OutputConfig,
    PlateauRule,
    PrometheusConfig,
    RunConfig,
)

#: Job names are Prometheus label values and parts of file names: a safe, short set.
JOB_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
JOB_NAME_RULE = ("letters, digits, '.', '_' and '-', starting with a letter or digit, at most "
                 "128 characters (it is a label value and part of file names)")
JOB_NAME = Text(JOB_NAME_PATTERN, max_length=128, what="a safe job name", rule=JOB_NAME_RULE,
                example="llama7b-sft",
                doc="job_name label of every series and OTel service.name (default: the "
                    "YAML file's stem, else OTEL_SERVICE_NAME, else mindformers)")
#: Labels every series or target already has: a user label of that name would clash.
RESERVED_TARGET_LABELS = ("job_name", "rank", "job", "instance")
#: Bounds the run can live with, each with its reason (shown in `mfotel schema`).
#: OTLP pushes: each holds the GIL while it collects and encodes (MindSpore needs the
#: pure-Python protobuf); measured with benchmarks/otlp_interval.py on the demo network:
#: interval 0.1 s 1.1-1.4x slower, 0.01 s 3x, 0.001 s 5-8x; timeouts of 1-10 ms fail pushes
#: to a collector on loopback, and a remote one needs a TCP + TLS handshake.
MIN_PUSH_INTERVAL_SECONDS = 1.0
MIN_PUSH_TIMEOUT_SECONDS = 1.0
#: A TLS handshake and request head over a loaded network can take this long.
MIN_REQUEST_TIMEOUT_SECONDS = 1.0
#: Retry-After is 1 / rate: a lower rate would lock a user who mistyped out for > 100 s.
MIN_AUTH_FAILURES_PER_SECOND = 0.01
#: Learning-rate multipliers: below 1e-6 the rate is as good as zero (float32 underflows
#: with it), above 100 a run diverges at once. `mfotel control --scale-lr` uses the same bounds.
LR_FACTOR_RANGE = (1e-6, 100.0)
#: Steps between a decision and its application: more would delay a stop past the run.
MAX_LEAD_STEPS = 100_000
OTLP_ENDPOINT = Url(refuse=((r"/v1/(?:traces|logs)/?$", "is a collector's traces or logs path"),),
                    example="http://collector:4318",
                    doc="OTLP/HTTP collector: a base URL gets /v1/metrics appended, a URL with "
                        "a path is used as is")


# ---------------------------------------------------------------- rules across keys
def _tls_pair(prom: PrometheusConfig, raw: Mapping[str, Any], source: str, key: str) -> None:
    if bool(prom.certfile) != bool(prom.keyfile):
        given, missing = ("certfile", "keyfile") if prom.certfile else ("keyfile", "certfile")
        raise ConfigError(source, f"{key}.{missing}", f"{given} given without {missing}",
                          "set both certfile and keyfile for TLS, or neither")


def _both_strings(a: str, b: str) -> dict[str, Any]:
    return {"if": {"required": [a], "properties": {a: {"type": "string"}}},
            "then": {"required": [b], "properties": {b: {"type": "string"}}}}


TLS_PAIR = Constraint(_tls_pair, {"allOf": [_both_strings("certfile", "keyfile"),
                                            _both_strings("keyfile", "certfile")]})


def _factor_needs_scale_lr(rule: NonfiniteRule, raw: Mapping[str, Any], source: str,
                           key: str) -> None:
    if "factor" in raw and rule.action != "scale_lr":
        raise ConfigError(source, f"{key}.factor", f"factor is ignored by action: {rule.action}",
                          "set action: scale_lr, or remove factor")


FACTOR_NEEDS_SCALE_LR = Constraint(_factor_needs_scale_lr, {"dependentSchemas": {"factor": {
    "required": ["action"], "properties": {"action": {"const": "scale_lr"}}}}})


def _rank_mode_needs_rank_path(sd: FileSdConfig, raw: Mapping[str, Any], source: str,
                               key: str) -> None:
    if sd.mode == "rank" and sd.path and "{rank}" not in sd.path:
        raise ConfigError(source, f"{key}.path", "mode: rank needs {rank} in the path, else "
                          "the ranks overwrite one file",
                          'add {rank}, e.g. path: "/shared/targets/{job_name}-{rank}.json"')


def _rank_mode_has_no_hosts(sd: FileSdConfig, raw: Mapping[str, Any], source: str,
                            key: str) -> None:
    if sd.mode == "rank" and sd.hosts:
        raise ConfigError(source, f"{key}.hosts", "hosts is only used by mode: job",
                          "remove hosts, or use mode: job")


_RANK_MODE = {"required": ["mode"], "properties": {"mode": {"const": "rank"}}}
FILE_SD_RULES = (
    Constraint(_rank_mode_needs_rank_path, {
        "if": {"required": ["mode", "path"], "properties": {"mode": {"const": "rank"},
                                                            "path": {"type": "string"}}},
        "then": {"properties": {"path": {"pattern": r"\{rank\}"}}}}),
    Constraint(_rank_mode_has_no_hosts, {"if": _RANK_MODE, "then": {
        "properties": {"hosts": {"type": "array", "maxItems": 0}}}}),
)


def _one_nonfinite_policy(cfg: MonitorConfig, raw: Mapping[str, Any], source: str,
                          key: str) -> None:
    if cfg.on_nonfinite == "stop" and cfg.actions.nonfinite is not None:
        raise ConfigError(source, f"{key}.on_nonfinite", "on_nonfinite: stop and "
                          "actions.nonfinite both say what to do on a NaN loss",
                          "keep actions.nonfinite (action: stop is the same) and remove "
                          "on_nonfinite")


ONE_NONFINITE_POLICY = Constraint(_one_nonfinite_policy, {"not": {
    "required": ["on_nonfinite", "actions"],
    "properties": {"on_nonfinite": {"const": "stop"},
                   "actions": {"type": "object", "required": ["nonfinite"],
                               "properties": {"nonfinite": {"type": "object"}}}}}})


# ---------------------------------------------------------------- the keys
def _rule(cls: type, extra: Mapping[str, Any], doc: str) -> Optional:
    low, high = LR_FACTOR_RANGE
    keys = {"action": Choice(choices=ACTIONS, doc="stop | scale_lr | warn"),
            "factor": Number(low, high, example=0.5,
                             doc="learning-rate multiplier, for action: scale_lr",
                             why=f"{low:g} to {high:g}: below, the rate is as good as zero; "
                                 f"above, the run diverges"), **extra}
    return Optional(inner=Section(cls=cls, keys=keys, constraints=(FACTOR_NEEDS_SCALE_LR,),
                                  nullable=False), doc=doc)


OUTPUT = Section(cls=OutputConfig, doc="where the [Monitor] lines go", keys={
    "console": Bool(doc="print [Monitor] lines"),
    "file": Bool(doc="also write them to file_path"),
    "file_path": Template(example="./monitor_logs/train_{rank}.log",
                          doc="relative to the working directory; {rank}, {job_name} allowed"),
    "format": Choice(choices=("text", "json"), doc="text (the console line) or json lines"),
})
PROMETHEUS = Section(cls=PrometheusConfig, constraints=(TLS_PAIR,), doc="the /metrics endpoint",
                     keys={
    "host": Text(example="127.0.0.1", doc="bind address (OTEL_EXPORTER_PROMETHEUS_HOST)"),
    "port": Int(0, 65535, example=9464, doc="this rank serves port + local rank; 0 turns the "
                                            "endpoint off (OTEL_EXPORTER_PROMETHEUS_PORT)"),
    "node_port": Optional(inner=Int(0, 65535, example=9463),
                          doc="mfotel-instrument's node endpoint (each rank's process state, "
                              "exit cause, CPU, memory); null: port - 1 (9463); 0 turns it off"),
    "linger_seconds": Number(
        0.0, DAY_SECONDS, unit="seconds", example=30,
        doc="after the end, keep /metrics up until scraped, at most this long"),
    "linger_until_scraped": Bool(doc="false: always wait the full linger (HA Prometheus pairs)"),
    "certfile": Optional(inner=FilePath(example="server.crt"),
                         doc="TLS certificate (with keyfile)"),
    "keyfile": Optional(inner=FilePath(example="server.key"),
                        doc="TLS private key (with certfile)"),
    "web_config_file": Optional(inner=FilePath(example="web.yml"),
                                doc="Prometheus web-config file: TLS and basic auth"),
    "max_connections": Int(1, 10000, example=100,
                           doc="open connections at most; the oldest idle one makes room"),
    "request_timeout_seconds": Number(MIN_REQUEST_TIMEOUT_SECONDS, 3600.0, unit="seconds",
                                      example=10, doc="TLS handshake + request head, and the "
                                      "response", why="at least 1 s: a handshake over a loaded "
                                      "network can take that long"),
    "auth_failures_per_second": Number(MIN_AUTH_FAILURES_PER_SECOND, 1000.0, example=1,
                                       doc="failed basic-auth attempts per client, then 429",
                                       why="at least 0.01: Retry-After is 1/rate, and a lower "
                                           "rate locks out a user who mistyped for over 100 s"),
    "ui": Bool(doc="serve the live page (/) on the same port, behind the same TLS and auth"),
    "ui_history_points": Int(16, 1_000_000, example=10000,
                             doc="points of each metric the live page keeps (48 bytes per "
                                 "point); a longer run is thinned evenly, never cut"),
    "ui_overview_rank": Optional(inner=Int(0, example=0),
                                 doc="the rank whose live page shows every rank; null: none"),
})
OTLP = Section(cls=OtlpConfig, doc="push to an OpenTelemetry Collector (OTLP/HTTP)", keys={
    "endpoint": Optional(inner=OTLP_ENDPOINT, doc=OTLP_ENDPOINT.doc),
    "interval_seconds": Number(MIN_PUSH_INTERVAL_SECONDS, DAY_SECONDS, unit="seconds",
                               example=10, doc="push interval (OTEL_METRIC_EXPORT_INTERVAL)",
                               why="at least 1 s: a push holds the training process's GIL while "
                                   "it encodes; every 0.1 s the demo trains 1.1-1.4x slower, "
                                   "every 0.01 s 3x"),
    "timeout_seconds": Number(MIN_PUSH_TIMEOUT_SECONDS, 3600.0, unit="seconds", example=5,
                              doc="timeout of a push (OTEL_EXPORTER_OTLP_TIMEOUT)",
                              why="at least 1 s: shorter ones fail pushes a collector answers "
                                  "(1-10 ms fail on loopback; a remote one needs TCP and TLS "
                                  "handshakes)"),
    "headers": StringMap(secret=True,
                         doc="HTTP headers, e.g. authorization (OTEL_EXPORTER_OTLP_HEADERS)"),
})
ACTIONS_SECTION = Section(cls=ActionsConfig, doc="monitor-driven actions", keys={
    "plateau": _rule(PlateauRule, {
        "patience": Int(1, example=10, doc="records without improvement"),
        "min_delta": Number(0.0, 1e12, example=0.001, doc="smallest loss decrease that counts"),
    }, doc="act when the loss stops improving"),
    "nonfinite": _rule(NonfiniteRule, {}, doc="act when the loss first goes NaN/Inf"),
    "control_dir": Optional(inner=Template(allowed=("job_name",), example="/shared/ctl/{job_name}"),
                            doc="the job's control directory; {job_name} is filled in"),
    "lead_steps": Int(1, MAX_LEAD_STEPS, example=3,
                      doc="steps between a decision and its application",
                      why="at most 100000: more would delay a stop past the run"),
})
FILE_SD = Section(cls=FileSdConfig, constraints=FILE_SD_RULES,
                  doc="write a Prometheus file_sd target file", keys={
    "path": Optional(inner=Template(example="/shared/targets/{job_name}.json"),
                     doc="{job_name}, {rank} allowed; null writes no file"),
    "mode": Choice(choices=FILE_SD_MODES, doc="job: rank 0 lists every rank; rank: each its own"),
    "hosts": ListOf(item=Text(example="node-1"), comma=True, empty=True,
                    fix="list the nodes in node-rank order, e.g. hosts: [node-1, node-2]",
                    doc="node addresses in node-rank order"),
    "labels": StringMap(reserved=RESERVED_TARGET_LABELS,
                        reason="every series already carries job_name and rank, and "
                               "Prometheus sets job and instance", doc="extra target labels"),
})
RUN = Section(cls=RunConfig, doc="run identity across restarts", keys={
    "id": Optional(inner=Text(example="run-42"), doc="default: $MFOTEL_RUN_ID, else new"),
    "state_file": Optional(inner=Template(example="./run_state_{rank}.json"),
                           doc="keeps id and attempt across restarts"),
})

ALIASES = {"monitor_on": "enable", "interval": "step_interval"}
MONITOR = Section(cls=MonitorConfig, aliases=ALIASES, constraints=(ONE_NONFINITE_POLICY,),
                  nullable=False, keys={
    "enable": Bool(doc="turn the monitor on (alias: monitor_on)"),
    "step_interval": Int(1, example=50,
                         doc="record the seed metrics every N steps (alias: interval)"),
    "metrics": ListOf(item=Choice(choices=SEED_METRICS, noun="metric"), comma=True,
                      fix=f"list some of {', '.join(SEED_METRICS)}, "
                          "e.g. metrics: [loss, learning_rate]",
                      doc="seed metrics to record"),
    "output": OUTPUT,
    "log_rank": Ranks(every=True,
                      fix="use a rank (0), a list of ranks ([0, 8]) or -1 for every rank",
                      doc="a rank, a list of ranks, or -1 for every rank"),
    "job_name": Optional(inner=JOB_NAME, doc=JOB_NAME.doc),
    "prometheus": PROMETHEUS,
    "on_nonfinite": Choice(choices=("warn", "stop"), doc="stop: request_stop after a NaN loss"),
    "resource_attributes": StringMap(
        reserved=("service.name",), reason="service.name is the job name",
        doc="extra OTel resource attributes (OTEL_RESOURCE_ATTRIBUTES)"),
    "otlp": OTLP,
    "early_steps": Int(0, example=100,
                       doc="record every early_step_interval steps for the first N"),
    "alertmanager_url": Optional(inner=Url(example="http://alertmanager:9093"),
                                 doc="fast path: post a NaN-loss alert straight to Alertmanager"),
    "early_step_interval": Int(1, example=1, doc="record interval during early_steps"),
    "batch_size": Optional(inner=Int(1, example=8), doc="samples per step on this rank"),
    "seq_length": Optional(inner=Int(1, example=2048), doc="tokens per sample (tokens_total)"),
    "flops_per_token": Optional(inner=Number(1.0, 1e18, example=4.6e10),
                                doc="model FLOPs per training token (mindformers: estimated)",
                                why="at least 1, so that the MFU stays finite"),
    "peak_flops": Optional(inner=Number(1.0, 1e21, example=3.0e14),
                           doc="peak FLOP/s of one device: enables the MFU gauge",
                           why="at least 1: a tinier peak makes the MFU overflow to infinity"),
    "native_series_limit": Int(1, 1_000_000, example=20000,
                               doc="series per mindformers-native metric"),
    "actions": ACTIONS_SECTION,
    "file_sd": FILE_SD,
    "cardinality": Choice(choices=CARDINALITY_LEVELS, doc="full | health (for thousands of ranks)"),
    "metric_ranks": Optional(inner=Ranks(fix="use a rank (0) or a list of ranks ([0, 8]); for "
                                             "every rank use cardinality: full"),
                             doc="ranks exporting seed metrics at cardinality: health"),
    "run": RUN,
})
KNOWN_KEYS: tuple[str, ...] = (*MONITOR.keys, *ALIASES)
SECTIONS = {name: f for name, f in MONITOR.keys.items() if isinstance(f, Section)}


# ---------------------------------------------------------------- parsing
def given_keys(data: Mapping[str, Any]) -> frozenset[str]:
    """Key paths written in `data` ("job_name", "otlp", "otlp.endpoint", ...), aliases resolved."""
    given = set()
    for raw, value in data.items():
        name = ALIASES.get(str(raw), str(raw))
        given.add(name)
        if name in SECTIONS and isinstance(value, Mapping):
            given.update(f"{name}.{key}" for key in value)
    return frozenset(given)


def parse_config(data: Mapping[str, Any] | None, source: str = "<kwargs>",
                 prefix: str = SECTION) -> MonitorConfig:
    """Validate one `monitor_config` mapping (or the callback's kwargs); every problem at once."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(source, prefix, f"{show(data)} is not a mapping",
                          "indent the monitor keys under monitor_config as key: value pairs")
    cfg: MonitorConfig = MONITOR.check(data, source, prefix)
    return replace(cfg, source=source, prefix=prefix, given=given_keys(data))


def override(cfg: MonitorConfig, overrides: Mapping[str, Any],
             source: str = "overrides") -> MonitorConfig:
    """`cfg` with the top-level keys of `overrides` replaced (validated like the block)."""
    given = parse_config(overrides, source=source)
    names = [ALIASES.get(str(k), str(k)) for k in overrides]
    return replace(cfg, **{n: getattr(given, n) for n in names}, given=cfg.given | given.given)


def describe(cfg: MonitorConfig) -> dict[str, Any]:
    """The resolved settings as plain data (for `mfotel check`); secrets redacted."""
    def plain(obj: Any) -> Any:
        if hasattr(obj, "__dataclass_fields__"):
            return {f.name: plain(getattr(obj, f.name)) for f in fields(obj) if f.compare}
        if isinstance(obj, tuple):
            return list(obj)
        if isinstance(obj, Mapping):
            return dict(obj)
        return obj
    data: dict[str, Any] = plain(cfg)
    data["log_rank"] = -1 if cfg.log_rank is None else data["log_rank"]
    data["otlp"]["headers"] = redact_headers(cfg.otlp.headers)
    data["resource_attributes"] = redact_named(cfg.resource_attributes)
    data["file_sd"]["labels"] = redact_named(cfg.file_sd.labels)
    for section, key in (("otlp", "endpoint"), (None, "alertmanager_url")):
        holder = data[section] if section else data
        if holder[key]:
            holder[key] = redact_url(holder[key])
    return data


# ---------------------------------------------------------------- JSON Schema
SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"


def json_schema(kind: str = "plain") -> dict[str, Any]:
    """JSON Schema (draft 2020-12) for editors and CI.

    kind: `plain` (a training YAML with a `monitor_config` block), `mindformers` (a mindformers
    YAML: the `{type: OTelMonitor, ...}` callback entry; native `monitor_config` keys) or
    `block` (the `monitor_config` mapping alone, e.g. OTelMonitor keyword arguments).
    """
    block = MONITOR.schema()
    if kind == "block":
        return {"$schema": SCHEMA_DIALECT, "title": "mfotel monitor_config", **block}
    if kind == "plain":
        return {"$schema": SCHEMA_DIALECT, "title": "Training YAML with an mfotel monitor_config",
                "type": "object", "properties": {SECTION: {"$ref": "#/$defs/monitor_config"}},
                "$defs": {"monitor_config": block}}
    if kind == "mindformers":
        entry = {**block, "properties": {
            "type": {"const": "OTelMonitor"},
            "auto_register": {"type": "string", "description": "module.Class mindformers imports"},
            **block["properties"]}, "required": ["type"], "type": "object"}
        return {"$schema": SCHEMA_DIALECT,
                "title": "mindformers YAML with the OTelMonitor callback",
                "type": "object", "properties": {
                    "callbacks": {"type": "array", "items": {
                        "if": {"type": "object", "required": ["type"],
                               "properties": {"type": {"const": "OTelMonitor"}}},
                        "then": {"$ref": "#/$defs/otel_monitor_callback"}}},
                    SECTION: {"type": ["object", "null"], "additionalProperties": False,
                              "description": "mindformers' own monitor_config (native keys "
                                             "only: mfotel's keys go on the callback entry)",
                              "properties": {k: {} for k in NATIVE_MONITOR_KEYS}}},
                "$defs": {"otel_monitor_callback": entry}}
    raise ValueError(f"unknown schema kind {kind!r}: use plain, mindformers or block")
