"""A run's goodput account from the training script's own clock reads (the ground truth of
tests/e2e/test_goodput_restart_msrun.py; tests/support/scripts/goodput_train.py writes them).

Each rank's timeline of each attempt (process) is cut into the categories of docs/metrics.md
("Goodput") by its events alone: start-up from the process start to its first step's end;
then each step (goodput, or recomputed at or below the highest step of the attempts before),
save (checkpoint) and evaluation where they ran; every other second between them input, unless
the time since the last step end passed the stall threshold (stall beyond it); downtime from
an attempt's last event to the next attempt's start. The run is the mean of its ranks.

    truth = run_truth([read_events(path) for path in truth_dir.glob("rank_*.jsonl")],
                      stall_seconds=4.0)
    truth.seconds["goodput"] / truth.wall
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CATEGORIES = ("goodput", "recomputed", "startup", "input", "checkpoint", "evaluation", "stall",
              "downtime")


@dataclass
class Attempt:
    """One process of a rank: its start, steps (step, begin, end), saves and evaluations
    (begin, end), and its end (None: killed)."""
    pid: int
    start: float
    steps: list[tuple[int, float, float]] = field(default_factory=list)
    saves: list[tuple[float, float]] = field(default_factory=list)
    evals: list[tuple[float, float]] = field(default_factory=list)
    blocked: float | None = None
    end: float | None = None

    @property
    def last_event(self) -> float:
        """Its last step end, save or evaluation end, or its end."""
        ends = [e for _, _, e in self.steps] + [e for _, e in self.saves + self.evals]
        return max([*ends, *([self.end] if self.end is not None else [])])


@dataclass
class Truth:
    """Seconds by category (CATEGORIES), the wall clock, the steps done again."""
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))
    wall: float = 0.0
    recomputed_steps: float = 0.0
    recomputed: list[int] = field(default_factory=list)   # the global steps done again

    def shares(self) -> dict[str, float]:
        return {name: value / self.wall for name, value in self.seconds.items()}


def read_events(path: Path) -> list[Attempt]:
    """A rank's truth file -> its attempts, in order."""
    attempts: list[Attempt] = []
    for line in path.read_text().splitlines():
        record: dict[str, Any] = json.loads(line)
        if "pid" in record:
            attempts.append(Attempt(record["pid"], record["start"]))
        elif "step" in record:
            attempts[-1].steps.append((record["step"], record["begin"], record["end"]))
        elif "save" in record:
            attempts[-1].saves.append((record["save"][0], record["save"][1]))
        elif "eval" in record:
            attempts[-1].evals.append((record["eval"][0], record["eval"][1]))
        elif "blocked" in record:
            attempts[-1].blocked = record["blocked"]
        elif "end" in record:
            attempts[-1].end = record["end"]
    return attempts


def rank_truth(attempts: Sequence[Attempt], stall_seconds: float,
               stall_step_factor: float = 10.0) -> Truth:
    """One rank's categories (module docstring)."""
    truth = Truth()
    seconds = truth.seconds
    high: int | None = None
    previous: Attempt | None = None
    for attempt in attempts:
        if previous is not None:
            seconds["downtime"] += attempt.start - previous.last_event
        (_, _, first_end), *later = attempt.steps
        seconds["startup"] += first_end - attempt.start
        intervals = sorted([("step", b, e, s) for s, b, e in later]
                           + [("checkpoint", b, e, 0) for b, e in attempt.saves]
                           + [("evaluation", b, e, 0) for b, e in attempt.evals],
                           key=lambda i: i[1])
        now, since_input, paced, counted = first_end, 0.0, 0.0, 0
        for kind, begin, end, step in intervals:
            since_input += begin - now   # outside the steps since the last step end
            now = end
            if kind != "step":
                seconds[kind] += end - begin
                continue
            threshold = max(stall_seconds, stall_step_factor * paced / counted) if counted \
                else stall_seconds
            kept_input = min(since_input, threshold)
            kept_step = min(end - begin, threshold - kept_input)
            seconds["input"] += kept_input
            seconds["stall"] += since_input + (end - begin) - kept_input - kept_step
            done_again = high is not None and step <= high
            seconds["recomputed" if done_again else "goodput"] += kept_step
            paced, counted, since_input = paced + kept_input + kept_step, counted + 1, 0.0
        if attempt.end is not None:
            seconds["input"] += attempt.end - now
        steps = [s for s, _, _ in attempt.steps]
        if high is not None:
            truth.recomputed += [s for s in steps if s <= high]
        high = max([*steps, *([high] if high is not None else [])])
        previous = attempt
    assert previous is not None and previous.end is not None, "the run did not end"
    truth.wall = previous.end - attempts[0].start
    truth.recomputed_steps = float(len(truth.recomputed))
    return truth


def run_truth(ranks: Sequence[Sequence[Attempt]], stall_seconds: float) -> Truth:
    """The run's: the mean of its ranks' truths."""
    each = [rank_truth(attempts, stall_seconds) for attempts in ranks]
    run = Truth()
    run.seconds = {name: sum(t.seconds[name] for t in each) / len(each) for name in CATEGORIES}
    run.wall = sum(t.wall for t in each) / len(each)
    run.recomputed_steps = sum(t.recomputed_steps for t in each) / len(each)
    run.recomputed = each[0].recomputed
    return run
