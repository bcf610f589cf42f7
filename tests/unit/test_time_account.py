"""The per-rank time account (mfotel.time_account): a table of hook events and the phases
they must add up to. Times are unix seconds from the process's start (origin ORIGIN = 1000)."""
from __future__ import annotations

import time

import pytest

from mfotel.alerting.thresholds import RulesConfig
from mfotel.time_account import (
    LINE_FIELDS,
    PHASES,
    STALL_SECONDS,
    STALL_STEP_FACTOR,
    TimeAccount,
    process_start_time,
)

ORIGIN = 1000.0


def run(events: list[tuple], **kwargs: float) -> TimeAccount:
    """("begin", t) / ("end", t[, steps]) / ("save" | "eval", seconds, t) / ("close", t),
    with t in seconds after the origin."""
    account = TimeAccount(ORIGIN, **kwargs)
    for event in events:
        kind = event[0]
        if kind == "begin":
            account.step_begin(ORIGIN + event[1])
        elif kind == "end":
            account.step_end(ORIGIN + event[1], *event[2:])
        elif kind in ("save", "eval"):
            phase = "checkpoint" if kind == "save" else "evaluation"
            account.interval(phase, event[1], ORIGIN + event[2])
        else:
            account.close(ORIGIN + event[1])
    return account


CASES = [
    ("start-up runs to the end of the first step (compilation is inside it)",
     [("begin", 30), ("end", 45)], dict(startup=45), 1),
    ("after the first step: step time inside, input time between",
     [("begin", 30), ("end", 45), ("begin", 47), ("end", 50), ("begin", 51), ("end", 54)],
     dict(startup=45, step=6, input=3), 3),
    ("a save after a step end is carved out of the input time",
     [("begin", 0), ("end", 10), ("save", 4, 15), ("begin", 16), ("end", 18)],
     dict(startup=10, checkpoint=4, input=2, step=2), 2),
    ("a save inside the step hooks (callback listed first) is carved out of the step",
     [("begin", 0), ("end", 10), ("begin", 10), ("save", 5, 17), ("end", 18)],
     dict(startup=10, step=3, checkpoint=5), 2),
    ("an evaluation between two steps",
     [("begin", 0), ("end", 10), ("eval", 30, 41), ("begin", 41), ("end", 43)],
     dict(startup=10, evaluation=30, input=1, step=2), 2),
    ("a save longer than the time since the last event takes only that time",
     [("begin", 0), ("end", 10), ("save", 8, 15)],
     dict(startup=10, checkpoint=5), 1),
    ("time beyond the stall threshold since the last step end is stall (step and input)",
     [("begin", 0), ("end", 10), ("begin", 40), ("end", 200)],
     dict(startup=10, input=30, step=70, stall=90), 2),
    ("saves do not count toward the stall threshold",
     [("begin", 0), ("end", 10), ("save", 500, 520), ("begin", 530), ("end", 550)],
     dict(startup=10, checkpoint=500, input=20, step=20), 2),
    ("the threshold follows the mean step: 10 x 20 s per step > 100 s",
     [("begin", 0), ("end", 10), *[e for k in range(3) for e in (
         ("begin", 10 + 20 * k + 5), ("end", 10 + 20 * (k + 1)))],
      ("begin", 75), ("end", 300)],
     dict(startup=10, input=20, step=45 + 195, stall=30), 5),
    ("the time after the last step until the end is input",
     [("begin", 0), ("end", 10), ("close", 12)], dict(startup=10, input=2), 1),
    ("sink mode: one end, several steps",
     [("begin", 0), ("end", 10, 4), ("begin", 10), ("end", 14, 4)],
     dict(startup=10, step=4), 8),
    ("a clock that goes back adds nothing",
     [("begin", 0), ("end", 10), ("begin", 9), ("end", 12)],
     dict(startup=10, step=2), 2),
]


@pytest.mark.parametrize("name, events, phases, steps", CASES, ids=[c[0] for c in CASES])
def test_phases_add_up_to_the_time_since_the_process_started(name, events, phases, steps):
    account = run(events, stall_seconds=100)
    assert account.totals == pytest.approx({**dict.fromkeys(PHASES, 0.0), **phases})
    assert account.steps == steps
    assert sum(account.totals.values()) == pytest.approx(account.last_event - account.origin)


def test_line_values_are_the_totals_and_the_steps():
    account = run([("begin", 0), ("end", 10), ("begin", 11), ("end", 13)])
    values = account.line_values()
    assert list(values) == list(LINE_FIELDS)
    assert values["account_steps"] == 2 and values["account_startup"] == 10
    assert values["account_step"] == 2 and values["account_input"] == 1


def test_the_stall_defaults_are_the_rules_defaults():
    rules = RulesConfig()
    assert (STALL_SECONDS, STALL_STEP_FACTOR) == (rules.stall_seconds, rules.stall_step_factor)


def test_bad_settings_and_phases_are_refused():
    with pytest.raises(ValueError):
        TimeAccount(ORIGIN, stall_seconds=0)
    with pytest.raises(ValueError, match="checkpoint, evaluation"):
        TimeAccount(ORIGIN).interval("step", 1.0, ORIGIN + 1)


def test_process_start_time_is_this_process_start():
    import psutil
    assert abs(process_start_time() - psutil.Process().create_time()) < 1.5
    assert process_start_time() <= time.time()


class Plain:
    """The account's rules written plainly, every event counted at once (the first version
    of mfotel.time_account): what the training thread's shortcuts must agree with."""

    def __init__(self, origin: float, stall_seconds: float, stall_step_factor: float) -> None:
        self.last_event, self.steps, self.phase = origin, 0, "startup"
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.stall_seconds, self.factor = stall_seconds, stall_step_factor
        self.since = self.cycle_seconds = 0.0
        self.cycles = 0

    def threshold(self) -> float:
        mean = self.cycle_seconds / self.cycles if self.cycles else 0.0
        return max(self.stall_seconds, self.factor * mean)

    def elapsed(self, now: float) -> float:
        elapsed = max(now - self.last_event, 0.0)
        self.last_event = max(self.last_event, now)
        return elapsed

    def spend(self, seconds: float) -> None:
        if self.phase == "startup":
            self.totals["startup"] += seconds
            return
        kept = min(seconds, max(self.threshold() - self.since, 0.0))
        self.totals[self.phase] += kept
        self.totals["stall"] += seconds - kept
        self.since += seconds

    def event(self, kind: str, now: float, value: float = 1) -> None:
        if kind == "interval":
            elapsed = self.elapsed(now)
            self.spend(elapsed - min(value, elapsed))
            self.totals["checkpoint"] += min(value, elapsed)
            return
        self.spend(self.elapsed(now))
        if kind == "begin" and self.phase != "startup":
            self.phase = "step"
        elif kind == "end":
            if self.phase != "startup":
                self.cycles += int(value)
                self.cycle_seconds += min(self.since, self.threshold())
            self.steps += int(value)
            self.since, self.phase = 0.0, "input"


def test_the_account_counts_as_the_plain_rules_whatever_the_events():
    """Random runs (steps, stalls, sink steps, saves, a clock going back, ends without a
    begin, begins twice, closes between runs): after every event but a begin (noted, counted
    at the next event), the same phases, steps and last event as the plain rules."""
    import random
    for seed in range(40):
        chance = random.Random(seed)
        account = TimeAccount(ORIGIN, stall_seconds=50, stall_step_factor=3)
        plain = Plain(ORIGIN, 50, 3)
        now = ORIGIN
        for _ in range(300):
            now += chance.choice((0.0, 0.5, 2.0, 9.0, 30.0, 70.0, -1.0))
            kind = chance.choices(("begin", "end", "interval", "close"), (10, 10, 2, 1))[0]
            value = float(chance.choice((1, 1, 1, 4))) if kind == "end" else \
                chance.choice((0.0, 3.0, 40.0))
            plain.event(kind, now, value)
            if kind == "begin":
                account.step_begin(now)
                continue
            if kind == "end":
                account.step_end(now, int(value))
            elif kind == "interval":
                account.interval("checkpoint", value, now)
            else:
                account.close(now)
            assert account.totals == pytest.approx(plain.totals, abs=1e-9), (seed, kind)
            assert (account.steps, account.last_event) == (plain.steps, plain.last_event)
            assert account.phase == plain.phase


def test_one_account_a_process_kept_across_runs_and_a_forked_child_makes_its_own(monkeypatch):
    from mfotel import time_account
    first = time_account.process_account()
    assert time_account.process_account() is first
    assert abs(first.origin - process_start_time()) < 1e-6
    monkeypatch.setattr(time_account.os, "getpid", lambda: -1)   # as in a forked child
    assert time_account.process_account() is not first


def test_a_save_is_carved_out_when_the_checkpoint_watch_reports_it():
    """CheckpointWatch (mfotel.checkpoints) times a save on the training thread and tells
    the account: its duration, ending when the state's last checkpoint timestamp says."""
    from mfotel.checkpoints import CheckpointWatch
    from mfotel.instruments import TrainState

    class Saver:   # ModelCheckpoint's record of its last save moves when step_end saves
        _last_triggered_step = 0

        def step_end(self, run_context: object) -> None:
            self._last_triggered_step += 1

    state, start = TrainState(), time.time() - 60
    account = TimeAccount(start)
    account.step_begin(start + 1)
    account.step_end(start + 2)
    saver = Saver()
    CheckpointWatch(saver, state, lambda: None, account)
    saver.step_end(None)
    assert state.checkpoints == 1 and state.checkpoint_duration is not None
    assert account.totals["checkpoint"] == state.checkpoint_duration
    assert account.last_event == state.last_checkpoint_timestamp


def test_the_account_closes_when_the_final_status_is_shown():
    from types import SimpleNamespace

    from opentelemetry.sdk.metrics import MeterProvider

    from mfotel.contract import STATUS_CANCELLED
    from mfotel.instruments import Instruments
    from mfotel.run_end import show_status
    instruments = Instruments(MeterProvider().get_meter("test"), {"job_name": "j", "rank": "0"},
                              ())
    account = TimeAccount(time.time() - 60)
    account.step_begin(account.origin + 1)
    account.step_end(account.origin + 2)
    parts = SimpleNamespace(exporter=SimpleNamespace(instruments=instruments), account=account,
                            node_link=None)
    show_status(parts, STATUS_CANCELLED, "cancelled")  # type: ignore[arg-type]
    assert account.closed and account.last_event == instruments.state.end_timestamp
    assert account.totals["input"] == pytest.approx(account.last_event - account.origin - 2)
