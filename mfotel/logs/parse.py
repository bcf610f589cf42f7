"""Parse monitor logs into rows: mfotel text and JSON lines, mindformers MFLossMonitor lines.

One streaming parser (a generator; files are read line by line, never whole) for three
formats, detected per line:

- mfotel text, as written by the console and file sinks (a logger prefix may come first):
  `[Monitor] step: 50, loss: 2.345, learning_rate: 1.000000e-05, grad_norm: 0.876`
- mfotel JSON lines: `{"time": 1764671400.123, "job_name": "demo", "rank": 0, "step": 50, ...}`
  (non-finite values as the strings "nan", "inf", "-inf")
- mindformers `MFLossMonitor` lines in `output/log/rank_N/info.log` (or its console copy):
  `{ Epoch:[  1/  2], step:[    3/   10], loss:[10.2/10.3], per_step_time: 95ms, lr: 1e-05, ...`
  followed by a progress line carrying the throughput (`... 12.34 samples/s/p  0:00:05 }`).

Lines that look like monitor lines but do not parse are counted in a `ParseReport` with their
file and line number; other log lines are ignored.

    report = ParseReport()
    for row in iter_rows(discover_runs(["runs/exp1"]), report=report):
        print(row.run, row.rank, row.step, row.loss)
    print(report.describe())
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

from ..sinks import UNITS

#: The per-step values a row may carry, in display order.
METRICS: tuple[str, ...] = ("loss", "learning_rate", "grad_norm", "throughput", "step_time")

Progress = Callable[[int], None]
"""Called with the number of bytes consumed since the previous call."""


@dataclass(slots=True)
class Row:
    """One logged training step. Values are None when the log does not carry them.

    `throughput` is samples per second (per rank for mindformers' `samples/s/p`),
    `step_time` seconds, `time` unix seconds when the log has a timestamp.
    """
    run: str
    rank: int
    step: int
    epoch: int | None = None
    time: float | None = None
    loss: float | None = None
    learning_rate: float | None = None
    grad_norm: float | None = None
    throughput: float | None = None
    step_time: float | None = None
    loss_scale: float | None = None
    overflow: bool | None = None
    line: int = 0                  # 1-based line number in `path`
    path: str = ""
    source: str = ""               # "mfotel-text" | "mfotel-json" | "mindformers"


@dataclass(frozen=True, slots=True)
class Problem:
    """A line that looked like a monitor line but could not be parsed."""
    path: str
    line: int
    reason: str
    text: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}: {self.text}"


@dataclass
class ParseReport:
    """Counters of one parse; keeps the first `max_problems` problems, counts all of them."""
    max_problems: int = 1000
    files: int = 0
    lines: int = 0
    rows: int = 0
    problem_count: int = 0
    problems: list[Problem] = field(default_factory=list)

    def add_problem(self, path: str, line: int, reason: str, text: str) -> None:
        self.problem_count += 1
        if len(self.problems) < self.max_problems:
            text = text.rstrip("\r\n")
            self.problems.append(Problem(path, line, reason,
                                         text if len(text) <= 200 else text[:197] + "..."))

    def describe(self, limit: int = 20) -> str:
        """A short human report: totals, then up to `limit` problems with their line numbers."""
        head = (f"{self.rows} rows from {self.lines} lines in {self.files} file(s); "
                f"{self.problem_count} unparseable monitor line(s)")
        shown = [f"  {problem}" for problem in self.problems[:limit]]
        if self.problem_count > len(shown):
            shown.append(f"  ... and {self.problem_count - len(shown)} more")
        return "\n".join([head, *shown])


# --- value parsing -------------------------------------------------------------------------

def _number(text: str) -> float | None:
    """`2.5`, `nan`, `-inf`, `[1.e-05]`, `[2.5 3.0]` (first element), `None` -> float or None."""
    text = text.strip()
    if text.startswith("["):
        text = text.strip("[]").split(None, 1)[0] if text.strip("[] ") else ""
    if text in ("None", "unavailable", ""):
        return None
    return float(text)


def _json_number(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"boolean {value!r} is not a number")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        return float(value)       # "nan", "inf", "-inf"
    raise ValueError(f"{value!r} is not a number")


_TIMESTAMP = re.compile(r"(\d{4})-(\d\d)-(\d\d)[ T](\d\d):(\d\d):(\d\d)(?:[,.](\d{1,6}))?")


def _prefix_time(prefix: str) -> float | None:
    """Unix time of a logger timestamp (`2025-12-02 10:30:00,123`, local time) in `prefix`."""
    match = _TIMESTAMP.search(prefix)
    if match is None:
        return None
    y, mo, d, h, mi, s, frac = match.groups()
    micro = int((frac or "0").ljust(6, "0"))
    return datetime(int(y), int(mo), int(d), int(h), int(mi), int(s), micro).timestamp()


# --- line parsers: text -> Row fields, or raise ValueError with a reason ---------------------

_TEXT_KEYS = {"loss": "loss", "learning_rate": "learning_rate", "lr": "learning_rate",
              "grad_norm": "grad_norm", "global_norm": "grad_norm", "throughput": "throughput",
              "step_time": "step_time", "loss_scale": "loss_scale"}
MONITOR_MARK = "[Monitor]"
#: The units the text line writes after a value (`step_time: 0.5 s`); older lines have none.
_UNIT_SUFFIXES = {key: " " + unit for key, unit in UNITS.items()}


def _parse_text(text: str, at: int) -> dict:
    """Fields of an mfotel text line; `at` is the index of `[Monitor]` in `text`."""
    values: dict = {}
    try:
        # fast path: the writer's exact separators; float()/int() ignore the line end
        for part in text[at + 10:].split(", "):
            key, sep, raw = part.partition(": ")
            target = _TEXT_KEYS.get(key)
            if not sep:
                raise ValueError
            if target is not None:
                values[target] = float(raw.removesuffix(_UNIT_SUFFIXES.get(key, "\0")))
            elif key == "step":
                values["step"] = int(raw)
            elif key == "epoch":
                values["epoch"] = int(raw)
    except ValueError:
        values = {}
    if "step" in values:
        if at > 0:
            values["time"] = _prefix_time(text[:at])
        return values
    return _parse_text_strict(text, at)


def _parse_text_strict(text: str, at: int) -> dict:
    """The careful parser: other spacing, `step: 5/100`, and a reason when the line is bad."""
    values: dict = {}
    for part in text[at + len(MONITOR_MARK):].split(","):
        key, sep, raw = part.partition(":")
        key = key.strip()
        if not sep:
            raise ValueError(f"expected 'key: value', got {part.strip()!r}")
        raw = raw.strip()
        if key == "step":
            values["step"] = int(raw.split("/", 1)[0])
        elif key == "epoch":
            values["epoch"] = int(raw.split("/", 1)[0])
        elif key in _TEXT_KEYS:
            try:
                values[_TEXT_KEYS[key]] = float(raw.removesuffix(_UNIT_SUFFIXES.get(key, "\0")))
            except ValueError:
                raise ValueError(f"{key}: {raw!r} is not a number") from None
        # other keys: newer writers may add fields; they carry nothing a Row holds
    if "step" not in values:
        raise ValueError("no step")
    if at > 0:
        values["time"] = _prefix_time(text[:at])
    return values


_JSON_KEYS = frozenset(("loss", "learning_rate", "grad_norm", "throughput", "step_time",
                        "loss_scale"))


def _parse_json(record: dict) -> dict:
    step = record.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        raise ValueError("no integer step")
    values: dict = {"step": step}
    for key, value in record.items():
        if key in _JSON_KEYS:
            if type(value) is not float:
                try:
                    value = _json_number(value)
                except ValueError as exc:
                    raise ValueError(f"{key}: {exc}") from None
            values[key] = value
        elif key == "time":
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                values["time"] = float(value)
        elif key in ("epoch", "rank"):
            if isinstance(value, int) and not isinstance(value, bool):
                values[key] = value
    return values


_MF_STEP = re.compile(r"\{ Epoch:\[\s*(\d+)/\s*(\d+)\], step:\[\s*(\d+)/\s*(\d+)\], (.*)$")
_MF_PROGRESS = re.compile(r"(\S+) samples/s/p")
_MF_KEYS = {"lr": "learning_rate", "global_norm": "grad_norm", "loss_scale": "loss_scale"}


def _parse_mindformers(text: str) -> dict:
    """Fields of an MFLossMonitor step line (sink `loss: x` or non-sink `loss:[x/mean]`)."""
    match = _MF_STEP.search(text)
    if match is None:
        raise ValueError("MFLossMonitor line without '{ Epoch:[e/E], step:[s/S], '")
    epoch, _, step_in_epoch, steps_per_epoch = (int(g) for g in match.groups()[:4])
    values: dict = {"epoch": epoch, "step": (epoch - 1) * steps_per_epoch + step_in_epoch}
    for part in match.group(5).rstrip().split(", "):
        key, _, raw = part.partition(":")
        key, raw = key.strip(), raw.strip()
        try:
            if key == "loss":
                values["loss"] = float(raw.strip("[]").split("/", 1)[0])
            elif key == "per_step_time":
                if not raw.endswith("ms"):
                    raise ValueError("expected milliseconds")
                values["step_time"] = float(raw[:-2]) / 1000.0
            elif key in _MF_KEYS:
                values[_MF_KEYS[key]] = _number(raw)
            elif key == "overflow cond":
                values["overflow"] = "True" in raw
        except (ValueError, IndexError):
            raise ValueError(f"{key}: {raw!r} is not a number") from None
    if "loss" not in values:
        raise ValueError("no loss")
    at = text.find("{ Epoch:[")
    if at > 0:
        values["time"] = _prefix_time(text[:at])
    return values


# --- the streaming parser ------------------------------------------------------------------

_B_MONITOR = MONITOR_MARK.encode()
_B_EPOCH = b"{ Epoch:["
_B_PROGRESS = b"samples/s/p"
_PROGRESS_EVERY = 1 << 16   # lines between progress callbacks


def parse_lines(lines: Iterable[bytes | str], run: str = "run", rank: int = 0,
                path: str = "<lines>", report: ParseReport | None = None,
                progress: Progress | None = None) -> Iterator[Row]:
    """Rows from an iterable of lines (bytes or str), in order.

    A row is held back until the next row arrives: MFLossMonitor prints the throughput on the
    line after the step line, and a console log may carry an mfotel line and an MFLossMonitor
    line for the same step; those are merged into one row (values already set win).
    """
    report = report if report is not None else ParseReport()
    pending: Row | None = None
    line_no = 0
    consumed = 0
    for line_no, raw in enumerate(lines, 1):
        if isinstance(raw, str):
            raw = raw.encode("utf-8", "surrogateescape")
        if progress is not None:
            consumed += len(raw)
            if line_no % _PROGRESS_EVERY == 0:
                progress(consumed)
                consumed = 0
        if _B_MONITOR in raw:
            kind = "mfotel-text"
        elif raw[:2] == b'{"' or raw[:1].isspace() and raw.lstrip()[:2] == b'{"':
            kind = "mfotel-json"
        elif _B_EPOCH in raw:
            kind = "mindformers"
        elif _B_PROGRESS in raw:
            text = raw.decode("utf-8", "replace")
            match = _MF_PROGRESS.search(text)
            if pending is None or "mindformers" not in pending.source:
                report.add_problem(path, line_no, "MFLossMonitor progress line without a step line",
                                   text)
                continue
            try:
                if match is None:
                    raise ValueError
                throughput = float(match.group(1))
            except ValueError:
                report.add_problem(path, line_no, "MFLossMonitor progress line: no samples/s/p",
                                   text)
                continue
            if pending.throughput is None:
                pending.throughput = throughput
            continue
        else:
            continue
        text = raw.decode("utf-8", "replace").rstrip("\r\n")
        try:
            if kind == "mfotel-text":
                values = _parse_text(text, text.find(MONITOR_MARK))
            elif kind == "mfotel-json":
                try:
                    record = json.loads(text)
                except ValueError as exc:
                    raise ValueError(f"invalid JSON ({exc.msg} at column {exc.colno})") from None
                if not isinstance(record, dict):
                    continue
                if "step" not in record and not any(key in record for key in METRICS):
                    continue    # some other JSON log line
                values = _parse_json(record)
            else:
                values = _parse_mindformers(text)
        except (ValueError, OverflowError) as exc:
            report.add_problem(path, line_no, f"{kind}: {exc}", text)
            continue
        row_rank = values.pop("rank", rank)
        if (pending is not None and pending.step == values["step"]
                and pending.rank == row_rank):
            for key, value in values.items():
                if getattr(pending, key) is None:
                    setattr(pending, key, value)
            if kind not in pending.source:
                pending.source += "+" + kind
            continue
        if pending is not None:
            report.rows += 1
            yield pending
        pending = Row(run=run, rank=row_rank, line=line_no, path=path, source=kind, **values)
    if pending is not None:
        report.rows += 1
        yield pending
    report.lines += line_no
    if progress is not None and consumed:
        progress(consumed)


def parse_file(path: str | Path, run: str | None = None, rank: int | None = None,
               report: ParseReport | None = None,
               progress: Progress | None = None) -> Iterator[Row]:
    """Rows of one file; run name and rank default to what the path says (see `run_name`)."""
    path = Path(path)
    report = report if report is not None else ParseReport()
    report.files += 1
    with open(path, "rb") as handle:
        yield from parse_lines(handle, run=run or run_name(path),
                               rank=rank_from_path(path) if rank is None else rank,
                               path=str(path), report=report, progress=progress)


# --- runs: which files, which name, which rank ---------------------------------------------

_RANK_STEM = re.compile(r"(?:rank|monitor|worker)[_-]?(\d+)$")
_RANK_DIR = re.compile(r"^rank[_-]?(\d+)$")
_GENERIC_STEMS = re.compile(r"^(?:train_monitor|monitor|info|worker|stdout|stderr|console|output)"
                            r"(?:[_-]?(?:rank[_-]?)?\d+)?$")
_GENERIC_DIRS = re.compile(r"^(?:rank[_-]?\d+|logs?|output|outputs|monitor_logs)$")
_MF_INFO = re.compile(r"^info\.log(?:\.(\d+))?$")
_MONITOR_SUFFIXES = (".log", ".jsonl", ".json", ".txt")


def rank_from_path(path: Path) -> int:
    """`train_monitor_3.log` -> 3, `.../rank_3/info.log` -> 3, else 0."""
    stem = path.name.split(".", 1)[0]
    match = _RANK_STEM.search(stem)
    if match:
        return int(match.group(1))
    for parent in path.parents:
        match = _RANK_DIR.match(parent.name)
        if match:
            return int(match.group(1))
    return 0


def run_name(path: Path) -> str:
    """A directory's name; a file's stem unless generic (`train_monitor_0`, `info`), in which
    case the nearest directory above it that is not `rank_N`, `log`, `output`, `monitor_logs`."""
    path = Path(path).absolute()
    if path.is_dir():
        return path.name or str(path)
    stem = path.name.split(".", 1)[0]
    if not _GENERIC_STEMS.match(stem):
        return stem
    for parent in path.parents:
        if parent.name and not _GENERIC_DIRS.match(parent.name):
            return parent.name
    return stem


@dataclass
class Run:
    """A named run and the log files that make it up, in reading order."""
    name: str
    files: list[Path]
    root: Path

    def total_bytes(self) -> int:
        return sum(path.stat().st_size for path in self.files)


def _monitor_files(directory: Path) -> tuple[list[Path], list[Path]]:
    """(mfotel monitor files, mindformers info.log files) under `directory`, sorted."""
    monitor: list[Path] = []
    info: list[tuple[Path, int]] = []
    for path in sorted(directory.rglob("*")):
        if not path.is_file():
            continue
        match = _MF_INFO.match(path.name)
        if match:
            # RotatingFileHandler: info.log.N is older than info.log.N-1, info.log the newest
            info.append((path, -int(match.group(1) or 0)))
        elif "monitor" in path.name and path.suffix in _MONITOR_SUFFIXES:
            monitor.append(path)
    info.sort(key=lambda item: (str(item[0].parent), item[1]))
    return monitor, [path for path, _ in info]


def discover(arg: str | Path, name: str | None = None) -> Run:
    """The run a command-line RUN argument names: a log file, or a directory holding mfotel
    monitor files (`*monitor*.log|.jsonl`) or, failing those, mindformers `info.log` files."""
    path = Path(arg)
    if path.is_file():
        return Run(name or run_name(path), [path], path.parent)
    if not path.is_dir():
        raise FileNotFoundError(f"{arg}: no such file or directory")
    monitor, info = _monitor_files(path)
    files = monitor or info
    if not files:
        raise FileNotFoundError(f"{arg}: no monitor logs found (looked for *monitor*.log, "
                                f"*monitor*.jsonl and mindformers info.log)")
    return Run(name or run_name(path), files, path)


def discover_runs(args: Sequence[str | Path], names: Sequence[str] | None = None) -> list[Run]:
    """Runs for RUN arguments, with unique names (`exp`, `exp-2`, ...)."""
    names = list(names or [])
    runs: list[Run] = []
    seen: dict[str, int] = {}
    for index, arg in enumerate(args):
        run = discover(arg, names[index] if index < len(names) else None)
        count = seen.get(run.name, 0) + 1
        seen[run.name] = count
        if count > 1:
            run.name = f"{run.name}-{count}"
        runs.append(run)
    return runs


def iter_rows(runs: Iterable[Run], report: ParseReport | None = None,
              progress: Progress | None = None) -> Iterator[Row]:
    """Rows of every file of every run, in order."""
    report = report if report is not None else ParseReport()
    for run in runs:
        for path in run.files:
            yield from parse_file(path, run=run.name, report=report, progress=progress)


def is_finite(value: float | None) -> bool:
    """True for a finite number; False for None, NaN and ±Inf."""
    return value is not None and math.isfinite(value)


def is_nonfinite(value: float | None) -> bool:
    """True for NaN and ±Inf only (None is missing, not non-finite)."""
    return value is not None and not math.isfinite(value)
