"""The goodput account offline (`mfotel goodput`, mfotel.logs.goodput) and its agreement with
the live rules (mfotel.alerting.goodput): one fact table, a 2-rank run driven through real
time accounts (mfotel.time_account), gives both the monitor lines of its attempts and the
series Prometheus would scrape; `mfotel goodput` on the lines and promtool on the shipped
rules must both give the hand-worked account (the run of promtool_tests/goodput.yml)."""
from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from mfotel.alerting import goodput as rules
from mfotel.cli import main
from mfotel.logs.goodput import CATEGORIES, Mark, rank_account, run_account
from mfotel.sinks import format_json, format_line
from mfotel.time_account import PHASES, TimeAccount
from tests.support.paths import ROOT
from tests.support.promtool import TIMEOUT, promtool, promtool_env

T0 = 1_764_000_000.0          # the run's first process start (unix seconds)
#: The hand-worked account (promtool_tests/goodput.yml, first test): seconds per category.
HAND = {"goodput": 957, "recomputed": 423, "startup": 480, "input": 420, "checkpoint": 30,
        "evaluation": 30, "stall": 60, "downtime": 300, "unaccounted": 0}


@dataclass
class Reading:
    """What a scrape at a minute shows of one rank (None: its process is gone)."""
    phases: dict[str, float]
    origin: float
    steps: int
    step: int | None
    status: int


@dataclass
class RankRun:
    """One rank's facts: a reading per minute, and the monitor lines it wrote."""
    readings: dict[int, Reading | None] = field(default_factory=dict)
    lines: list[tuple[float, int, dict[str, float]]] = field(default_factory=list)


class Rank:
    """One rank of the fact table: its process's time account, its global step, what each
    minute's scrape shows and the lines it writes."""

    def __init__(self, step_seconds: float, input_seconds: float) -> None:
        self.cycle = (input_seconds, step_seconds)
        self.out = RankRun()
        self.account = TimeAccount(T0)
        self.step: int | None = None

    def start(self, origin: float) -> None:
        self.account, self.step = TimeAccount(origin, stall_seconds=120), None

    def read(self, minute: int, status: int, line: bool = False) -> None:
        account = self.account
        self.out.readings[minute] = Reading(dict(account.totals), account.origin, account.steps,
                                            self.step, status)
        if line:
            assert self.step is not None
            self.out.lines.append((account.last_event, self.step, account.line_values()))

    def first_step(self, at: float, step: int) -> None:
        self.account.step_begin(at - 5)
        self.account.step_end(at)
        self.step = step

    def steps(self, minute: int, count: int) -> None:
        (input_seconds, step_seconds), t = self.cycle, T0 + minute * 60
        for _ in range(count):
            self.account.step_begin(t + input_seconds)
            self.account.step_end(t + input_seconds + step_seconds)
            self.step = (self.step or 0) + 1
            t += input_seconds + step_seconds


def simulate(step_seconds: float, input_seconds: float) -> RankRun:
    """The run of promtool_tests/goodput.yml for one rank: 10 steps a minute (a step and its
    input take 6 s); attempt 1 from 0 s (start-up 300 s, a 30 s save after step 46 at 10m, a
    30 s evaluation at 15m, killed after step 141 at 20m); attempt 2 from 1500 s, resumed after
    step 46 (start-up 180 s), hung inside step 158 from 39m to 42m (stall threshold 120 s),
    completed at 45m after step 188. A record (a line) at each step that ends on a minute."""
    rank = Rank(step_seconds, input_seconds)
    rank.start(T0)
    for minute in range(5):
        rank.read(minute, 0)
    rank.first_step(T0 + 300, 1)
    rank.read(5, 1, line=True)
    for minute in range(5, 20):
        extra = {9: "checkpoint", 14: "evaluation"}.get(minute)
        rank.steps(minute, 5 if extra else 10)
        if extra:
            rank.account.interval(extra, 30, T0 + (minute + 1) * 60)
        rank.read(minute + 1, 1, line=True)
    for minute in range(21, 26):
        rank.out.readings[minute] = None
    rank.start(T0 + 1500)
    rank.read(26, 0), rank.read(27, 0)
    rank.first_step(T0 + 28 * 60, 47)
    rank.read(28, 1, line=True)
    for minute in range(28, 39):
        rank.steps(minute, 10)
        rank.read(minute + 1, 1, line=True)
    rank.account.step_begin(T0 + 39 * 60)
    rank.read(40, 1), rank.read(41, 1)
    rank.account.step_end(T0 + 42 * 60)
    rank.step = 158
    rank.read(42, 1, line=True)
    for minute in range(42, 45):
        rank.steps(minute, 10)
        rank.read(minute + 1, 1 if minute + 1 < 45 else 2, line=True)
    rank.account.close(T0 + 45 * 60)
    rank.read(46, 2), rank.read(47, 2)
    return rank.out


RANKS = {0: simulate(5, 1), 1: simulate(4, 2)}


def write_logs(directory: Path) -> Path:
    """Each rank's monitor file, attempt 2 appended to attempt 1's (rank 0 text, rank 1 JSON)."""
    for rank, facts in RANKS.items():
        path = directory / f"train_monitor_{rank}.log"
        with open(path, "a", encoding="utf-8") as out:
            for wall, step, values in facts.lines:
                text = (format_line(step, {"loss": 2.0, **values}, wall) if rank == 0 else
                        format_json(step, 1, rank, "llama", {"loss": 2.0, **values}, wall))
                out.write(text + "\n")
    return directory


def test_the_time_accounts_of_the_fact_table_are_the_hand_worked_ones():
    rank0, rank1 = RANKS[0].readings[45], RANKS[1].readings[45]
    assert rank0 is not None and rank1 is not None
    assert rank0.phases == {"startup": 180, "step": 820, "input": 140, "checkpoint": 0,
                            "evaluation": 0, "stall": 60}
    assert rank1.phases["step"] == 680 and rank1.phases["input"] == 280
    assert RANKS[0].readings[20].phases["checkpoint"] == 30    # type: ignore[union-attr]


def test_goodput_of_the_logs_of_both_attempts_is_the_hand_worked_account(tmp_path, capsys):
    logs = write_logs(tmp_path)
    assert main(["goodput", str(logs), "--json", "-q"]) == 0
    account = json.loads(capsys.readouterr().out)
    assert account["seconds"] == pytest.approx(HAND, abs=1e-3)
    assert account["wall_seconds"] == pytest.approx(2700, abs=1e-3)
    assert account["recomputed_steps"] == 95          # steps 47..141: the checkpoint to the kill
    assert (account["ranks"], account["attempts"]) == (2, 2)
    assert account["shares"]["goodput"] == pytest.approx(957 / 2700, abs=1e-6)
    assert account["start"] == pytest.approx(T0, abs=1e-3)


def test_goodput_prints_a_table_of_the_categories(tmp_path, capsys):
    assert main(["goodput", str(write_logs(tmp_path)), "-q"]) == 0
    out = capsys.readouterr().out
    assert "2 rank(s), 2 attempt(s): wall clock 2700.000 s (45m 00s)" in out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[2:-1]}
    assert list(rows) == list(CATEGORIES)
    assert rows["goodput"] == ["957.000", "35.4%"] and rows["downtime"] == ["300.000", "11.1%"]
    assert out.endswith("recomputed steps: 95\n")


def test_logs_without_the_time_account_are_an_error_that_says_so(tmp_path, capsys):
    (tmp_path / "train_monitor_0.log").write_text(format_line(1, {"loss": 2.0}, T0) + "\n")
    assert main(["goodput", str(tmp_path), "-q"]) == 1
    assert "carries the time account" in capsys.readouterr().err


# ---------------------------------------------------------------- the account's rules, by hand
def mark(at: float, global_step: int, done: int, **phases: float) -> Mark:
    """A reading at `at` of a process that completed `done` steps, the last `global_step`."""
    return Mark(at, global_step, done, {p: phases.get(p, 0.0) for p in PHASES})


def test_a_new_process_counts_all_its_account_and_the_downtime_before_it():
    account = rank_account([
        mark(100, 10, 10, startup=40, step=50, input=10),
        mark(160, 20, 20, startup=40, step=100, input=20),
        # killed; a new process starts at 200 and resumes after step 15
        mark(260, 25, 10, startup=30, step=25, input=5),
    ])
    # steps 16..20 of the third reading's 10 (16..25) are done again: half its step time
    assert account.seconds["recomputed"] == 12.5 and account.recomputed_steps == 5
    assert account.seconds["goodput"] == 100 + 12.5
    assert account.seconds["downtime"] == 40 and account.seconds["startup"] == 70
    assert account.wall == 260 and account.seconds["unaccounted"] == 0
    assert account.attempts == 2


def test_the_run_is_the_mean_of_its_ranks_and_a_line_written_twice_counts_once():
    from mfotel.logs.goodput import marks_from_rows
    from mfotel.logs.parse import parse_lines
    values = {"account_steps": 1.0, "account_startup": 10.0, **{f"account_{p}": 0.0 for p in
                                                                 PHASES if p != "startup"}}
    text = format_line(1, values, T0 + 10)
    rows = list(parse_lines([text, text, format_json(1, 1, 0, "j", values, T0 + 10)]))
    assert len(marks_from_rows(rows)[0]) == 1
    run = run_account({0: [mark(10, 1, 1, startup=10)], 1: [mark(10, 1, 1, startup=6, input=4)]})
    assert run.seconds["startup"] == 8 and run.seconds["input"] == 2 and run.ranks == 2


# ---------------------------------------------------------------- live and offline agree
def _values(readings: dict[int, Reading | None], value) -> str:
    out, gone = [], False
    for minute in range(48):
        reading = readings[minute]
        if reading is None:
            out.append("_" if gone else "stale")
            gone = True
            continue
        gone = False
        got = value(reading)
        out.append("_" if got is None else f"{got:g}")
    return " ".join(out)


def scraped_series() -> list[dict[str, str]]:
    """The series Prometheus would have scraped from the fact table (test epoch: T0 = 0)."""
    series = []
    for rank, facts in RANKS.items():
        labels = (f'job="mindformers", instance="127.0.0.1:{9464 + rank}", job_name="llama", '
                  f'rank="{rank}"')
        def add(name: str, value, extra: str = "", labels: str = labels,
                readings: dict[int, Reading | None] = facts.readings) -> None:
            series.append({"series": f"{name}{{{labels}{extra}}}",
                           "values": _values(readings, value)})
        for phase in PHASES:
            add("mindformers_train_time_seconds_total",
                lambda x, p=phase: round(x.phases[p], 6), f', phase="{phase}"')
        add("mindformers_train_process_start_timestamp_seconds", lambda x: x.origin - T0)
        add("mindformers_train_steps_total", lambda x: x.steps)
        add("mindformers_train_step", lambda x: x.step)
        add("mindformers_train_status", lambda x: x.status)
        add("mindformers_train_rank_info", lambda x: 1, ', run_id="r1"')
    return series


def test_the_rules_and_the_logs_give_the_same_account(tmp_path, capsys):
    assert main(["goodput", str(write_logs(tmp_path)), "--json", "-q"]) == 0
    offline = json.loads(capsys.readouterr().out)
    labels = 'job_name="llama", run_id="r1"'
    test = {
        "rule_files": [str(ROOT / "prometheus" / "rules" / "mindformers-recording.yml")],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m", "input_series": scraped_series(),
            "promql_expr_test": [
                {"expr": rules.CATEGORY_TOTAL, "eval_time": "46m",
                 "exp_samples": [{"labels": f'{rules.CATEGORY_TOTAL}{{{labels}, '
                                            f'category="{name}"}}',
                                  "value": round(offline["seconds"][name], 6)}
                                 for name in CATEGORIES]},
                {"expr": rules.WALL, "eval_time": "46m",
                 "exp_samples": [{"labels": f"{rules.WALL}{{{labels}}}",
                                  "value": round(offline["wall_seconds"], 6)}]},
                {"expr": rules.RECOMPUTED_TOTAL, "eval_time": "46m",
                 "exp_samples": [{"labels": f"{rules.RECOMPUTED_TOTAL}{{{labels}}}",
                                  "value": offline["recomputed_steps"]}]},
            ]}]}
    path = tmp_path / "agree.yml"
    path.write_text(yaml.safe_dump(test, sort_keys=False, width=1000))
    done = subprocess.run([promtool(), "test", "rules", str(path)], capture_output=True,
                          text=True, timeout=TIMEOUT, env=promtool_env())
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_the_docs_name_every_goodput_record_and_no_other():
    """docs/metrics.md's records table lists every record of the goodput group, and no doc
    (nor the runbook) names a goodput record the rules do not make (a renamed one)."""
    from mfotel.alerting.thresholds import RulesConfig
    made = {r["record"] for r in rules.goodput_records(RulesConfig())}
    metrics = (ROOT / "docs" / "metrics.md").read_text()
    table = metrics.split("| record | meaning |", 1)[1].split("\n\n", 1)[0]
    listed = set(re.findall(r"^\| `([a-z0-9_:]+)(?:\{[a-z]+\})?` \|", table, re.M))
    assert listed == made
    pattern = re.compile(r"\b(?:job_name_run_id\w*|job_name_rank):mindformers_train_\w+:\w+")
    texts = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md",
             ROOT / "mfotel" / "alerting" / "prometheus" / "runbook.md"]
    named = {(path.name, name) for path in texts for name in pattern.findall(path.read_text())}
    goodput_like = {(where, name) for where, name in named
                    if name.startswith("job_name_run_id") or name.endswith(":last_scrape")}
    assert {name for _, name in goodput_like} <= made, sorted(
        (where, name) for where, name in goodput_like if name not in made)
