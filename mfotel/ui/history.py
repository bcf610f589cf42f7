"""The live page's history: the seed metrics at every record step, in memory fixed at start.

    history = History(points=10_000)
    history.append(50, {"loss": 2.3, "learning_rate": 1e-4})    # training thread, at a record
    history.mark_nonfinite("loss", 57, float("nan"), previous_step=56)   # any step
    delta = history.read(since=40, generation=history.generation)      # HTTP threads

The training thread stores into preallocated arrays (O(1), no allocation; `points` x 48 bytes
in all). When they are full, every other point is dropped and from then on every other
record is kept, and so on: the page always shows the whole run, at full resolution while it
fits, evenly thinned after, like TensorBoard's reservoir of scalars but deterministic. The
newest record is always shown: it sits in the next free slot until a kept record takes it.

Non-finite values can happen at any step, not only at records: `mark_nonfinite` keeps them
as ranges of consecutive steps (a run that stays NaN is one range), the first MAX_MARKS
ranges of the run; later ones are only counted.
"""
from __future__ import annotations

import math
import threading
from array import array
from bisect import bisect_right
from typing import Any, Mapping

from ..contract import SEED_METRICS

FIELDS: tuple[str, ...] = SEED_METRICS
#: a step (int64) and one float64 per metric
BYTES_PER_POINT = 8 * (1 + len(FIELDS))
MAX_MARKS = 1000
NAN = float("nan")


def nonfinite_text(value: float) -> str:
    """"NaN", "Inf" or "-Inf" (JSON has no literal for them)."""
    return "NaN" if value != value else ("Inf" if value > 0 else "-Inf")


class History:
    """Seed metrics at record steps, bounded by `points`, thinned evenly when full."""

    def __init__(self, points: int) -> None:
        if points < 2:
            raise ValueError(f"a history needs at least 2 points, not {points}")
        self.capacity = points
        self._steps = array("q", bytes(8 * points))
        self._columns = tuple(array("d", bytes(8 * points)) for _ in FIELDS)
        self._kept = 0          # committed points, in slots 0 .. _kept - 1
        self._tail = False      # slot _kept holds the newest record, not (yet) a kept one
        self._records = 0       # records appended so far
        self.stride = 1         # every stride-th record is kept
        self.generation = 0     # moves when points are thinned: clients load everything again
        self.version = 0        # moves at every change
        self.marks: list[list[Any]] = []   # [metric, first step, last step, "NaN"/"Inf"/"-Inf"]
        self.marks_version = 0
        self.marks_dropped = 0  # non-finite ranges beyond MAX_MARKS, counted only
        self._open: dict[str, list[Any]] = {}  # metric -> its latest range
        self._lock = threading.Lock()

    @property
    def points(self) -> int:
        """Points shown: the kept ones and the newest record."""
        return self._kept + self._tail

    @property
    def nbytes(self) -> int:
        """Bytes held by the point arrays (fixed at construction)."""
        return sum(a.buffer_info()[1] * a.itemsize for a in (self._steps, *self._columns))

    # ---------------------------------------------------------------- training thread
    def append(self, step: int, values: Mapping[str, float | None]) -> None:
        """One record's values (None: not recorded). O(1); thinning, O(points), happens once
        per doubling of the run."""
        with self._lock:
            slot = self._kept
            self._steps[slot] = step
            for column, name in zip(self._columns, FIELDS):
                value = values.get(name)
                column[slot] = NAN if value is None else value
            kept = self._records % self.stride == 0
            self._records += 1
            self._tail = not kept
            if kept:
                self._kept += 1
                if self._kept == self.capacity:
                    self._thin()
            self.version += 1

    def _thin(self) -> None:
        """Keep every other point (the records now kept are those at multiples of 2 strides)."""
        last = self.capacity - 1
        newest = [self._steps[last], *(column[last] for column in self._columns)]
        half = (self.capacity + 1) // 2
        for column in (self._steps, *self._columns):
            column[:half] = column[0:self.capacity:2]
        self._kept, self.stride = half, self.stride * 2
        self.generation += 1
        if last % 2:  # the newest record was dropped: show it as the tail until the next one
            for column, value in zip((self._steps, *self._columns), newest):
                column[half] = value
            self._tail = True

    def mark_nonfinite(self, metric: str, step: int, value: float, previous_step: int) -> None:
        """`metric` was NaN/Inf at `step`; extends the metric's range when `previous_step`
        (the step before this one) was in it."""
        with self._lock:
            current = self._open.get(metric)
            if current is not None and current[2] >= previous_step:
                current[2] = step
            else:
                current = self._open[metric] = [metric, step, step, nonfinite_text(value)]
                if len(self.marks) < MAX_MARKS:
                    self.marks.append(current)
                else:  # still followed (nonfinite_at), not listed
                    self.marks_dropped += 1
            self.marks_version += 1
            self.version += 1

    # ---------------------------------------------------------------- readers (HTTP threads)
    def read(self, since: int | None = None, generation: int | None = None,
             marks_version: int | None = None) -> dict[str, Any]:
        """Points after step `since`; everything when `since` is None or `generation` is not
        the current one (the points were thinned: `reset` is true). `series` maps each metric
        to an array of floats (NaN where not recorded or not finite: the marks say which).

        A client keeps its points up to `since`, appends `steps`/`series`, and asks next with
        `since=committed`: the last point may be the newest record, replaced later. Marks are
        included when `marks_version` is not the current one.
        """
        with self._lock:
            reset = since is None or generation != self.generation
            start = 0 if reset else bisect_right(self._steps, since, 0, self._kept)
            end = self._kept + self._tail
            steps = self._steps[start:end].tolist()
            columns = [column[start:end] for column in self._columns]
            committed = self._steps[self._kept - 1] if self._kept else None
            marks = ([list(m) for m in self.marks] if marks_version != self.marks_version
                     else None)
            head = {"generation": self.generation, "stride": self.stride,
                    "capacity": self.capacity, "points": self._kept + self._tail,
                    "marks_version": self.marks_version, "marks_dropped": self.marks_dropped}
        data = {**head, "reset": reset, "committed": committed, "steps": steps,
                "series": dict(zip(FIELDS, columns))}
        if marks is not None:
            data["marks"] = [{"metric": m, "first": a, "last": b, "value": v}
                             for m, a, b, v in marks]
        return data

    def latest(self, name: str) -> float | None:
        """The newest record's `name`, None when absent or not finite."""
        with self._lock:
            count = self._kept + self._tail
            value = self._columns[FIELDS.index(name)][count - 1] if count else NAN
        return value if math.isfinite(value) else None

    def nonfinite_at(self, step: int | None) -> dict[str, str]:
        """metric -> "NaN"/"Inf"/"-Inf" for the metrics non-finite at `step`."""
        with self._lock:
            return {metric: mark[3] for metric, mark in self._open.items()
                    if step is not None and mark[1] <= step <= mark[2]}
