"""The live page's history: the seed metrics at every record step, in memory fixed at start.

    history = History(points=10_000)
    history.append(50, {"loss": 2.3, "learning_rate": 1e-4})    # training thread, at a record
    history.mark_nonfinite("loss", 57, float("nan"), previous_step=56)   # any step
    delta = history.read(since=40, generation=history.generation)      # HTTP threads
    monitor.add_listener(HistoryRecorder(history))   # what the callback does (mfotel.listeners)

Points live in preallocated arrays (`points` x 48 bytes in all). The training thread only
queues each record (a deque append); the page's requests store what waits before they read,
and a short-lived thread does when QUEUE_LIMIT records wait (nobody looks at the page), so
the queue stays bounded and the training thread never stores. When the arrays are full,
every other point is dropped and from then on every other record is kept, and so on: the
page always shows the whole run, at full resolution while it fits, evenly thinned after,
like TensorBoard's reservoir of scalars but deterministic. The newest record is always
shown: it sits in the next free slot until a kept record takes it.

Non-finite values can happen at any step, not only at records: `mark_nonfinite` keeps them
as ranges of consecutive steps (a run that stays NaN is one range), the first MAX_MARKS
ranges of the run; later ones are only counted.
"""
from __future__ import annotations

import math
import threading
from array import array
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from ..contract import SEED_METRICS
from ..listeners import StepListener, StepSample

FIELDS: tuple[str, ...] = SEED_METRICS
#: a step (int64) and one float64 per metric
BYTES_PER_POINT = 8 * (1 + len(FIELDS))
MAX_MARKS = 1000
#: Records that may wait for a reader before a thread stores them.
QUEUE_LIMIT = 1024
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
        self._records = 0       # records stored so far
        self._stride = 1        # every stride-th record is kept
        self._generation = 0    # moves when points are thinned
        self._version = 0       # moves at every change
        self._queue: deque[tuple[int, Mapping[str, float | None]]] = deque()
        self._storing = False   # a thread stores the queue
        self.marks: list[list[Any]] = []   # [metric, first step, last step, "NaN"/"Inf"/"-Inf"]
        self.marks_version = 0
        self.marks_dropped = 0  # non-finite ranges beyond MAX_MARKS, counted only
        self._open: dict[str, list[Any]] = {}  # metric -> its latest range
        self._lock = threading.Lock()

    def _stored(self, read: Callable[[], int]) -> int:
        """`read()` once the queued records are stored (readers see every record)."""
        with self._lock:
            self._store_queued()
            return read()

    @property
    def points(self) -> int:
        """Points shown: the kept ones and the newest record."""
        return self._stored(lambda: self._kept + self._tail)

    @property
    def queued(self) -> int:
        """Records appended but not stored yet (they are stored before any read)."""
        return len(self._queue)

    @property
    def stride(self) -> int:
        """Every stride-th record is kept."""
        return self._stored(lambda: self._stride)

    @property
    def generation(self) -> int:
        """Moves when points are thinned: clients load everything again."""
        return self._stored(lambda: self._generation)

    @property
    def version(self) -> int:
        """Moves at every change."""
        return self._stored(lambda: self._version)

    @property
    def nbytes(self) -> int:
        """Bytes held by the point arrays (fixed at construction)."""
        return sum(a.buffer_info()[1] * a.itemsize for a in self._arrays())

    def _arrays(self) -> tuple[array[Any], ...]:
        """The step column and the metric columns."""
        return (self._steps, *self._columns)

    # ---------------------------------------------------------------- training thread
    def append(self, step: int, values: Mapping[str, float | None]) -> None:
        """One record's values (None: not recorded); `values` must not change afterwards.
        O(1): queued, stored before the next read."""
        queue = self._queue
        queue.append((step, values))
        if len(queue) >= QUEUE_LIMIT and not self._storing:
            self._storing = True
            threading.Thread(target=self._store_in_background, name="mfotel-history",
                             daemon=True).start()

    def _store_in_background(self) -> None:
        try:
            with self._lock:
                self._store_queued()
        finally:
            self._storing = False

    def _store_queued(self) -> None:
        """Store the queued records (the lock is held). O(1) each; thinning, O(points),
        happens once per doubling of the run."""
        queue = self._queue
        while queue:
            step, values = queue.popleft()
            slot = self._kept
            self._steps[slot] = step
            for column, name in zip(self._columns, FIELDS, strict=True):
                value = values.get(name)
                column[slot] = NAN if value is None else value
            kept = self._records % self._stride == 0
            self._records += 1
            self._tail = not kept
            if kept:
                self._kept += 1
                if self._kept == self.capacity:
                    self._thin()
            self._version += 1

    def _thin(self) -> None:
        """Keep every other point (the records now kept are those at multiples of 2 strides)."""
        last = self.capacity - 1
        newest = [self._steps[last], *(column[last] for column in self._columns)]
        half = (self.capacity + 1) // 2
        for column in self._arrays():
            column[:half] = column[0:self.capacity:2]
        self._kept, self._stride = half, self._stride * 2
        self._generation += 1
        if last % 2:  # the newest record was dropped: show it as the tail until the next one
            for column, value in zip(self._arrays(), newest, strict=True):
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
            self._version += 1

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
            self._store_queued()
            reset = since is None or generation != self._generation
            start = 0 if reset or since is None else \
                bisect_right(self._steps, since, 0, self._kept)
            end = self._kept + self._tail
            steps = self._steps[start:end].tolist()
            columns = [column[start:end] for column in self._columns]
            committed = self._steps[self._kept - 1] if self._kept else None
            marks = ([list(m) for m in self.marks] if marks_version != self.marks_version
                     else None)
            head = {"generation": self._generation, "stride": self._stride,
                    "capacity": self.capacity, "points": self._kept + self._tail,
                    "marks_version": self.marks_version, "marks_dropped": self.marks_dropped}
        data: dict[str, Any] = {**head, "reset": reset, "committed": committed, "steps": steps,
                "series": dict(zip(FIELDS, columns, strict=True))}
        if marks is not None:
            data["marks"] = [{"metric": m, "first": a, "last": b, "value": v}
                             for m, a, b, v in marks]
        return data

    def latest(self, name: str) -> float | None:
        """The newest record's `name`, None when absent or not finite."""
        with self._lock:
            self._store_queued()
            count = self._kept + self._tail
            value = self._columns[FIELDS.index(name)][count - 1] if count else NAN
        return value if math.isfinite(value) else None

    def nonfinite_at(self, step: int | None) -> dict[str, str]:
        """metric -> "NaN"/"Inf"/"-Inf" for the metrics non-finite at `step`."""
        with self._lock:
            return {metric: mark[3] for metric, mark in self._open.items()
                    if step is not None and mark[1] <= step <= mark[2]}


class HistoryRecorder(StepListener):
    """Feeds a History from the run: every record, and every non-finite loss / grad norm."""

    def __init__(self, history: History) -> None:
        self.history = history

    def on_nonfinite(self, sample: StepSample) -> None:
        loss, norm = sample.outputs.loss, sample.outputs.grad_norm
        if loss is not None and not math.isfinite(loss):
            self.history.mark_nonfinite("loss", sample.step, loss, sample.previous_step)
        if norm is not None and not math.isfinite(norm):
            self.history.mark_nonfinite("grad_norm", sample.step, norm, sample.previous_step)

    def on_record(self, sample: StepSample, values: Mapping[str, float | None]) -> None:
        self.history.append(sample.step, values)
