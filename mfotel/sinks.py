"""Console and file monitor lines (`[Monitor] step: 50, loss: 2.345, ...`)."""
from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import IO, Mapping

PREFIX = "[Monitor]"
#: Units written after a value in the text line (`step_time: 0.512 s`); the JSON line holds bare
#: numbers in the same units. README, Time figures, defines each field.
UNITS: dict[str, str] = {"step_time": "s", "throughput": "samples/s"}


def format_value(name: str, value: float) -> str:
    """Learning rates in scientific notation, everything else with 6 significant digits."""
    return f"{value:.6e}" if name == "learning_rate" and math.isfinite(value) else f"{value:.6g}"


def format_line(step: int, values: Mapping[str, float | None]) -> str:
    """The seed's line, with units: `[Monitor] step: 50, loss: 2.345, learning_rate:
    1.000000e-05, throughput: 65.4 samples/s, step_time: 0.122 s`."""
    parts = [f"step: {step}"]
    for name, value in values.items():
        if value is not None:
            unit = UNITS.get(name)
            parts.append(f"{name}: {format_value(name, value)}{' ' + unit if unit else ''}")
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
    """Appends one flushed line per record; opened on construction so errors surface early.

    Each line is one write() of a complete line, so a killed process leaves whole lines. If
    the file or its directory is removed while training, it is created again (a stat per
    record) rather than writing on into an unlinked file.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._handle: IO[str] | None = None
        self._open()

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._handle = open(self.path, "a", encoding="utf-8", buffering=1)

    def write(self, line: str) -> None:
        if self._handle is None or not os.path.exists(self.path):
            self.close()
            self._open()
        assert self._handle is not None
        try:
            self._handle.write(line + "\n")
            self._handle.flush()
        except OSError:
            self.close()  # drop what is buffered; the next record reopens and appends
            raise

    def close(self) -> None:
        if self._handle is not None:
            try:
                self._handle.close()
            except OSError:
                pass  # a full disk can fail the final flush too; nothing more to save
            self._handle = None
