"""`monitor_config`: read, validate and resolve the monitor settings (README, Configuration).

    cfg = load_config("train.yaml")            # reads the `monitor_config` block
    cfg = parse_config({"step_interval": 50})  # kwargs of the callback entry
    effective = resolve_otel_env(cfg).config   # OTEL_* variables applied under explicit keys

Every problem raises ConfigError naming the file, the key path, the bad value and the fix;
all the problems of a document come in one ConfigError, one line each.

    errors.py     ConfigError, did-you-mean
    settings.py   the frozen dataclasses the rest of mfotel reads
    fields.py     value kinds: each validates and describes itself as JSON Schema
    keys.py       the keys of monitor_config (one table), parse_config, json_schema
    source.py     bounded YAML reading, the block or the mindformers callback entry
    otel_env.py   OTEL_* environment variables
    preflight.py  writable outputs and the port plan, on this machine
    redact.py     secrets never printed
"""
from __future__ import annotations

from .errors import ConfigError, did_you_mean
from .keys import (
                   ALIASES,
                   JOB_NAME_PATTERN,
                   KNOWN_KEYS,
                   describe,
                   json_schema,
                   override,
                   parse_config,
)
from .otel_env import Resolved, metrics_url, resolve_otel_env
from .preflight import check_writable
from .settings import (
                   ACTIONS,
                   CARDINALITY_LEVELS,
                   DEFAULT_JOB_NAME,
                   FILE_SD_MODES,
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
from .source import find_callback_entry, load_config, read_yaml

__all__ = ["ACTIONS", "ALIASES", "CARDINALITY_LEVELS", "DEFAULT_JOB_NAME", "FILE_SD_MODES",
           "JOB_NAME_PATTERN", "KNOWN_KEYS", "SECTION", "ActionsConfig", "ConfigError",
           "FileSdConfig", "MonitorConfig", "NonfiniteRule", "OtlpConfig", "OutputConfig",
           "PlateauRule", "PrometheusConfig", "Resolved", "RunConfig", "check_writable",
           "describe", "did_you_mean", "find_callback_entry", "json_schema", "load_config",
           "metrics_url", "override", "parse_config", "read_yaml", "resolve_otel_env"]
