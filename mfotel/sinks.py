"""Console and file monitor lines (`[Monitor] step: 50, loss: 2.345, ..., time: <ISO 8601>`).

The text line starts as the seed writes it and ends with the wall-clock time of the record,
local time with its UTC offset and milliseconds (`time: 2025-12-02T18:30:00.123+08:00`). The
time field is always last and has a fixed shape, so a reader can tell a whole line from one
cut short (a full disk, a killed process) and place the line in time without being told when
the run started.
"""
from __future__ import annotations

import errno
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import IO, Callable, Mapping

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
}


def line_field(name: str) -> LineField:
    return LINE_FIELDS.get(name) or LineField(name)


def format_value(name: str, value: float) -> str:
    """Learning rates in scientific notation, everything else with 6 significant digits."""
    return line_field(name).format(value)


def format_time(now: float) -> str:
    """`2025-12-02T18:30:00.123+08:00`: local time, milliseconds, the UTC offset."""
    return datetime.fromtimestamp(now).astimezone().isoformat(timespec="milliseconds")


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
    """Writes monitor lines to a stream (stdout by default)."""

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
    """

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
