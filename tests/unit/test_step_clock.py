"""The step clock (mfotel.step_clock): one table of runs, each a list of hook events and the
ticks they must yield. Times are perf_counter seconds; no MindSpore."""
from __future__ import annotations

import itertools

import pytest

from mfotel.config import parse_config
from mfotel.step_clock import RecordSchedule, StepClock, Tick

#: events: ("begin", t) step-begin mark; ("mark", t) an integration's end mark;
#: ("end", cur_step_num, t) the step-end hook. Each end yields a Tick, compared field by
#: field with the expected dict (record: None, or a dict of Record fields).
CASES = [
    ("each step records; outside is the previous end to this begin",
     dict(schedule=RecordSchedule(1), batch_size=8), {}, {},
     [("begin", 0.0), ("end", 1, 0.1), ("begin", 0.15), ("end", 2, 0.3)],
     [dict(step=1, previous_step=0, advanced=1, seconds=0.1, outside=None, samples=8,
           record=dict(elapsed=0.1, steps=1, samples=8, throughput=80.0, step_time=0.1)),
      dict(step=2, previous_step=1, seconds=0.15, outside=0.05,
           record=dict(elapsed=0.2, steps=1, samples=8, throughput=40.0, step_time=0.2))]),
    ("interval 3: means over the interval, nothing recorded between",
     dict(schedule=RecordSchedule(3), batch_size=2), {}, {},
     [("begin", 0.0), ("end", 1, 1.0), ("begin", 1.0), ("end", 2, 2.0),
      ("begin", 2.0), ("end", 3, 3.0)],
     [dict(step=1, record=None), dict(step=2, record=None),
      dict(step=3, seconds=1.0, outside=0.0,
           record=dict(elapsed=3.0, steps=3, samples=6, throughput=2.0, step_time=1.0))]),
    ("early_steps: every step for the first 2, then every 3",
     dict(schedule=RecordSchedule(3, early_steps=2, early_step_interval=1)), {}, {},
     [("end", n, float(n)) for n in range(1, 8)],
     [dict(step=n, record=None if n in (4, 5, 7) else dict(samples=0, throughput=None))
      for n in range(1, 8)]),
    ("no begin hook: the previous end is the begin, outside unknown",
     dict(schedule=RecordSchedule(1)), {}, {},
     [("end", 1, 0.5), ("end", 2, 0.75)],
     [dict(step=1, seconds=None, outside=None, record=dict(elapsed=0.0, step_time=None)),
      dict(step=2, seconds=0.25, outside=None, record=dict(elapsed=0.25, step_time=0.25))]),
    ("an integration's end mark ends the step; the next outside starts there",
     dict(schedule=RecordSchedule(1)), {}, {},
     [("begin", 0.0), ("mark", 0.08), ("end", 1, 0.1), ("begin", 0.12), ("end", 2, 0.2)],
     [dict(step=1, seconds=0.08), dict(step=2, seconds=0.08, outside=0.04)]),
    ("an end mark outside [begin, now] is not this step's",
     dict(schedule=RecordSchedule(1)), {}, {},
     [("mark", 0.05), ("begin", 0.1), ("end", 1, 0.3)],
     [dict(step=1, seconds=0.2)]),
    ("sink mode: one end advances 4 steps and crosses the records at 2 and 4",
     dict(schedule=RecordSchedule(2), batch_size=8), {}, {},
     [("begin", 0.0), ("end", 4, 2.0), ("begin", 2.0), ("end", 5, 2.5),
      ("begin", 2.5), ("end", 8, 4.0)],
     [dict(step=4, advanced=4, seconds=0.5, samples=32,
           record=dict(elapsed=2.0, steps=4, samples=32, throughput=16.0, step_time=0.5)),
      dict(step=5, advanced=1, record=None),
      dict(step=8, advanced=3, seconds=0.5, samples=24,
           record=dict(elapsed=2.0, steps=4, samples=32, throughput=16.0, step_time=0.5))]),
    ("resume: cur_step_num continues from where the run stopped",
     dict(schedule=RecordSchedule(50)), dict(cur_step_num=100), {},
     [("end", 101, 1.0), ("end", 150, 2.0)],
     [dict(step=101, previous_step=100, advanced=1, record=None),
      dict(step=150, advanced=49, record=dict(steps=50))]),
    ("initial_epoch: cur_step_num restarts at 1 in epoch 3 of 10 steps",
     dict(schedule=RecordSchedule(5)), {},
     dict(batch_num=10, epoch=3, epoch_num=3),
     [("end", 1, 1.0), ("end", 4, 2.0)],
     [dict(step=21, previous_step=20, record=None),
      dict(step=24, advanced=3, record=None)]),
    ("an integration's resume_step (mindformers initial_step)",
     dict(schedule=RecordSchedule(10)), dict(resume_step=500), {},
     [("end", 1, 1.0), ("end", 10, 2.0)],
     [dict(step=501, previous_step=500), dict(step=510, record=dict(steps=10))]),
    ("a step counter that goes back looks for the next record again",
     dict(schedule=RecordSchedule(10)), {}, {},
     [("end", 9, 1.0), ("end", 3, 2.0), ("end", 10, 3.0)],
     [dict(step=9, record=None), dict(step=3, advanced=1, record=None),
      dict(step=10, record=dict(steps=17))]),
]


def _run(clock: StepClock, events: list[tuple], first: dict) -> list[Tick]:
    ticks = []
    for event in events:
        if event[0] == "begin":
            clock.begin(event[1])
            assert clock.in_step_since == event[1]
        elif event[0] == "mark":
            clock.mark_end(event[1])
        else:
            if not clock.started:
                clock.first_step(event[1], **first)
            ticks.append(clock.end(event[1], event[2]))
            assert clock.in_step_since is None   # between steps
    return ticks


@pytest.mark.parametrize("name, make, begin, first, events, expected", CASES,
                         ids=[case[0] for case in CASES])
def test_step_clock(name, make, begin, first, events, expected):
    clock = StepClock(make["schedule"], make.get("batch_size"))
    clock.train_begin(**{"cur_step_num": 0, **begin})
    ticks = _run(clock, events, first)
    assert len(ticks) == len(expected)
    for tick, want in zip(ticks, expected, strict=True):
        for key, value in want.items():
            got = getattr(tick, key)
            if key == "record" and value is not None:
                assert got is not None, (name, tick)
                for field, v in value.items():
                    assert getattr(got, field) == pytest.approx(v), (name, field, got)
            else:
                assert got == pytest.approx(value) if isinstance(value, float) else got == value, \
                    (name, key, tick)


def test_total_steps_of_a_resumed_epoch_run_and_progress():
    clock = StepClock(RecordSchedule(5))
    clock.train_begin(0, total_steps=30)
    clock.first_step(1, batch_num=10, epoch=3, epoch_num=3)   # initial_epoch=2 of 5 epochs
    assert clock.total_steps == 50
    clock.end(5, 1.0)
    assert clock.last_step == 25 and clock.progress == pytest.approx(0.5)
    clock.end(40, 2.0)
    assert clock.progress == 1.0                                # capped


@pytest.mark.parametrize("interval, early, early_interval",
                         list(itertools.product((1, 3, 10), (0, 2, 7), (1, 2, 3))))
def test_next_record_step_agrees_with_the_config(interval, early, early_interval):
    cfg = parse_config({"step_interval": interval, "early_steps": early,
                        "early_step_interval": early_interval})
    schedule = RecordSchedule(interval, early, early_interval)
    for step in range(0, 60):
        following = next(s for s in range(step + 1, step + 100) if cfg.is_record_step(s))
        assert schedule.next_after(step) == following, step
        assert schedule.is_record_step(step + 1) == cfg.is_record_step(step + 1)
