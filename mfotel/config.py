"""`monitor_config`: parse, validate and normalise the YAML block (DESIGN.md section 3).

    cfg = load_config("train.yaml")            # reads the `monitor_config` block
    cfg = parse_config({"step_interval": 50})  # kwargs of the callback entry

Every problem raises ConfigError naming the file, the key path, the bad value and the fix.
"""
from __future__ import annotations

import difflib
import math
import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, Mapping

import yaml

from .contract import SEED_METRICS

SECTION = "monitor_config"


class ConfigError(ValueError):
    """A bad monitor configuration; the message says where and how to fix it."""

    def __init__(self, source: str, key: str, problem: str, fix: str) -> None:
        self.source, self.key, self.problem, self.fix = source, key, problem, fix
        super().__init__(f"{source}: {key}: {problem}. Fix: {fix}")


@dataclass(frozen=True)
class OutputConfig:
    console: bool = True
    file: bool = False
    file_path: str = "./monitor_logs/train_monitor.log"
    format: str = "text"  # text | json

    def resolved_file_path(self, rank: int, job_name: str) -> Path:
        """Absolute path with `{rank}` / `{job_name}` filled in."""
        return Path(self.file_path.format(rank=rank, job_name=job_name)).expanduser().absolute()


@dataclass(frozen=True)
class PrometheusConfig:
    host: str = "0.0.0.0"  # every rank must be reachable by a cluster Prometheus
    port: int = 9464       # this rank serves port + local rank; 0 turns the endpoint off
    linger_seconds: float = 0.0
    certfile: str | None = None
    keyfile: str | None = None


@dataclass(frozen=True)
class OtlpConfig:
    endpoint: str | None = None  # e.g. http://collector:4318/v1/metrics; None = no push
    interval_seconds: float = 10.0
    timeout_seconds: float = 5.0
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class MonitorConfig:
    enable: bool = True
    step_interval: int = 1
    metrics: tuple[str, ...] = ("loss", "learning_rate")
    output: OutputConfig = field(default_factory=OutputConfig)
    log_rank: tuple[int, ...] | None = (0,)  # None = every rank
    job_name: str | None = None
    prometheus: PrometheusConfig = field(default_factory=PrometheusConfig)
    on_nonfinite: str = "warn"  # warn | stop
    resource_attributes: Mapping[str, str] = field(default_factory=dict)
    otlp: OtlpConfig = field(default_factory=OtlpConfig)
    early_steps: int = 0           # use early_step_interval for the first N steps
    early_step_interval: int = 1
    batch_size: int | None = None  # samples per step on this rank, when the run can't tell
    seq_length: int | None = None  # tokens per sample, enables mindformers_train_tokens_total
    source: str = "<kwargs>"       # where this config came from, for messages

    def logs_on(self, rank: int) -> bool:
        """Whether console/file lines are written on `rank` (log_rank gating)."""
        return self.log_rank is None or rank in self.log_rank

    def is_record_step(self, step: int) -> bool:
        """Whether seed metrics are recorded at global `step` (1-based)."""
        if step <= self.early_steps:
            return step % self.early_step_interval == 0
        return step % self.step_interval == 0

    def with_job_name(self, job_name: str) -> "MonitorConfig":
        return replace(self, job_name=job_name)


# ---------------------------------------------------------------- validators
Check = Callable[[Any, str, str], Any]


def _bool(value: Any, source: str, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "on", "off"):
        return value.lower() in ("true", "yes", "on")
    raise ConfigError(source, key, f"{value!r} is not a boolean", f"write {key.split('.')[-1]}: true or false")


def _int(minimum: int, maximum: int | None = None, example: int = 1) -> Check:
    def check(value: Any, source: str, key: str) -> int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            value, ok = int(value), True
        if not ok or value < minimum or (maximum is not None and value > maximum):
            bounds = f">= {minimum}" if maximum is None else f"between {minimum} and {maximum}"
            raise ConfigError(source, key, f"{value!r} is not a whole number {bounds}",
                              f"use a whole number {bounds}, e.g. {key.split('.')[-1]}: {example}")
        return value
    return check


def _optional(check: Check) -> Check:
    def wrapped(value: Any, source: str, key: str) -> Any:
        return None if value is None else check(value, source, key)
    return wrapped


def _seconds(value: Any, source: str, key: str) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
            and value >= 0:
        return float(value)
    raise ConfigError(source, key, f"{value!r} is not a number of seconds >= 0",
                      f"use a number such as {key.split('.')[-1]}: 30")


def _positive_seconds(value: Any, source: str, key: str) -> float:
    seconds = _seconds(value, source, key)
    if seconds <= 0:
        raise ConfigError(source, key, f"{value!r} must be > 0",
                          f"use a positive number such as {key.split('.')[-1]}: 10")
    return seconds


def _string(value: Any, source: str, key: str) -> str:
    if isinstance(value, str) and value.strip():
        return value
    raise ConfigError(source, key, f"{value!r} is not a non-empty string",
                      f"quote a text value, e.g. {key.split('.')[-1]}: \"...\"")


def _choice(*choices: str) -> Check:
    def check(value: Any, source: str, key: str) -> str:
        if isinstance(value, str) and value.lower() in choices:
            return value.lower()
        raise ConfigError(source, key, f"{value!r} is not one of {', '.join(choices)}",
                          f"use one of: {', '.join(choices)}{_did_you_mean(value, choices)}")
    return check


def _string_map(value: Any, source: str, key: str) -> dict[str, str]:
    if not isinstance(value, Mapping):
        raise ConfigError(source, key, f"{value!r} is not a mapping",
                          f"write {key.split('.')[-1]} as key: value pairs")
    return {str(k): str(v) for k, v in value.items()}


def _metrics(value: Any, source: str, key: str) -> tuple[str, ...]:
    items = [v.strip() for v in value.split(",")] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not items:
        raise ConfigError(source, key, f"{value!r} is not a non-empty list",
                          f"list some of {', '.join(SEED_METRICS)}, e.g. metrics: [loss, learning_rate]")
    chosen: list[str] = []
    for i, item in enumerate(items):
        name = str(item).lower()
        if name not in SEED_METRICS:
            raise ConfigError(source, f"{key}[{i}]", f"unknown metric {item!r}",
                              f"use any of {', '.join(SEED_METRICS)}{_did_you_mean(str(item), SEED_METRICS)}")
        if name not in chosen:
            chosen.append(name)
    return tuple(chosen)


def _log_rank(value: Any, source: str, key: str) -> tuple[int, ...] | None:
    fix = "use a rank (0), a list of ranks ([0, 8]) or -1 for every rank"
    if value == -1 or (isinstance(value, str) and value.lower() == "all"):
        return None
    items = value if isinstance(value, (list, tuple)) else [value]
    ranks: list[int] = []
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int) or item < -1:
            raise ConfigError(source, key, f"{value!r} is not a rank", fix)
        if item == -1:
            return None
        ranks.append(item)
    if not ranks:
        raise ConfigError(source, key, "the list is empty", fix)
    return tuple(sorted(set(ranks)))


# key -> (check, aliases); nested sections are dataclasses with their own tables
_OUTPUT: dict[str, Check] = {"console": _bool, "file": _bool, "file_path": _string,
                             "format": _choice("text", "json")}
_PROMETHEUS: dict[str, Check] = {"host": _string, "port": _int(0, 65535, 9464),
                                 "linger_seconds": _seconds, "certfile": _optional(_string),
                                 "keyfile": _optional(_string)}
_OTLP: dict[str, Check] = {"endpoint": _optional(_string), "interval_seconds": _positive_seconds,
                           "timeout_seconds": _positive_seconds, "headers": _string_map}
_TOP: dict[str, Check] = {
    "enable": _bool, "step_interval": _int(1, example=50), "metrics": _metrics,
    "log_rank": _log_rank, "job_name": _optional(_string),
    "on_nonfinite": _choice("warn", "stop"), "resource_attributes": _string_map,
    "early_steps": _int(0, example=100), "early_step_interval": _int(1, example=1),
    "batch_size": _optional(_int(1, example=8)), "seq_length": _optional(_int(1, example=2048)),
}
_SECTIONS: dict[str, tuple[type, dict[str, Check]]] = {
    "output": (OutputConfig, _OUTPUT), "prometheus": (PrometheusConfig, _PROMETHEUS),
    "otlp": (OtlpConfig, _OTLP)}
ALIASES = {"monitor_on": "enable", "interval": "step_interval"}
KNOWN_KEYS: tuple[str, ...] = (*_TOP, *_SECTIONS, *ALIASES)


def _did_you_mean(word: Any, choices: Any) -> str:
    close = difflib.get_close_matches(str(word), list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _unknown(source: str, key: str, name: str, known: Any) -> ConfigError:
    return ConfigError(source, key, "unknown key",
                       f"remove it or use a known key{_did_you_mean(name, known)}; "
                       f"known keys: {', '.join(sorted(known))}")


def _section(cls: type, table: dict[str, Check], data: Any, source: str, prefix: str) -> Any:
    if data is None:
        return cls()
    if not isinstance(data, Mapping):
        raise ConfigError(source, prefix, f"{data!r} is not a mapping",
                          f"indent the {prefix.split('.')[-1]} keys under it as key: value pairs")
    values = {}
    for name, value in data.items():
        key = f"{prefix}.{name}"
        if name not in table:
            raise _unknown(source, key, str(name), table)
        values[name] = table[name](value, source, key)
    return cls(**values)


def parse_config(data: Mapping[str, Any] | None, source: str = "<kwargs>",
                 prefix: str = SECTION) -> MonitorConfig:
    """Validate one `monitor_config` mapping (or the callback's kwargs)."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(source, prefix, f"{data!r} is not a mapping",
                          "indent the monitor keys under monitor_config as key: value pairs")
    values: dict[str, Any] = {"source": source}
    for raw_name, value in data.items():
        name = ALIASES.get(str(raw_name), str(raw_name))
        key = f"{prefix}.{raw_name}"
        if name in values:
            raise ConfigError(source, key, f"{name!r} is given twice (once through an alias)",
                              f"keep only {name}")
        if name in _SECTIONS:
            cls, table = _SECTIONS[name]
            values[name] = _section(cls, table, value, source, key)
        elif name in _TOP:
            values[name] = _TOP[name](value, source, key)
        else:
            raise _unknown(source, key, str(raw_name), KNOWN_KEYS)
    cfg = MonitorConfig(**values)
    if cfg.output.format == "json" and not cfg.output.file:
        pass  # format only matters for the file sink; harmless
    if cfg.prometheus.certfile and not cfg.prometheus.keyfile:
        raise ConfigError(source, f"{prefix}.prometheus.keyfile", "certfile given without keyfile",
                          "set both certfile and keyfile for TLS, or neither")
    return cfg


def read_yaml(path: str | Path) -> Any:
    """Load a YAML file with the safe loader; errors name the file and line."""
    path = Path(path)
    try:
        with open(path, encoding="utf-8") as handle:
            return yaml.safe_load(handle)
    except FileNotFoundError:
        raise ConfigError(str(path), "-", "file not found", "check the path") from None
    except yaml.YAMLError as exc:
        fix = "fix the YAML syntax at the line shown"
        if "flow mapping" in str(exc) or "flow sequence" in str(exc):
            fix += ('; inside { } or [ ], quote values that contain braces, e.g. '
                    'file_path: "./logs/m_{rank}.log"')
        raise ConfigError(str(path), "-", f"not valid YAML ({exc})", fix) from None


def find_callback_entry(document: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The `{type: OTelMonitor, ...}` entry of a mindformers `callbacks:` list, if any."""
    for entry in document.get("callbacks") or []:
        if isinstance(entry, Mapping) and entry.get("type") == "OTelMonitor":
            return {k: v for k, v in entry.items() if k != "type"}
    return None


def load_config(path: str | Path) -> MonitorConfig:
    """MonitorConfig from a YAML file's `monitor_config` block (or OTelMonitor callback entry).

    The job name defaults to the file's stem.
    """
    source = str(path)
    document = read_yaml(path)
    if not isinstance(document, Mapping):
        raise ConfigError(source, "-", "the file is not a YAML mapping",
                          f"write a top-level `{SECTION}:` block")
    misplaced = sorted(k for k in document if k in KNOWN_KEYS and k not in ("enable",))
    entry = find_callback_entry(document)
    if entry is not None:
        cfg = parse_config(entry, source, prefix="callbacks[OTelMonitor]")
    elif SECTION in document:
        if misplaced:
            raise ConfigError(source, misplaced[0], f"{misplaced[0]!r} is at the top level, "
                              f"beside {SECTION} instead of inside it",
                              f"indent {', '.join(misplaced)} under {SECTION}: (YAML indentation)")
        cfg = parse_config(document[SECTION], source)
    elif misplaced:
        raise ConfigError(source, SECTION, f"no {SECTION} block, but monitor keys "
                          f"({', '.join(misplaced)}) sit at the top level",
                          f"put them under a `{SECTION}:` line, indented")
    else:
        raise ConfigError(source, SECTION, "no monitor_config block",
                          f"add a `{SECTION}:` block (see README, Configuration)")
    if cfg.job_name is None:
        cfg = cfg.with_job_name(Path(path).stem)
    return cfg


def check_writable(cfg: MonitorConfig, rank: int, job_name: str) -> Path | None:
    """Create the file sink's directory and prove it writable; the resolved path, or None."""
    if not (cfg.enable and cfg.output.file):
        return None
    path = cfg.output.resolved_file_path(rank, job_name)
    key = "monitor_config.output.file_path"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(cfg.source, key, f"cannot create directory {path.parent} ({exc.strerror})",
                          "choose a writable file_path or fix the directory's permissions") from None
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ConfigError(cfg.source, key, f"{path} is not writable",
                          "choose a writable file_path or fix the permissions")
    return path


def describe(cfg: MonitorConfig) -> dict[str, Any]:
    """The resolved settings as plain data (for `mfotel check`)."""
    def plain(obj: Any) -> Any:
        if hasattr(obj, "__dataclass_fields__"):
            return {f.name: plain(getattr(obj, f.name)) for f in fields(obj)}
        if isinstance(obj, tuple):
            return list(obj)
        if isinstance(obj, Mapping):
            return dict(obj)
        return obj
    data = plain(cfg)
    data["log_rank"] = -1 if cfg.log_rank is None else data["log_rank"]
    return data
