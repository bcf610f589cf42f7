"""Console and file monitor lines (`[Monitor] step: 50, loss: 2.345, ..., time: <ISO 8601>`).

The text line starts as the seed writes it and ends with the wall-clock time of the record,
local time with its UTC offset and milliseconds (`time: 2025-12-02T18:30:00.123+08:00`). The
time field is always last and has a fixed shape, so a reader can tell a whole line from one
cut short (a full disk, a killed process) and place the line in time without being told when
the run started.

Lines are formatted and written off the training thread: the callback hands each record to a
`LineWriter` (one queue put), whose thread writes the lines in the order they were submitted.
`flush()` returns once every line submitted before it is written; the monitor flushes when
the run ends (close, a terminating signal through mfotel.lifecycle, interpreter exit).
"""
from __future__ import annotations

import errno
import json
import math
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, tzinfo
from pathlib import Path
from typing import IO, Protocol

from .time_account import LINE_FIELDS as ACCOUNT_FIELDS
from .time_account import LINE_STEPS as ACCOUNT_STEPS

PREFIX = "[Monitor]"
TIME_KEY = "time"


def _general(value: float) -> str:
    return f"{value:.6g}"


def _scientific(value: float) -> str:
    return f"{value:.6e}" if math.isfinite(value) else f"{value:.6g}"


@dataclass(frozen=True)
class LineField:
    """How one metric appears in the text line: its key, how its value is written, and the
    unit written right after it (`" s"` -> `step_time: 0.12 s`; the parser strips it)."""
    key: str
    format: Callable[[float], str] = _general
    unit: str = ""


#: The text line's fields by metric name (the order of the line is the order of `values`).
#: Changing what a field is called or how it is written is a change of its row here; the log
#: parser reads the keys from this table. Metrics not listed are written `name: 6 digits`.
LINE_FIELDS: dict[str, LineField] = {
    "loss": LineField("loss"),
    "learning_rate": LineField("learning_rate", _scientific),
    "grad_norm": LineField("grad_norm"),
    # units as README "Time figures" defines them; the JSON line holds bare numbers
    "throughput": LineField("throughput", unit=" samples/s"),
    "step_time": LineField("step_time", unit=" s"),
    # the time account (mfotel.time_account), when the line carries it: totals to the
    # millisecond, whatever they grow to (6 digits would lose seconds after 11 days)
    ACCOUNT_STEPS: LineField(ACCOUNT_STEPS, lambda value: f"{value:.0f}"),
    **{name: LineField(name, lambda value: f"{value:.3f}", " s")
       for name in ACCOUNT_FIELDS if name != ACCOUNT_STEPS},
}


def line_field(name: str) -> LineField:
    return LINE_FIELDS.get(name) or LineField(name)


def format_value(name: str, value: float) -> str:
    """Learning rates in scientific notation, everything else with 6 significant digits."""
    return line_field(name).format(value)


_zone: list[tuple[int, tzinfo | None]] = [(-1, None)]   # (minute, local zone at that minute)


def format_time(now: float) -> str:
    """`2025-12-02T18:30:00.123+08:00`: local time, milliseconds, the UTC offset."""
    minute = int(now // 60)
    cached, zone = _zone[0]
    if cached != minute:  # the offset can change (DST) only at a minute's start
        zone = datetime.fromtimestamp(now).astimezone().tzinfo
        _zone[0] = (minute, zone)
    return datetime.fromtimestamp(now, zone).isoformat(timespec="milliseconds")


def format_line(step: int, values: Mapping[str, float | None], now: float | None = None) -> str:
    """The seed's line plus the time: `[Monitor] step: 50, loss: 2.345, learning_rate:
    1.000000e-05, time: 2025-12-02T18:30:00.123+08:00`; missing values are left out."""
    parts = [f"step: {step}"]
    for name, value in values.items():
        if value is not None:
            field = line_field(name)
            parts.append(f"{field.key}: {field.format(value)}{field.unit}")
    parts.append(f"{TIME_KEY}: {format_time(time.time() if now is None else now)}")
    return f"{PREFIX} {', '.join(parts)}"


def _json_number(value: float | None) -> float | str | None:
    if value is None or math.isfinite(value):
        return value
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def format_json(step: int, epoch: int, rank: int, job_name: str,
                values: Mapping[str, float | None], now: float | None = None) -> str:
    """One JSON line; NaN/Inf written as the strings "nan", "inf", "-inf" (strict JSON)."""
    record: dict[str, object] = {"time": round(time.time() if now is None else now, 3),
                                 "job_name": job_name, "rank": rank, "step": step, "epoch": epoch}
    record.update({name: _json_number(v) for name, v in values.items() if v is not None})
    return json.dumps(record, allow_nan=False)


class ConsoleSink:
    """Writes monitor lines to a stream (stdout by default): the seed's line, for people."""

    keeps_records = False   # no time account fields (FileSink.keeps_records)

    def __init__(self, stream: IO[str] | None = None) -> None:
        self.stream = stream

    def write(self, line: str) -> None:
        stream = self.stream or sys.stdout
        stream.write(line + "\n")
        stream.flush()


class FileSink:
    """Appends each line whole or not at all; opened on construction so errors surface early.

    A line is one `os.write` of its encoded bytes and newline on an O_APPEND descriptor (no
    buffer that a failed flush could leave half written). When the disk fills up mid-line
    the short write is undone (truncated back) when no one appended after it; otherwise the
    next line starts with a newline, so a cut line never has the next one glued to it. If the
    file or its directory is removed while training, it is created again (a stat per record)
    rather than writing on into an unlinked file. A FIFO at the path never blocks: no
    reader, or a reader that does not read, is an error of that write.

    Its lines are the run's record: they also carry the time account's fields (`account_*`,
    mfotel.time_account), which `mfotel goodput` reads.
    """

    keeps_records = True

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._fd: int | None = None
        self._fresh_line = False      # the file may end mid-line: start the next on a new one
        self._open()

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # O_NONBLOCK: regular files ignore it; a FIFO (or pipe, terminal) at the path must
        # fail (no reader: ENXIO; full: EAGAIN) rather than stall the training step.
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
                               | os.O_NONBLOCK, 0o666)
        except OSError as exc:
            if exc.errno != errno.ENXIO:
                raise
            raise OSError(errno.ENXIO, "a FIFO that no process reads: start its reader first, "
                                       "or point output.file_path at a regular file",
                          str(self.path)) from None

    def write(self, line: str) -> None:
        if self._fd is None or not os.path.exists(self.path):
            self.close()
            self._open()
            self._fresh_line = False   # a new file
        assert self._fd is not None
        data = (b"\n" if self._fresh_line else b"") + line.encode("utf-8") + b"\n"
        written = os.write(self._fd, data)
        if written == len(data):
            self._fresh_line = False
            return
        # Short write: the disk (or RLIMIT_FSIZE) ran out mid-line. Undone, the file is as
        # it was before this write; left in place, the file now ends mid-line.
        if not self._undo(written):
            self._fresh_line = True
        raise OSError(errno.ENOSPC, f"monitor line cut short after {written} of {len(data)} "
                                    f"bytes (disk full?)", str(self.path))

    def _undo(self, written: int) -> bool:
        """Truncate the `written` bytes of a cut line away; False when that is not safe."""
        assert self._fd is not None
        try:
            end = os.lseek(self._fd, 0, os.SEEK_CUR)     # O_APPEND: the end of our write
            if os.fstat(self._fd).st_size != end:
                return False                             # someone appended after us
            os.ftruncate(self._fd, end - written)
            return True
        except OSError:
            return False

    def close(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass  # nothing is buffered: every line was written (or not) by os.write
            self._fd = None


class Sink(Protocol):
    def write(self, line: str) -> None:
        """Write one whole line (without its newline); raise on failure."""


class _Flush:
    """A marker in the queue: set once every line before it was written."""

    def __init__(self) -> None:
        self.done = threading.Event()


_STOP = object()


class LineWriter:
    """Formats and writes monitor lines on a thread of its own, in submission order.

        writer = LineWriter([(ConsoleSink(), False), (FileSink(path), True)], rank=0,
                            job_name="llama", on_error=count)   # (sink, JSON?) pairs
        writer.submit(step, epoch, values, time.time())  # the training thread: a queue append
        writer.submit(step, epoch, values, time.time(), record)  # record fields: files only
        writer.flush()   # every line submitted so far is written (bounded wait)
        writer.close()   # flush, stop the thread, close the file sinks

    The thread wakes every BATCH_SECONDS (at once for flush and close) and writes what
    waits: one wake per batch, not per line, and the training thread never waits for it.
    A failing sink (a full disk, a closed stream) is reported through `on_error(exc)` and
    the other sinks still get the line. `values` must not change after submit().
    Should the sinks stop taking lines (a console pipe nobody reads), at most MAX_PENDING
    lines wait; further ones are dropped and reported, so memory stays bounded.
    """

    MAX_PENDING = 10_000
    FLUSH_SECONDS = 2.0
    BATCH_SECONDS = 0.05

    def __init__(self, sinks: Sequence[tuple[Sink, bool]], rank: int, job_name: str,
                 on_error: Callable[[BaseException], None] = lambda exc: None) -> None:
        self.sinks = list(sinks)
        #: whether a sink keeps records (`keeps_records`, FileSink's): submit()'s `record`
        #: fields are written only to those
        self.keeps_records = any(getattr(sink, "keeps_records", False) for sink, _ in sinks)
        self.rank, self.job_name, self.on_error = rank, job_name, on_error
        self.dropped = 0
        self._queue: deque[object] = deque()   # append / popleft: thread-safe
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._start_lock = threading.Lock()

    def submit(self, step: int, epoch: int, values: Mapping[str, float | None],
               wall: float, record: Mapping[str, float] | None = None) -> None:
        """Queue the lines of one record (training thread); after close(), write them here.
        `record`: fields after `values` for the sinks that keep records (the time account's),
        left out of the others' lines (the console's)."""
        if self._thread is None:
            if self._closed:
                self._write(step, epoch, values, wall, record)
                return
            self._start()
        if len(self._queue) >= self.MAX_PENDING:
            self.dropped += 1
            self.on_error(OSError(errno.EAGAIN, f"{self.MAX_PENDING} monitor lines wait for "
                                                f"a sink that does not take them; line dropped"))
            return
        self._queue.append((step, epoch, values, wall, record))

    def _start(self) -> None:
        with self._start_lock:
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name="mfotel-lines",
                                                daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            self._wake.wait(self.BATCH_SECONDS)
            self._wake.clear()
            if self._drain():
                return

    def _drain(self) -> bool:
        """Write what waits, in order; True when the stop marker came."""
        queue = self._queue
        while queue:
            item = queue.popleft()
            if item is _STOP:
                return True
            if isinstance(item, _Flush):
                item.done.set()
            else:
                self._write(*item)  # type: ignore[misc]
        return False

    def _write(self, step: int, epoch: int, values: Mapping[str, float | None],
               wall: float, record: Mapping[str, float] | None = None) -> None:
        texts: dict[bool, str] = {}   # by whether the line has the record fields
        for sink, as_json in self.sinks:
            try:
                keeps = record is not None and getattr(sink, "keeps_records", False)
                fields = {**values, **record} if keeps and record is not None else values
                if as_json:
                    sink.write(format_json(step, epoch, self.rank, self.job_name, fields, wall))
                else:
                    if keeps not in texts:
                        texts[keeps] = format_line(step, fields, wall)
                    sink.write(texts[keeps])
            except Exception as exc:  # noqa: BLE001 - a full disk must not stop the others
                self.on_error(exc)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every line submitted so far is written; False if `timeout` (default
        FLUSH_SECONDS) passed first. Without a running thread the lines are written here."""
        thread = self._thread
        if thread is None or not thread.is_alive():
            self._drain()   # the writer is gone (after a fork, at interpreter exit)
            return True
        marker = _Flush()
        self._queue.append(marker)
        self._wake.set()
        return marker.done.wait(self.FLUSH_SECONDS if timeout is None else timeout)

    def close(self) -> None:
        """Flush, stop the thread and close the file sinks; idempotent."""
        flushed = self.flush()
        self._closed = True
        thread = self._thread
        if thread is not None and thread.is_alive():
            self._queue.append(_STOP)
            self._wake.set()
            if flushed:
                thread.join(self.FLUSH_SECONDS)
        self._thread = None  # lines submitted from now on are written by submit() itself
        for sink, _ in self.sinks:
            if isinstance(sink, FileSink):
                sink.close()
