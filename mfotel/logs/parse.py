"""Parse monitor logs into rows: mfotel text and JSON lines, mindformers MFLossMonitor lines.

One streaming parser (a generator; files are read in bounded lines, never whole) for three
formats, detected per line; each row says which one it came from (`Row.source`):

- `mfotel-text`, as written by the console and file sinks (a logger prefix may come first):
  `[Monitor] step: 50, loss: 2.345, time: 2025-12-02T18:30:00.123+08:00`
  (older mfotel versions wrote no `time` field: their lines are read too)
- `mfotel-json`: `{"time": 1764671400.123, "job_name": "demo", "rank": 0, "step": 50, ...}`
  (non-finite values as the strings "nan", "inf", "-inf")
- `mindformers-info`: mindformers `MFLossMonitor` lines of `output/log/rank_N/info.log` (or
  their console copy): `{ Epoch:[  1/  2], step:[    3/   10], loss:[10.2/10.3], ...`
  followed by a progress line carrying the throughput (`... 12.34 samples/s/p  0:00:05 }`).

Rows of different sources are never merged: the same step logged by mfotel and by
MFLossMonitor gives two rows, because their throughput and step time measure different things.

A line cut short (full disk, killed writer) is never read as a value: JSON must parse whole;
a text line of a writer that stamps its lines must end with a whole `time` field; in a file,
a last text line without its line end is cut. Lines that look like monitor lines but do not
parse, and lines longer than `MAX_LINE_BYTES`, are counted in a `ParseReport` with their file
and line number; other log lines are ignored. Parsing is linear in the input size.

    report = ParseReport()
    for row in iter_rows(discover_runs(["runs/exp1"]), report=report):
        print(row.run, row.rank, row.source, row.step, row.loss)
    print(report.describe())
"""
from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import BinaryIO, TypeGuard

from ..sinks import LINE_FIELDS, TIME_KEY
from ..sinks import PREFIX as MONITOR_MARK
from ..time_account import LINE_FIELDS as ACCOUNT_FIELDS

#: The per-step values a row may carry, in display order.
METRICS: tuple[str, ...] = ("loss", "learning_rate", "grad_norm", "throughput", "step_time")

SOURCE_TEXT, SOURCE_JSON, SOURCE_MINDFORMERS = "mfotel-text", "mfotel-json", "mindformers-info"
#: Every source, most precise first (JSON keeps every digit; MFLossMonitor's throughput is
#: per device and its step time one step's): the order `backfill` prefers them in.
SOURCES: tuple[str, ...] = (SOURCE_JSON, SOURCE_TEXT, SOURCE_MINDFORMERS)

MAX_LINE_BYTES = 1 << 20     # no monitor line comes near it; bounds memory and time per line
MAX_STEP = 2 ** 53           # steps are exact as float64 (Prometheus sample values)
MAX_TIME = 253402300799.0    # 9999-12-31T23:59:59Z
MAX_RANK = 2 ** 31 - 1
MAX_JOB_NAME = 128           # as the monitor_config key

Progress = Callable[[int], None]
"""Called with the number of bytes consumed since the previous call."""


@dataclass(slots=True)
class Row:
    """One logged training step. Values are None when the log does not carry them.

    `throughput` is samples per second (per device for mindformers' `samples/s/p`),
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
    source: str = ""               # one of SOURCES
    job_name: str | None = None    # the job the line names (JSON lines carry it)
    account: dict[str, float] | None = None   # the time account's fields, when the line has them


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
            text = text[:400].rstrip("\r\n")
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

MAX_NUMBER_CHARS = 64      # a float64 never needs more; a longer "number" is not one


def _float(text: str) -> float:
    """float() of a logged number; a megabyte of digits is an error, not inf."""
    if len(text) > MAX_NUMBER_CHARS and len(text.strip()) > MAX_NUMBER_CHARS:
        raise ValueError(f"{len(text.strip())} characters")
    return float(text)


def _number(text: str) -> float | None:
    """`2.5`, `nan`, `-inf`, `[1.e-05]`, `[2.5 3.0]` (first element), `None` -> float or None."""
    text = text.strip()
    if text.startswith("["):
        inner = text.strip("[] ")
        text = inner.split(None, 1)[0] if inner else ""
    if text in ("None", "unavailable", ""):
        return None
    return _float(text)


def _json_number(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"boolean {value!r} is not a number")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        return float(value)       # "nan", "inf", "-inf"
    raise ValueError(f"{_short(value)} is not a number")


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _bounded_int(key: str, value: object, upper: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= upper:
        raise ValueError(f"{key}: {_short(value)} is not an integer in 0..{upper}")
    return value


def _unix_time(value: float) -> float:
    if not (math.isfinite(value) and 0.0 <= value <= MAX_TIME):
        raise ValueError(f"time: {value!r} is not a unix time (seconds since 1970, finite)")
    return value


_TIMESTAMP = re.compile(r"(\d{4})-(\d\d)-(\d\d)[ T](\d\d):(\d\d):(\d\d)(?:[,.](\d{1,6}))?")


def _prefix_time(prefix: str) -> float | None:
    """Unix time of a logger timestamp (`2025-12-02 10:30:00,123`, local time) in `prefix`;
    None when there is none or it is not a real date (a logger's field, not ours to judge)."""
    match = _TIMESTAMP.search(prefix, 0, 256)     # loggers put it first; bounded work
    if match is None:
        return None
    y, mo, d, h, mi, s, frac = match.groups()
    micro = int((frac or "0").ljust(6, "0"))
    try:
        return datetime(int(y), int(mo), int(d), int(h), int(mi), int(s), micro).timestamp()
    except (ValueError, OverflowError, OSError):
        return None


# The sink's time field, whole: a cut one (`2025-12-02T18:3`) does not match.
_LINE_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d{3}|\.\d{6})?(?:Z|[+-]\d\d:\d\d)")


def _line_time(raw: str) -> float:
    if _LINE_TIME.fullmatch(raw) is None:
        raise ValueError(f"time: {raw[:40]!r} is not a whole ISO 8601 time with its UTC offset "
                         f"(line cut short?)")
    try:
        return datetime.fromisoformat(raw.replace("Z", "+00:00")).timestamp()
    except (ValueError, OverflowError) as exc:
        raise ValueError(f"time: {raw!r}: {exc}") from None


# --- line parsers: text -> Row fields, or raise ValueError with a reason ---------------------

# Text keys -> Row attributes: the sink's table, the metric names themselves (older lines),
# and the names mindformers and others use.
_ROW_METRICS = frozenset((*METRICS, "loss_scale"))
_TEXT_KEYS: dict[str, str] = {name: name for name in _ROW_METRICS}
_TEXT_KEYS.update(lr="learning_rate", global_norm="grad_norm")
_TEXT_KEYS.update({spec.key: name for name, spec in LINE_FIELDS.items() if name in _ROW_METRICS})
_TEXT_UNITS: dict[str, str] = {spec.key: spec.unit for spec in LINE_FIELDS.values() if spec.unit}


_ACCOUNT_KEYS = frozenset(ACCOUNT_FIELDS)


def _account_value(key: str, raw: str | float) -> float:
    """A time account field: seconds or steps, finite and not negative."""
    try:
        value = _float(raw) if isinstance(raw, str) else float(raw)
    except ValueError:
        raise ValueError(f"{key}: {str(raw).strip()[:40]!r} is not a number") from None
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{key}: {value!r} is not a finite number >= 0")
    return value


def _parse_text(text: str, at: int) -> tuple[dict, bool]:
    """(fields, stamped) of an mfotel text line; `at` is the index of `[Monitor]` in `text`;
    `stamped` when the line ends with a whole `time` field."""
    body = text[at + len(MONITOR_MARK):]
    if MONITOR_MARK in body:
        raise ValueError("two monitor lines glued together (a write cut short, e.g. disk full)")
    values: dict = {}
    stamped = False
    parts = body.split(",")
    last = len(parts) - 1
    for index, part in enumerate(parts):
        key, sep, raw = part.partition(":")
        if not sep:
            raise ValueError(f"expected 'key: value', got {part.strip()[:40]!r}")
        key = key.strip()
        target = _TEXT_KEYS.get(key)
        if target is not None:
            if _TEXT_UNITS and key in _TEXT_UNITS:
                raw = raw.strip().removesuffix(_TEXT_UNITS[key])
            try:
                values[target] = _float(raw)     # float() ignores the spaces around it
            except ValueError:
                raise ValueError(f"{key}: {raw.strip()[:40]!r} is not a number") from None
        elif key in _ACCOUNT_KEYS:
            values.setdefault("account", {})[key] = _account_value(
                key, raw.strip().removesuffix(" s"))
        elif key == "step" or key == "epoch":
            head = raw.split("/", 1)[0].strip()
            if not (head.isascii() and head.isdigit()) or len(head) > 20:
                raise ValueError(f"{key}: {raw.strip()[:40]!r} is not a non-negative integer")
            values[key] = _bounded_int(key, int(head), MAX_STEP)
        elif key == TIME_KEY:
            if index != last:
                raise ValueError("time is not the last field")
            values["time"] = _unix_time(_line_time(raw.strip()))
            stamped = True
        # other keys: newer writers may add fields; they carry nothing a Row holds
    if "step" not in values:
        raise ValueError("no step")
    if at > 0 and not stamped:
        values["time"] = _prefix_time(text[:at])
    return values, stamped


_JSON_METRICS = _ROW_METRICS


def _parse_json(record: dict) -> dict:
    if "step" not in record:
        raise ValueError("no integer step")
    step = record["step"]
    if not isinstance(step, int) or isinstance(step, bool):
        raise ValueError(f"no integer step (step: {_short(step)})")
    values: dict = {"step": _bounded_int("step", step, MAX_STEP)}
    for key, value in record.items():
        if key in _JSON_METRICS:
            if type(value) is not float:
                try:
                    value = _json_number(value)
                except (ValueError, OverflowError) as exc:
                    raise ValueError(f"{key}: {exc}") from None
            values[key] = value
        elif key == "time":
            if value is None:
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ValueError(f"time: {_short(value)} is not unix seconds")
            try:
                values["time"] = _unix_time(float(value))
            except OverflowError:
                raise ValueError(f"time: {_short(value)} is not a unix time") from None
        elif key == "epoch":
            values["epoch"] = _bounded_int(key, value, MAX_STEP)
        elif key in _ACCOUNT_KEYS:
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ValueError(f"{key}: {_short(value)} is not a number")
            values.setdefault("account", {})[key] = _account_value(key, value)
        elif key == "rank":
            values["rank"] = _bounded_int(key, value, MAX_RANK)
        elif key == "job_name":
            if not isinstance(value, str) or not 0 < len(value) <= MAX_JOB_NAME:
                raise ValueError(f"job_name: {_short(value)} is not a name of 1 to "
                                 f"{MAX_JOB_NAME} characters")
            values["job_name"] = value
    return values


_MF_STEP = re.compile(r"\{ Epoch:\[\s*(\d{1,12})/\s*(\d{1,12})\], step:\[\s*(\d{1,12})/"
                      r"\s*(\d{1,12})\], (.*)$")
_MF_KEYS = {"lr": "learning_rate", "global_norm": "grad_norm", "loss_scale": "loss_scale"}
_PROGRESS_MARK = " samples/s/p"


def _parse_mindformers(text: str) -> dict:
    """Fields of an MFLossMonitor step line (sink `loss: x` or non-sink `loss:[x/mean]`)."""
    match = _MF_STEP.search(text)
    if match is None:
        raise ValueError("MFLossMonitor line without '{ Epoch:[e/E], step:[s/S], '")
    epoch, _, step_in_epoch, steps_per_epoch = (int(g) for g in match.groups()[:4])
    step = (max(epoch, 1) - 1) * steps_per_epoch + step_in_epoch
    values: dict = {"epoch": epoch, "step": _bounded_int("step", step, MAX_STEP)}
    for part in match.group(5).rstrip().split(", "):
        key, _, raw = part.partition(":")
        key, raw = key.strip(), raw.strip()
        try:
            if key == "loss":
                values["loss"] = _float(raw.strip("[]").split("/", 1)[0])
            elif key == "per_step_time":
                if not raw.endswith("ms"):
                    raise ValueError("expected milliseconds")
                values["step_time"] = _float(raw[:-2]) / 1000.0
            elif key in _MF_KEYS:
                values[_MF_KEYS[key]] = _number(raw)
            elif key == "overflow cond":
                values["overflow"] = "True" in raw
        except (ValueError, IndexError):
            raise ValueError(f"{key}: {raw[:40]!r} is not a number") from None
    if "loss" not in values:
        raise ValueError("no loss")
    at = text.find("{ Epoch:[")
    if at > 0:
        values["time"] = _prefix_time(text[:at])
    return values


def _progress_throughput(text: str) -> float:
    """`... 12.34 samples/s/p  0:00:05 }` -> 12.34 (the token before the first mark)."""
    at = text.find(_PROGRESS_MARK)
    head = text[:at].rstrip() if at >= 0 else ""
    token = head[max(head.rfind(" "), head.rfind("\t"), head.rfind("|")) + 1:]
    if not token:
        raise ValueError("MFLossMonitor progress line: no samples/s/p")
    try:
        return _float(token)
    except ValueError:
        raise ValueError(f"MFLossMonitor progress line: {token[:40]!r} samples/s/p is not a "
                         f"number") from None


# --- the streaming parser ------------------------------------------------------------------

_B_MONITOR = MONITOR_MARK.encode()
_B_EPOCH = b"{ Epoch:["
_B_PROGRESS = b"samples/s/p"
_PROGRESS_EVERY = 1 << 14   # lines between progress callbacks
_NO_ROWS: tuple[Row, ...] = ()


class _Overlong(bytes):
    """The start of a line longer than the limit; `size` is its full length in bytes."""
    size: int


def _line_kind(raw: bytes) -> str | None:
    if _B_MONITOR in raw:
        return SOURCE_TEXT
    stripped = raw.lstrip()
    if stripped[:2] == b'{"':
        return SOURCE_JSON
    if _B_EPOCH in raw:
        return SOURCE_MINDFORMERS
    if _B_PROGRESS in raw:
        return "progress"
    return None


class _LineParser:
    """The state of one parse: rows held back until the lines after them say they are whole.

    - A MindFormers step row waits for its progress line (the throughput).
    - An unstamped text row waits while the input has shown no stamped text line: if one
      follows, the writer stamps its lines and the unstamped one was cut short.
    """

    def __init__(self, run: str, rank: int, path: str, report: ParseReport) -> None:
        self.run, self.rank, self.path, self.report = run, rank, path, report
        self.mindformers: Row | None = None
        self.unstamped: tuple[Row, str] | None = None     # the row and its line's text
        self.stamped_seen = False

    def problem(self, line: int, reason: str, text: str) -> None:
        self.report.add_problem(self.path, line, reason, text)

    def feed(self, line_no: int, raw: bytes, ended: bool) -> tuple[Row, ...]:
        """Rows completed by line `line_no` (usually none or one); `ended`: the line had its
        line end. A tuple, not a generator: this runs once per line."""
        if raw.__class__ is _Overlong:
            self.problem(line_no, f"line of {raw.size} bytes is longer than the "
                                  f"{MAX_LINE_BYTES}-byte limit; skipped", _text(raw[:200]))
            return _NO_ROWS
        kind = _line_kind(raw)
        if kind is None:
            return _NO_ROWS
        text = _text(raw)
        if kind == "progress":
            self.progress(line_no, text)
            return _NO_ROWS
        try:
            values, stamped = self.values(kind, text)
        except (ValueError, OverflowError) as exc:
            self.problem(line_no, f"{kind}: {exc}", text)
            return _NO_ROWS
        if values is None:
            return _NO_ROWS
        row = Row(run=self.run, rank=values.pop("rank", self.rank), line=line_no,
                  path=self.path, source=kind, **values)
        if kind == SOURCE_JSON:
            return (row,)
        held: Row | None
        if kind == SOURCE_MINDFORMERS:
            held, self.mindformers = self.mindformers, row
            return _NO_ROWS if held is None else (held,)
        if stamped:
            self.stamped_seen = True
            if self.unstamped is not None:
                self.cut_short(*self.unstamped, "no time field while the next monitor line has "
                                                "one; or written by an older mfotel")
                self.unstamped = None
            return (row,)
        if self.stamped_seen:
            self.cut_short(row, text, "no time field while the lines before it have one")
        elif not ended:
            self.cut_short(row, text, "no line end")
        else:
            previous, self.unstamped = self.unstamped, (row, text)
            return _NO_ROWS if previous is None else (previous[0],)
        return _NO_ROWS

    def values(self, kind: str, text: str) -> tuple[dict | None, bool]:
        if kind == SOURCE_TEXT:
            return _parse_text(text, text.find(MONITOR_MARK))
        if kind == SOURCE_MINDFORMERS:
            return _parse_mindformers(text), False
        try:
            record = json.loads(text)
        except ValueError as exc:
            message = getattr(exc, "msg", str(exc))
            column = getattr(exc, "colno", None)
            raise ValueError(f"invalid JSON ({message}" +
                             (f" at column {column})" if column else ")")) from None
        except RecursionError:
            raise ValueError("invalid JSON (nested too deeply)") from None
        if not isinstance(record, dict):
            return None, False
        if "step" not in record and not any(key in record for key in METRICS):
            return None, False      # some other JSON log line
        return _parse_json(record), False

    def cut_short(self, row: Row, text: str, why: str) -> None:
        self.problem(row.line, f"{SOURCE_TEXT}: line cut short ({why}); step {row.step} "
                               f"not read", text)

    def progress(self, line_no: int, text: str) -> None:
        if self.mindformers is None:
            self.problem(line_no, "MFLossMonitor progress line without a step line", text)
            return
        try:
            throughput = _progress_throughput(text)
        except ValueError as exc:
            self.problem(line_no, str(exc), text)
            return
        if self.mindformers.throughput is None:
            self.mindformers.throughput = throughput

    def finish(self) -> Iterator[Row]:
        if self.unstamped is not None:
            yield self.unstamped[0]
        if self.mindformers is not None:
            yield self.mindformers
        self.unstamped = self.mindformers = None


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "replace").rstrip("\r\n")


def parse_lines(lines: Iterable[bytes | str], run: str = "run", rank: int = 0,
                path: str = "<lines>", report: ParseReport | None = None,
                progress: Progress | None = None, require_line_end: bool = False
                ) -> Iterator[Row]:
    """Rows from an iterable of lines (bytes or str), in order per source.

    `require_line_end`: the lines come from a file, so one without its line end (the last)
    was cut short when it is an unstamped text line.
    """
    report = report if report is not None else ParseReport()
    parser = _LineParser(run, rank, path, report)
    line_no = 0
    consumed = 0
    for line_no, raw in enumerate(lines, 1):
        if isinstance(raw, str):
            raw = raw.encode("utf-8", "surrogateescape")
        size = raw.size if raw.__class__ is _Overlong else len(raw)
        if progress is not None:
            consumed += size
            if line_no % _PROGRESS_EVERY == 0:
                progress(consumed)
                consumed = 0
        if size > MAX_LINE_BYTES + 2 and raw.__class__ is not _Overlong:
            raw = _overlong(raw[:200], size)
        for row in parser.feed(line_no, raw, not require_line_end or raw.endswith(b"\n")):
            report.rows += 1
            yield row
    for row in parser.finish():
        report.rows += 1
        yield row
    report.lines += line_no
    if progress is not None and consumed:
        progress(consumed)


def _overlong(start: bytes, size: int) -> _Overlong:
    line = _Overlong(start)
    line.size = size
    return line


def read_lines(handle: BinaryIO, limit: int = MAX_LINE_BYTES) -> Iterator[bytes]:
    """Lines of a binary file, each at most `limit` bytes (plus its line end) in memory; a
    longer line comes out as an `_Overlong` holding its start and its size."""
    chunk = limit + 2          # room for "\r\n"
    while True:
        line = handle.readline(chunk)
        if not line:
            return
        if len(line) < chunk or line.endswith(b"\n"):
            yield line
            continue
        size, start = len(line), line[:200]
        while not line.endswith(b"\n"):
            line = handle.readline(chunk)
            if not line:
                break
            size += len(line)
        yield _overlong(start, size)


def parse_file(path: str | Path, run: str | None = None, rank: int | None = None,
               report: ParseReport | None = None,
               progress: Progress | None = None) -> Iterator[Row]:
    """Rows of one file; run name and rank default to what the path says (see `run_name`)."""
    path = Path(path)
    report = report if report is not None else ParseReport()
    report.files += 1
    with open(path, "rb") as handle:
        yield from parse_lines(read_lines(handle), run=run or run_name(path),
                               rank=rank_from_path(path) if rank is None else rank,
                               path=str(path), report=report, progress=progress,
                               require_line_end=True)


# --- runs: which files, which name, which rank ---------------------------------------------

_RANK_STEM = re.compile(r"(?:rank|monitor|worker)[_-]?(\d{1,9})$")
_RANK_DIR = re.compile(r"^rank[_-]?(\d{1,9})$")
_GENERIC_STEMS = re.compile(r"^(?:train_monitor|monitor|info|worker|stdout|stderr|console|output)"
                            r"(?:[_-]?(?:rank[_-]?)?\d+)?$")
_GENERIC_DIRS = re.compile(r"^(?:rank[_-]?\d+|logs?|output|outputs|monitor_logs)$")
_MF_INFO = re.compile(r"^info\.log(?:\.(\d{1,6}))?$")


def _rotation(path: Path) -> int:
    """N of mindformers' info.log.N, 0 for info.log (RotatingFileHandler: larger is older)."""
    match = _MF_INFO.match(path.name)
    return int(match.group(1) or 0) if match else 0


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


# What a file holds, from its first SNIFF_BYTES.
KIND_MONITOR = "monitor"            # mfotel's own file: monitor lines only (text or JSON)
KIND_INFO = "mindformers-info"      # mindformers' info.log (or a rotated info.log.N)
KIND_CAPTURE = "console"            # monitor lines among other output (a console capture)
SNIFF_BYTES = 256 * 1024
MAX_FILES = 10_000                  # files looked at under one directory
_NOT_LOGS = frozenset((".ckpt", ".safetensors", ".npy", ".npz", ".pb", ".mindir", ".om", ".png",
                       ".svg", ".pdf", ".jpg", ".jpeg", ".gif", ".gz", ".zip", ".tar", ".tgz",
                       ".xz", ".bz2", ".so", ".pyc", ".py", ".csv", ".yaml", ".yml", ".db"))


def _head_lines(path: Path) -> tuple[bytes, list[bytes]] | None:
    """The first SNIFF_BYTES of a file and its whole lines; None when it cannot be read."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(SNIFF_BYTES)
    except OSError:
        return None
    lines = head.splitlines(keepends=True)
    if len(head) == SNIFF_BYTES and len(lines) > 1:
        lines.pop()                                     # cut by this read, not the writer
    return head, lines


def sniff(path: Path) -> str | None:
    """KIND_MONITOR, KIND_INFO, KIND_CAPTURE, or None: what the first SNIFF_BYTES hold."""
    read = _head_lines(path)
    if read is None:
        return None
    head, lines = read
    report = ParseReport(max_problems=0)
    sources = [row.source for row in parse_lines(lines, path=str(path), report=report)]
    if _MF_INFO.match(path.name) and (SOURCE_MINDFORMERS in sources or b"mindformers" in head):
        return KIND_INFO
    if not sources:
        return None
    nonempty = sum(1 for line in lines if line.strip())
    # mfotel's own file holds monitor lines only; a console capture holds other output too
    # (at least mfotel's "writes monitor lines to ..." note) and repeats the file's lines
    if SOURCE_MINDFORMERS not in sources and len(sources) + report.problem_count >= nonempty:
        return KIND_MONITOR
    return KIND_CAPTURE


def line_job_names(run: Run) -> set[str]:
    """The job names the run's lines carry (JSON lines do; text lines and info.log do not),
    read from the first SNIFF_BYTES of each file."""
    names: set[str] = set()
    for path in run.files:
        read = _head_lines(path)
        if read is not None:
            rows = parse_lines(read[1], path=str(path), report=ParseReport(max_problems=0))
            names.update(row.job_name for row in rows if row.job_name)
    return names


@dataclass
class Run:
    """A named run and the log files that make it up, in reading order; `kinds` says what
    each file of a directory holds (KIND_*)."""
    name: str
    files: list[Path]
    root: Path
    kinds: dict[Path, str] = field(default_factory=dict)

    def total_bytes(self) -> int:
        return sum(path.stat().st_size for path in self.files)


def _candidates(directory: Path) -> Iterator[Path]:
    """Regular files under `directory` that may be logs, sorted per directory; hidden
    directories and files of known non-log types are skipped."""
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
        for name in sorted(files):
            path = Path(root, name)
            if (not name.startswith(".") and path.suffix.lower() not in _NOT_LOGS
                    and path.is_file()):
                yield path


def _log_files(directory: Path) -> tuple[list[Path], dict[Path, str], int]:
    """(files to read, their kinds, files looked at): mfotel monitor files and info.logs, or,
    when there are none, console captures (they repeat the others' lines)."""
    kinds: dict[Path, str] = {}
    looked = 0
    for looked, path in enumerate(_candidates(directory), 1):
        if looked > MAX_FILES:
            raise FileNotFoundError(f"{directory}: more than {MAX_FILES} files under it; point "
                                    f"at the directory holding the logs, or at a log file")
        kind = sniff(path)
        if kind is not None:
            kinds[path] = kind
    own = [p for p, k in kinds.items() if k in (KIND_MONITOR, KIND_INFO)]
    if own:
        kinds = {p: kinds[p] for p in own}
    monitor = [p for p, k in kinds.items() if k != KIND_INFO]
    # RotatingFileHandler: info.log.N is older than info.log.N-1, info.log the newest
    info = sorted((p for p, k in kinds.items() if k == KIND_INFO),
                  key=lambda p: (str(p.parent), -_rotation(p)))
    return monitor + info, kinds, looked


def discover(arg: str | Path, name: str | None = None) -> Run:
    """The run a command-line RUN argument names: a log file (read whole, whatever it holds),
    or a directory, whose files are recognised by their content: mfotel monitor files (text or
    JSON lines) and mindformers info.log files, or, only when it holds neither, console
    captures holding monitor lines."""
    path = Path(arg)
    if path.is_file():
        return Run(name or run_name(path), [path], path.parent)
    if not path.is_dir():
        raise FileNotFoundError(f"{arg}: no such file or directory")
    files, kinds, looked = _log_files(path)
    if not files:
        raise FileNotFoundError(
            f"{arg}: no monitor logs found: none of the {looked} file(s) under it holds "
            f"[Monitor] lines, mfotel JSON lines or mindformers MFLossMonitor lines in its "
            f"first {SNIFF_BYTES // 1024} KiB (name a log file to read it whole)")
    return Run(name or run_name(path), files, path, kinds)


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


def is_finite(value: float | None) -> TypeGuard[float]:
    """True for a finite number; False for None, NaN and ±Inf."""
    return value is not None and math.isfinite(value)


def is_nonfinite(value: float | None) -> bool:
    """True for NaN and ±Inf only (None is missing, not non-finite)."""
    return value is not None and not math.isfinite(value)
