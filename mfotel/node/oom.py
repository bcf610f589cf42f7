"""Was a rank's SIGKILL the kernel's OOM killer? Its memory cgroup's OOM-kill count tells.

The kernel counts an OOM kill (`oom_kill` of the victim's memory.events or memory.oom_control,
procfs.memory_cgroup_file) when it sends the victim SIGKILL; the victim exits once its memory
is torn down, seconds later on a loaded node with a large process. Two things follow:

- the count is read again every probe interval (a rank may be moved to another cgroup), and a
  read can fall between the kill and the exit: a rise seen while the rank lived still counts
  for an exit by SIGKILL up to KILL_TO_EXIT_SECONDS later (`OomCounts`);
- ranks often share a cgroup (one container for a node's ranks): when the victim dies, the
  launcher SIGKILLs the others, whose count rose too. One kill explains one exit, the first
  by SIGKILL to be told after it (`OomLedger`); the ranks killed after it are "signal".

    counts = OomCounts(file, procfs.oom_kill_count(file))
    counts.reread(file, procfs.oom_kill_count(file), now)          # every probe interval
    ledger.tell(counts, procfs.oom_kill_count(counts.file), ended_at)  # at its SIGKILL
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# how long after a read saw the count rise an exit by SIGKILL is still the OOM killer's:
# well past the teardown of a large process on a busy node, well short of a launcher's
# restart of the same rank
KILL_TO_EXIT_SECONDS = 30.0


@dataclass
class OomCounts:
    """A rank's memory cgroup file, its count as last read while the rank lived, and the last
    rise a read saw: (when, the count before it)."""

    file: Path | None
    count: int | None
    rise: tuple[float, int] | None = None

    def reread(self, file: Path | None, count: int | None, now: float) -> None:
        """A read while the rank lives. A rank moved to another cgroup starts over."""
        if file != self.file:
            self.file, self.count, self.rise = file, count, None
            return
        if self.rise is not None and now - self.rise[0] > KILL_TO_EXIT_SECONDS:
            self.rise = None
        if count is not None and self.count is not None and count > self.count \
                and self.rise is None:
            self.rise = (now, self.count)
        if count is not None:
            self.count = count

    def baseline(self, ended_at: float) -> int | None:
        """The count before the kills that may explain an exit at `ended_at`."""
        if self.rise is not None and 0.0 <= ended_at - self.rise[0] <= KILL_TO_EXIT_SECONDS:
            return self.rise[1]
        return self.count


class OomLedger:
    """The kills of each cgroup file already told as a rank's exit (one agent, one ledger)."""

    def __init__(self) -> None:
        self._told: dict[Path, int] = {}  # file -> the count up to which kills were told

    def tell(self, counts: OomCounts, after: int | None, ended_at: float) -> bool:
        """Whether a rank's exit by SIGKILL at `ended_at` was an OOM kill: its cgroup counted
        a kill since its baseline that no earlier exit was told as; that kill is then told."""
        before = counts.baseline(ended_at)
        if counts.file is None or after is None or before is None:
            return False
        told = self._told.get(counts.file)
        if told is not None and told > after:
            told = None  # a count that went down: a new cgroup at that path
        floor = before if told is None else max(before, told)
        if after <= floor:
            return False
        self._told[counts.file] = floor + 1
        return True
