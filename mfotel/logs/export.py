"""Rows as a tidy CSV: one line per (run, rank, source, step), one column per value.

    with open("out.csv", "w", newline="") as handle:
        write_csv(iter_rows(discover_runs(["runs/exp1"])), handle)

Missing values are empty cells; NaN and ±Inf are written `nan`, `inf`, `-inf` (pandas and
spreadsheets read them back as such); floats are written to round-trip exactly. `source` says
which log a line comes from (`mfotel-text`, `mfotel-json`, `mindformers-info`): the same step
logged by mfotel and by MFLossMonitor is two lines, never one mixed line.
"""
from __future__ import annotations

import csv
from collections.abc import Iterable
from typing import IO

from .parse import Row

COLUMNS: tuple[str, ...] = ("run", "rank", "source", "step", "epoch", "time", "loss",
                            "learning_rate", "grad_norm", "throughput", "step_time", "loss_scale")


def _cell(value: object) -> object:
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(value)       # round-trips; nan / inf / -inf as such
    return value


def write_csv(rows: Iterable[Row], handle: IO[str]) -> int:
    """Write the header and one line per row; returns the number of rows written."""
    writer = csv.writer(handle, lineterminator="\n")
    writer.writerow(COLUMNS)
    count = 0
    for row in rows:
        writer.writerow([_cell(getattr(row, column)) for column in COLUMNS])
        count += 1
    return count
