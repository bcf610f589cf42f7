"""Reading a training YAML safely, and finding the monitor settings in it.

    cfg = load_config("train.yaml")   # `monitor_config` block, or a mindformers OTelMonitor entry

A YAML file is untrusted input: its size, nesting and alias expansion are bounded while it is
parsed, before PyYAML builds anything (a "billion laughs" document, a 1 MiB list of zeros or
100k keys is refused within MAX_NODES parser events: a few hundredths of a second and a few
MB), and whatever goes wrong becomes a ConfigError naming the file, never a traceback.
"""
from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError, Problems, did_you_mean, show
from .keys import JOB_NAME_PATTERN, KNOWN_KEYS, parse_config
from .settings import NATIVE_MONITOR_KEYS, SECTION, MonitorConfig

#: Training YAMLs are a few KB (mindformers' shipped configs at most ~20 KB and ~1000 values,
#: hand-grown ones a few hundred KB): 1 MiB and 25,000 values are generous. Within them,
#: loading any document, refused or not, costs under 0.5 s of CPU and 64 MB (measured by
#: tests/unit/test_config_fuzz.py: ~0.2 s and ~15 MB for the largest accepted ones).
MAX_BYTES = 1024 * 1024
#: Values after alias expansion (what a reader of the document walks), and nesting depth
#: (mindformers YAMLs nest 6 deep). Measured before anything is built (`_measure`).
MAX_NODES = 25_000
MAX_DEPTH = 64
CALLBACK_TYPE = "OTelMonitor"
#: Top-level keys only a mindformers (Trainer) YAML has.
MINDFORMERS_KEYS = ("trainer", "runner_wrapper", "runner_config", "run_mode", "callbacks")
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: 10x faster, same results


# ---------------------------------------------------------------- bounded YAML
def _line(event: yaml.Event) -> str:
    return f"line {event.start_mark.line + 1}" if event.start_mark else "-"


def _too_big(source: str, event: yaml.Event, what: str) -> ConfigError:
    return ConfigError(source, _line(event), f"the document expands to {what} (aliases "
                       "included)", "write the values out; a training YAML is a few KB")


_STARTS = (yaml.SequenceStartEvent, yaml.MappingStartEvent)
_ENDS = (yaml.SequenceEndEvent, yaml.MappingEndEvent)


def _measure(text: str, source: str) -> None:
    """Refuse `text` if its aliases expand past MAX_NODES values or MAX_DEPTH levels, or recurse.

    Runs on the parser's events, one at a time, before any node is built: the cost of a
    refused document is at most MAX_NODES events, whatever its size. An anchor's expanded
    size and depth are remembered, so an alias costs one event however much it expands to.
    Values are counted in document order, so a collection's expanded size is the count at
    its end minus the count at its start.
    """
    parser = _LOADER(text)
    anchors: dict[str, tuple[int, int] | None] = {}  # None: still open (an alias = recursion)
    frames: list[list[Any]] = []  # open collections: [anchor, count before it, deepest level]
    total = level = 0
    try:
        for event in iter(parser.get_event, None):
            kind = type(event)
            if kind is yaml.ScalarEvent:
                total += 1
                if event.anchor:
                    anchors[event.anchor] = (1, 1)
                deepest = level + 1
            elif kind in _STARTS:
                level += 1
                frames.append([event.anchor, total, level])
                total += 1
                if event.anchor:
                    anchors[event.anchor] = None
                deepest = level
            elif kind in _ENDS:
                anchor, before, deepest = frames.pop()
                if total > before + 1:   # it has children: they are one level deeper
                    deepest = max(deepest, level + 1)
                if anchor:
                    anchors[anchor] = (total - before, deepest - level + 1)
                level -= 1
                if frames:
                    frames[-1][2] = max(frames[-1][2], deepest)
                continue
            elif kind is yaml.AliasEvent:
                found = anchors.get(event.anchor, (1, 1))  # undefined: PyYAML says so later
                if found is None:
                    raise ConfigError(source, _line(event), "an alias refers to a value "
                                      "that contains it (a recursive document)",
                                      "remove the recursive alias")
                total += found[0]
                deepest = level + found[1]
                if frames:
                    frames[-1][2] = max(frames[-1][2], deepest)
            else:   # stream and document boundaries
                continue
            if total > MAX_NODES:
                raise _too_big(source, event, f"more than {MAX_NODES} values")
            if deepest > MAX_DEPTH:
                raise _too_big(source, event, f"nesting deeper than {MAX_DEPTH} levels")
    finally:
        parser.dispose()


def parse_yaml(text: str, source: str) -> Any:
    """YAML text -> data, bounded as described above; errors are ConfigErrors naming `source`."""
    try:
        _measure(text, source)
        loader = _LOADER(text)
        try:
            return loader.get_single_data()
        finally:
            loader.dispose()
    except ConfigError:
        raise
    except yaml.YAMLError as exc:
        fix = "fix the YAML syntax at the line shown"
        if "flow mapping" in str(exc) or "flow sequence" in str(exc):
            fix += ('; inside { } or [ ], quote values that contain braces, e.g. '
                    'file_path: "./logs/m_{rank}.log"')
        raise ConfigError(source, "-", f"not valid YAML ({show_yaml_error(exc)})", fix) from None
    except RecursionError:
        raise ConfigError(source, "-", f"nested deeper than {MAX_DEPTH} levels",
                          "flatten the document") from None
    except Exception as exc:  # noqa: BLE001 - e.g. a 5000-digit int or a bad date: never a traceback
        raise ConfigError(source, "-", f"a value cannot be read ({type(exc).__name__}: "
                          f"{str(exc)[:200]})", "fix or quote the value") from None


def show_yaml_error(exc: yaml.YAMLError) -> str:
    """PyYAML's problem and position on one line, without the quoted line of the file (it
    may hold a token, or be megabytes long)."""
    if not isinstance(exc, yaml.MarkedYAMLError):
        return show(str(exc))
    words = " ".join(w for w in (exc.context, exc.problem) if w)
    mark = exc.problem_mark or exc.context_mark
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    return re.sub(r"\s+", " ", words)[:200] + where


def read_yaml(path: str | Path) -> Any:
    """Load a YAML file with the safe loader, bounded in size, nesting and aliases."""
    path, source = Path(path), str(path)
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(source, "-", "not a regular file", "give the path of a YAML file")
        with open(path, "rb") as handle:
            raw = handle.read(MAX_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(source, "-", "file not found", "check the path") from None
    except OSError as exc:
        raise ConfigError(source, "-", f"cannot be read ({exc.strerror or exc})",
                          "check the path and its permissions") from None
    if len(raw) > MAX_BYTES:
        raise ConfigError(source, "-", f"larger than {MAX_BYTES // 2**20} MiB",
                          "a training YAML is a few KB: check that this is the right file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(source, "-", f"not UTF-8 text ({exc.reason} at byte {exc.start})",
                          "save the file as UTF-8") from None
    return parse_yaml(text, source)


# ---------------------------------------------------------------- where the settings are
def callback_entries(document: Mapping[str, Any]) -> list[tuple[int, Mapping[str, Any]]]:
    """(index, entry) of every `{type: OTelMonitor, ...}` item of `callbacks:`."""
    callbacks = document.get("callbacks")
    if not isinstance(callbacks, list):
        return []
    return [(i, e) for i, e in enumerate(callbacks)
            if isinstance(e, Mapping) and e.get("type") == CALLBACK_TYPE]


def entry_settings(entry: Mapping[str, Any]) -> dict[str, Any]:
    """The mfotel keys of a callback entry (`type` and mindformers' `auto_register` removed)."""
    return {k: v for k, v in entry.items() if k not in ("type", "auto_register")}


def find_callback_entry(document: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The mfotel keys of the first OTelMonitor entry of a mindformers `callbacks:` list."""
    entries = callback_entries(document)
    return entry_settings(entries[0][1]) if entries else None


def is_mindformers_document(document: Mapping[str, Any]) -> bool:
    """A mindformers (Trainer) YAML: mindformers owns its `monitor_config`."""
    monitor = document.get(SECTION)
    native_only = set(NATIVE_MONITOR_KEYS) - set(KNOWN_KEYS)
    return any(k in document for k in MINDFORMERS_KEYS) or (
        isinstance(monitor, Mapping) and any(k in native_only for k in monitor))


def missing_entry_error(document: Mapping[str, Any], source: str) -> ConfigError:
    """The diagnosis for a mindformers YAML without an OTelMonitor callback entry."""
    callbacks = document.get("callbacks")
    types = [(i, e.get("type")) for i, e in enumerate(callbacks or [])
             if isinstance(e, Mapping)] if isinstance(callbacks, list) else []
    for i, kind in types:
        hint = did_you_mean(kind, [CALLBACK_TYPE])
        if hint and isinstance(kind, str):
            return ConfigError(source, f"callbacks[{i}].type", f"{show(kind)} is not a callback "
                               f"mfotel registers", f"write type: {CALLBACK_TYPE}{hint}")
    return ConfigError(source, "callbacks", f"this mindformers YAML has no `type: {CALLBACK_TYPE}` "
                       "callback entry, so mfotel is off (mindformers owns monitor_config: its "
                       "keys are not mfotel's)",
                       f"add `- type: {CALLBACK_TYPE}` to `callbacks:` with mfotel's keys on that "
                       "entry, e.g. callbacks: [{type: MFLossMonitor}, {type: OTelMonitor, "
                       "step_interval: 10}]")


def safe_job_name(text: str) -> str | None:
    """`text` (a file's stem) as a job name: other characters become '_'; None if nothing is
    left."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", text)[:128].lstrip("._-")
    return name if re.match(JOB_NAME_PATTERN, name) else None


def config_from_document(document: Any, source: str) -> MonitorConfig:
    """The monitor settings of a parsed training YAML (every problem reported at once)."""
    if not isinstance(document, Mapping):
        raise ConfigError(source, "-", "the file is not a YAML mapping",
                          f"write a top-level `{SECTION}:` block")
    entries = callback_entries(document)
    if entries:
        index, entry = entries[0]
        return parse_config(entry_settings(entry), source, prefix=f"callbacks[{index}]")
    if is_mindformers_document(document):
        raise missing_entry_error(document, source)
    misplaced = sorted(str(k) for k in document if k in KNOWN_KEYS and k != "enable")
    if SECTION not in document:
        if misplaced:
            raise ConfigError(source, SECTION, f"no {SECTION} block, but monitor keys "
                              f"({', '.join(misplaced)}) sit at the top level",
                              f"put them under a `{SECTION}:` line, indented")
        raise ConfigError(source, SECTION, "no monitor_config block",
                          f"add a `{SECTION}:` block (see README, Configuration)")
    problems = Problems()
    if misplaced:
        problems.add(ConfigError(source, misplaced[0], f"{misplaced[0]!r} is at the top level, "
                                 f"beside {SECTION} instead of inside it",
                                 f"indent {', '.join(misplaced)} under {SECTION}: "
                                 "(YAML indentation)"))
    cfg = problems.run(parse_config, document[SECTION], source)
    problems.raise_if_any()
    assert cfg is not None  # else raise_if_any raised its errors
    return cfg


def load_config(path: str | Path) -> MonitorConfig:
    """MonitorConfig from a YAML file's `monitor_config` block (or OTelMonitor callback entry).

    The job name defaults to the file's stem (an explicit `job_name` and OTEL_SERVICE_NAME
    win over it: see `resolve_otel_env`).
    """
    cfg = config_from_document(read_yaml(path), str(path))
    stem = safe_job_name(Path(path).stem)
    return cfg.with_job_name(stem) if cfg.job_name is None and stem else cfg
