"""`mfotel goodput LOGDIR...`: a run's goodput account from the monitor lines of every attempt.

The same account as the live rules (mfotel.alerting.goodput; docs/metrics.md, "Goodput"),
computed from the time account each monitor line carries (`account_*` fields,
mfotel.time_account) instead of from scrapes: each line is a reading of its rank's account at
the line's time. Per rank, between two readings of one process (the same start: the line's
time minus its phases), the phases' increases; at a reading of a new process, all of its
account, and the downtime from the previous reading to its start. The steps of an interval at
or below the highest step read before it are recomputed: their share of its step time. The
run's account is the mean of its ranks' (the live one averages all ranks; lines come from the
`log_rank` ranks: `log_rank: -1` for all), its wall clock the first process start to the last
reading, `unaccounted` what the categories leave of it.

    rows = iter_rows(discover_runs(["run/attempt1", "run/attempt2"]))
    account = run_account(marks_from_rows(rows))
    account.seconds["goodput"], account.shares()["downtime"], account.recomputed_steps
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ..time_account import LINE_PREFIX, LINE_STEPS, PHASES
from .parse import Row

CATEGORIES: tuple[str, ...] = ("goodput", "recomputed", *(p for p in PHASES if p != "step"),
                               "downtime", "unaccounted")
#: Readings whose process starts differ by less than this are of one process (the line's time
#: and its totals are written to the millisecond).
SAME_PROCESS_SECONDS = 1.0


@dataclass(frozen=True)
class Mark:
    """One reading of a rank's time account: at `time` (its last event), the global `step`,
    the `steps` this process completed and its `phases` (seconds)."""
    time: float
    step: int
    steps: float
    phases: Mapping[str, float]

    @property
    def origin(self) -> float:
        """When this process started."""
        return self.time - sum(self.phases.values())


@dataclass
class Account:
    """Seconds per category (CATEGORIES), the wall clock they add up to, the steps done again,
    and how many attempts (processes) and ranks the readings show."""
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))
    wall: float = 0.0
    recomputed_steps: float = 0.0
    attempts: int = 0
    ranks: int = 0
    start: float | None = None      # the first process start (unix seconds)
    end: float | None = None        # the last reading

    def shares(self) -> dict[str, float]:
        """Each category's share of the wall clock (0..1)."""
        return {name: (value / self.wall if self.wall > 0 else 0.0)
                for name, value in self.seconds.items()}


def rank_account(marks: Sequence[Mark]) -> Account:
    """The account of one rank's readings (any order)."""
    account = Account(ranks=1)
    seconds = account.seconds
    previous: Mark | None = None
    high_water: int | None = None
    for mark in sorted(marks, key=lambda m: m.time):
        same = (previous is not None and abs(mark.origin - previous.origin) < SAME_PROCESS_SECONDS
                and mark.steps >= previous.steps)
        if same:
            assert previous is not None
            delta = {p: mark.phases.get(p, 0.0) - previous.phases.get(p, 0.0) for p in PHASES}
            steps = mark.steps - previous.steps
        else:
            delta = {p: mark.phases.get(p, 0.0) for p in PHASES}
            steps = mark.steps
            account.attempts += 1
            if previous is None:
                account.start = mark.origin
            else:
                seconds["downtime"] += max(mark.origin - previous.time, 0.0)
        began_at = mark.step - steps
        redone = 0.0 if high_water is None else min(max(high_water - began_at, 0.0), steps)
        redone_time = delta["step"] * redone / steps if steps > 0 else 0.0
        account.recomputed_steps += redone
        seconds["goodput"] += delta["step"] - redone_time
        seconds["recomputed"] += redone_time
        for phase in PHASES:
            if phase != "step":
                seconds[phase] += delta[phase]
        high_water = mark.step if high_water is None else max(high_water, mark.step)
        previous = mark
    if previous is not None and account.start is not None:
        account.end = previous.time
        account.wall = previous.time - account.start
        seconds["unaccounted"] = account.wall - sum(
            value for name, value in seconds.items() if name != "unaccounted")
    return account


def run_account(marks_by_rank: Mapping[int, Sequence[Mark]]) -> Account:
    """The run's account: the mean of its ranks' accounts."""
    accounts = [rank_account(marks) for marks in marks_by_rank.values() if marks]
    if not accounts:
        raise ValueError("no readings of a time account")
    count = len(accounts)
    run = Account(ranks=count, attempts=max(a.attempts for a in accounts))
    run.seconds = {name: sum(a.seconds[name] for a in accounts) / count for name in CATEGORIES}
    run.wall = sum(a.wall for a in accounts) / count
    run.recomputed_steps = sum(a.recomputed_steps for a in accounts) / count
    run.start = min(a.start for a in accounts if a.start is not None)
    run.end = max(a.end for a in accounts if a.end is not None)
    return run


def mark_of(row: Row) -> Mark | None:
    """The reading a monitor line holds; None for a line without the account or a time."""
    account = row.account
    if account is None or row.time is None or LINE_STEPS not in account:
        return None
    phases = {phase: account.get(LINE_PREFIX + phase, 0.0) for phase in PHASES}
    return Mark(row.time, row.step, account[LINE_STEPS], phases)


def marks_from_rows(rows: Iterable[Row]) -> dict[int, list[Mark]]:
    """Readings by rank; a line written twice (a file and a console capture, text and JSON)
    is read once."""
    marks: dict[int, dict[tuple[float, int], Mark]] = {}
    for row in rows:
        mark = mark_of(row)
        if mark is not None:
            marks.setdefault(row.rank, {})[(round(mark.time, 3), mark.step)] = mark
    return {rank: list(by_time.values()) for rank, by_time in sorted(marks.items())}


# ---------------------------------------------------------------- the command
def _duration(seconds: float) -> str:
    whole = int(round(seconds))
    hours, rest = divmod(whole, 3600)
    return f"{hours}h {rest // 60:02d}m {rest % 60:02d}s" if hours else \
        f"{rest // 60}m {rest % 60:02d}s"


def format_account(account: Account) -> str:
    """A plain table: category, seconds, share of the wall clock."""
    shares = account.shares()
    lines = [f"goodput account of {account.ranks} rank(s), {account.attempts} attempt(s): "
             f"wall clock {account.wall:.3f} s ({_duration(account.wall)})",
             f"{'category':<12} {'seconds':>14} {'share':>7}"]
    lines += [f"{name:<12} {account.seconds[name]:>14.3f} {shares[name]:>7.1%}"
              for name in CATEGORIES]
    lines.append(f"recomputed steps: {account.recomputed_steps:g}")
    return "\n".join(lines) + "\n"


def account_json(account: Account) -> dict[str, object]:
    return {"ranks": account.ranks, "attempts": account.attempts, "start": account.start,
            "end": account.end, "wall_seconds": account.wall,
            "recomputed_steps": account.recomputed_steps, "seconds": account.seconds,
            "shares": account.shares()}
