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

    def __init__(self, source: str, key: str | None = None, problem: str = "",
                 fix: str = "") -> None:
        self.source, self.key, self.problem, self.fix = source, key, problem, fix
        # one argument: an already formatted message (frameworks re-raise `type(e)(str(e))`)
        super().__init__(source if key is None else f"{source}: {key}: {problem}. Fix: {fix}")


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
    # after training ends, keep /metrics up until the final values (status 2/3) have been
    # scraped once, at most this long: else a finished rank looks like a dead one
    linger_seconds: float = 30.0
    linger_until_scraped: bool = True  # False: always wait the full linger (HA Prometheus pairs)
    certfile: str | None = None
    keyfile: str | None = None
    web_config_file: str | None = None  # Prometheus web-config format: TLS + basic auth


@dataclass(frozen=True)
class OtlpConfig:
    endpoint: str | None = None  # e.g. http://collector:4318/v1/metrics; None = no push
    interval_seconds: float = 10.0
    timeout_seconds: float = 5.0
    headers: Mapping[str, str] = field(default_factory=dict)


# ---------------------------------------------------------------- multi-rank (mfotel.cluster.discovery)
FILE_SD_MODES: tuple[str, ...] = ("job", "rank")
CARDINALITY_LEVELS: tuple[str, ...] = ("full", "health")


@dataclass(frozen=True)
class FileSdConfig:
    """`file_sd`: a Prometheus file_sd target file for the job's ranks."""
    path: str | None = None          # {job_name}, {rank} allowed; None = write no file
    mode: str = "job"                # job: rank 0 lists every rank | rank: each rank lists itself
    hosts: tuple[str, ...] = ()      # node addresses in node-rank order (default: this host)
    labels: Mapping[str, str] = field(default_factory=dict)  # extra target labels

    def resolved_path(self, rank: int, job_name: str) -> Path | None:
        if not self.path:
            return None
        return Path(self.path.format(rank=rank, job_name=job_name)).expanduser().absolute()


@dataclass(frozen=True)
class RunConfig:
    """`run`: identity of the training run across restarts and resumes."""
    id: str | None = None            # default: $MFOTEL_RUN_ID, else the state file's, else new
    state_file: str | None = None    # keeps id and attempt across restarts; {job_name}, {rank}



# ---------------------------------------------------------------- actions (mfotel.actions.engine)
ACTIONS: tuple[str, ...] = ("stop", "scale_lr", "warn")


@dataclass(frozen=True)
class NonfiniteRule:
    """`actions.nonfinite`: what to do when the loss first goes NaN/Inf."""
    action: str = "stop"   # stop | scale_lr | warn
    factor: float = 0.5    # learning-rate multiplier, for action: scale_lr


@dataclass(frozen=True)
class PlateauRule(NonfiniteRule):
    """`actions.plateau`: no loss improvement of `min_delta` over `patience` records."""
    patience: int = 10
    min_delta: float = 0.0


@dataclass(frozen=True)
class ActionsConfig:
    plateau: PlateauRule | None = None
    nonfinite: NonfiniteRule | None = None
    control_dir: str | None = None  # the job's control directory; {job_name} is filled in
    lead_steps: int = 3             # multi-rank: steps between a decision and its application

    @property
    def enabled(self) -> bool:
        return bool(self.plateau or self.nonfinite or self.control_dir)

    @property
    def may_scale_lr(self) -> bool:
        """Whether a scale_lr can be requested (a rule uses it, or the control file may)."""
        rules = (self.plateau, self.nonfinite)
        return bool(self.control_dir) or any(r and r.action == "scale_lr" for r in rules)

    def resolved_control_dir(self, job_name: str) -> Path | None:
        if not self.control_dir:
            return None
        return Path(self.control_dir.format(job_name=job_name)).expanduser().absolute()


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
    alertmanager_url: str | None = None  # fast path: post a NaN loss alert straight there
    early_step_interval: int = 1
    batch_size: int | None = None  # samples per step on this rank, when the run can't tell
    seq_length: int | None = None  # tokens per sample, enables mindformers_train_tokens_total
    flops_per_token: float | None = None  # model FLOPs per training token (mindformers: estimated)
    peak_flops: float | None = None  # peak FLOP/s of one device: enables the MFU gauge
    native_series_limit: int = 2000  # series per native metric (OTel's default cardinality cap)
    actions: ActionsConfig = field(default_factory=ActionsConfig)  # mfotel.actions.engine
    file_sd: FileSdConfig = field(default_factory=FileSdConfig)    # mfotel.cluster.discovery
    cardinality: str = "full"      # full | health (seed metrics only from metric_ranks)
    metric_ranks: tuple[int, ...] | None = None  # at cardinality health; None = log_rank's
    run: RunConfig = field(default_factory=RunConfig)
    source: str = "<kwargs>"       # where this config came from, for messages

    def logs_on(self, rank: int) -> bool:
        """Whether console/file lines are written on `rank` (log_rank gating)."""
        return self.log_rank is None or rank in self.log_rank

    def exports_seed_metrics(self, rank: int) -> bool:
        """Whether `rank` exposes loss, lr, grad norm and the throughput gauge (cardinality)."""
        if self.cardinality == "full":
            return True
        ranks = self.metric_ranks if self.metric_ranks is not None else self.log_rank
        return ranks is None or rank in ranks

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


def _positive_number(example: str) -> Check:
    """A finite number > 0. YAML 1.1 reads `3.13e14` (no dot, no exponent sign) as text: the
    fix says how to write it."""
    def check(value: Any, source: str, key: str) -> float:
        if isinstance(value, (int, float)) and not isinstance(value, bool) \
                and math.isfinite(value) and value > 0:
            return float(value)
        leaf, hint = key.split(".")[-1], ""
        if isinstance(value, str):
            try:
                hint = f" (YAML read {value!r} as text: write {leaf}: {float(value)!r} unquoted)"
            except ValueError:
                pass
        raise ConfigError(source, key, f"{value!r} is not a positive number",
                          f"use a positive number, e.g. {leaf}: {example}{hint}")
    return check


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


# multi-rank (mfotel.cluster.discovery): file_sd, run identity, cardinality
_RESERVED_TARGET_LABELS = ("job_name", "rank", "job", "instance")


def _ranks(value: Any, source: str, key: str) -> tuple[int, ...]:
    items = value if isinstance(value, (list, tuple)) else [value]
    if not items or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in items):
        raise ConfigError(source, key, f"{value!r} is not a rank or a list of ranks",
                          "use a rank (0) or a list of ranks ([0, 8]); for every rank use "
                          "cardinality: full")
    return tuple(sorted(set(items)))


def _hosts(value: Any, source: str, key: str) -> tuple[str, ...]:
    items = [v.strip() for v in value.split(",")] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(h, str) and h for h in items):
        raise ConfigError(source, key, f"{value!r} is not a list of host names",
                          "list the nodes in node-rank order, e.g. hosts: [node-1, node-2]")
    return tuple(items)


def _target_labels(value: Any, source: str, key: str) -> dict[str, str]:
    labels = _string_map(value, source, key)
    clash = sorted(set(labels) & set(_RESERVED_TARGET_LABELS))
    if clash:
        raise ConfigError(source, f"{key}.{clash[0]}", "every series already carries job_name "
                          "and rank, and Prometheus sets job and instance",
                          f"remove {', '.join(clash)} from the target labels")
    return labels


def _placeholders(*allowed: str) -> Check:
    def check(value: Any, source: str, key: str) -> str:
        text = _string(value, source, key)
        try:
            text.format(**dict.fromkeys(allowed, "x"))
        except (KeyError, IndexError, ValueError):
            names = ", ".join("{%s}" % a for a in allowed)
            raise ConfigError(source, key, f"{value!r} has a placeholder other than {names}",
                              f"use only {names} (quote the value in YAML)") from None
        return text
    return check


_FILE_SD: dict[str, Check] = {"path": _optional(_placeholders("job_name", "rank")),
                              "mode": _choice(*FILE_SD_MODES), "hosts": _hosts,
                              "labels": _target_labels}
_RUN: dict[str, Check] = {"id": _optional(_string),
                          "state_file": _optional(_placeholders("job_name", "rank"))}


def _check_file_sd(cfg: "MonitorConfig", source: str, prefix: str) -> None:
    sd = cfg.file_sd
    if sd.mode == "rank" and sd.path and "{rank}" not in sd.path:
        raise ConfigError(source, f"{prefix}.file_sd.path", "mode: rank needs {rank} in the "
                          "path, else the ranks overwrite one file",
                          'add {rank}, e.g. path: "/shared/targets/{job_name}-{rank}.json"')
    if sd.mode == "rank" and sd.hosts:
        raise ConfigError(source, f"{prefix}.file_sd.hosts", "hosts is only used by mode: job",
                          "remove hosts, or use mode: job")



# actions (mfotel.actions.engine): local rules and the control directory
def _factor(value: Any, source: str, key: str) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
            and value > 0:
        return float(value)
    raise ConfigError(source, key, f"{value!r} is not a positive number",
                      "use a learning-rate multiplier such as factor: 0.5")


def _min_delta(value: Any, source: str, key: str) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
            and value >= 0:
        return float(value)
    raise ConfigError(source, key, f"{value!r} is not a number >= 0",
                      "use the smallest loss decrease that counts, e.g. min_delta: 0.001")


def _control_dir(value: Any, source: str, key: str) -> str:
    text = _string(value, source, key)
    try:
        text.format(job_name="x")
    except (KeyError, IndexError, ValueError):
        raise ConfigError(source, key, f"{value!r} has a placeholder other than {{job_name}}",
                          "use only {job_name}, e.g. control_dir: /shared/mfotel-control/{job_name}"
                          ) from None
    return text


def _rule(cls: type, table: dict[str, Check]) -> Check:
    def check(value: Any, source: str, key: str) -> Any:
        if value is None:
            return None
        rule = _section(cls, table, value, source, key)
        if "factor" in value and rule.action != "scale_lr":
            raise ConfigError(source, f"{key}.factor", f"factor is ignored by action: {rule.action}",
                              "set action: scale_lr, or remove factor")
        return rule
    return check


_NONFINITE_RULE: dict[str, Check] = {"action": _choice(*ACTIONS), "factor": _factor}
_ACTIONS: dict[str, Check] = {
    "plateau": _rule(PlateauRule, {**_NONFINITE_RULE, "patience": _int(1, example=10),
                                   "min_delta": _min_delta}),
    "nonfinite": _rule(NonfiniteRule, _NONFINITE_RULE),
    "control_dir": _optional(_control_dir), "lead_steps": _int(1, example=3)}


def _actions(value: Any, source: str, key: str) -> ActionsConfig:
    return _section(ActionsConfig, _ACTIONS, value, source, key)


# key -> (check, aliases); nested sections are dataclasses with their own tables
_OUTPUT: dict[str, Check] = {"console": _bool, "file": _bool, "file_path": _string,
                             "format": _choice("text", "json")}
_PROMETHEUS: dict[str, Check] = {"host": _string, "port": _int(0, 65535, 9464),
                                 "linger_seconds": _seconds, "linger_until_scraped": _bool,
                                 "certfile": _optional(_string),
                                 "keyfile": _optional(_string),
                                 "web_config_file": _optional(_string)}
_OTLP: dict[str, Check] = {"endpoint": _optional(_string), "interval_seconds": _positive_seconds,
                           "timeout_seconds": _positive_seconds, "headers": _string_map}
_TOP: dict[str, Check] = {
    "enable": _bool, "step_interval": _int(1, example=50), "metrics": _metrics,
    "log_rank": _log_rank, "job_name": _optional(_string),
    "on_nonfinite": _choice("warn", "stop"), "resource_attributes": _string_map,
    "early_steps": _int(0, example=100), "early_step_interval": _int(1, example=1),
    "alertmanager_url": _optional(_string),
    "batch_size": _optional(_int(1, example=8)), "seq_length": _optional(_int(1, example=2048)),
    "flops_per_token": _optional(_positive_number("4.6e+10")),
    "peak_flops": _optional(_positive_number("3.0e+14")),
    "native_series_limit": _int(1, example=20000),
    "actions": _actions,
    "cardinality": _choice(*CARDINALITY_LEVELS), "metric_ranks": _optional(_ranks),
}
_SECTIONS: dict[str, tuple[type, dict[str, Check]]] = {
    "output": (OutputConfig, _OUTPUT), "prometheus": (PrometheusConfig, _PROMETHEUS),
    "otlp": (OtlpConfig, _OTLP),
    "file_sd": (FileSdConfig, _FILE_SD), "run": (RunConfig, _RUN)}
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
    if cfg.on_nonfinite == "stop" and cfg.actions.nonfinite is not None:
        raise ConfigError(source, f"{prefix}.on_nonfinite", "on_nonfinite: stop and "
                          "actions.nonfinite both say what to do on a NaN loss",
                          "keep actions.nonfinite (action: stop is the same) and remove on_nonfinite")
    _check_file_sd(cfg, source, prefix)
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
    except UnicodeDecodeError as exc:
        raise ConfigError(str(path), "-", f"not UTF-8 text ({exc.reason} at byte {exc.start})",
                          "save the file as UTF-8") from None
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
