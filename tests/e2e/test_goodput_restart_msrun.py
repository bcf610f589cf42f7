"""Goodput across a restart, on a real 2-rank `msrun` job watched by a real Prometheus with the
shipped rules (issue 35's test): the recorded account agrees with the job's own ground truth.

The job (tests/support/scripts/goodput_train.py, run id fixed): 3 epochs of 8 steps, a
checkpoint every epoch (step 8, 16, 24), an evaluation after epochs 1 and 2, host time in every
phase (a step, between steps, each save, each evaluation). Attempt 1 is SIGKILLed after step 12
(mid-way between the checkpoints at 8 and 16; its ranks wait for input there); attempt 2 starts
after a pause, resumes from the checkpoint at step 8 (steps 9-12 are done again), waits 7 s
after step 19 (a stall past the 4 s threshold) and completes. Prometheus scrapes every second
and evaluates every rule every second, the goodput records every 5 s (1m as shipped: the job
would wait for them); the kill falls between two of their evaluations.

The truth (tests/support/goodput_truth.py) is cut from the script's own clock reads; every
category's share of the wall clock, as Prometheus recorded it, agrees with it within 2
percentage points, and `mfotel goodput` on the ranks' monitor logs agrees with Prometheus.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from pathlib import Path

import pytest

from mfotel.alerting import goodput
from mfotel.simulation.stack import SimStack
from tests.support.cli import mfotel
from tests.support.goodput_truth import CATEGORIES, Truth, read_events, run_truth
from tests.support.jobtruth import JOB_RULES
from tests.support.multirank import VENV_BIN, child_env, free_port, free_port_block, start, stop
from tests.support.paths import SUPPORT
from tests.support.waiting import msrun_startup, settle, wait_for

pytestmark = pytest.mark.slow

SCRIPT = SUPPORT / "scripts" / "goodput_train.py"
JOB, RUN_ID = "gp", "gp-run-1"
RANKS, KILL_AFTER, CHECKPOINT_BEFORE = 2, 12, 8
STALL_SECONDS = 4
#: The job-level rules (every `for:` shortened) with the stall threshold of the job's time
#: accounts.
RULES = dataclasses.replace(JOB_RULES, stall_seconds=STALL_SECONDS)
#: The goodput records' interval here (1m as shipped): the rules are the same, each increase
#: reads the evaluation one interval before.
GOODPUT_INTERVAL = "5s"
PAUSE = 3.0        # between the kill and the next attempt's launch
TOLERANCE = 0.02   # of the wall clock


def _launch(workdir: Path, port: int, attempt: int, *extra: str):
    command = [str(VENV_BIN / "msrun"), f"--worker_num={RANKS}", f"--local_worker_num={RANKS}",
               "--master_addr=127.0.0.1", f"--master_port={free_port()}", "--join=True",
               f"--log_dir={workdir / f'msrun-logs-{attempt}'}", str(SCRIPT),
               "--port", str(port), "--job-name", JOB, "--run-id", RUN_ID,
               "--file-sd", str(workdir / "targets" / "job.json"), "--workdir", str(workdir),
               "--stall-seconds", str(STALL_SECONDS), *extra]
    return start(command, child_env(), workdir / f"msrun-{attempt}.log", workdir)


def _truth(workdir: Path) -> list:
    return [read_events(workdir / "truth" / f"rank_{rank}.jsonl") for rank in range(RANKS)]


def _blocked(workdir: Path) -> list[int] | None:
    """The pids of attempt 1's ranks once both wait after step KILL_AFTER."""
    try:
        ranks = _truth(workdir)
    except (OSError, ValueError, IndexError):
        return None
    if len(ranks) == RANKS and all(r and r[-1].blocked is not None for r in ranks):
        return [r[-1].pid for r in ranks]
    return None


def _kill(pid: int) -> None:
    """SIGKILL a rank (its cmdline checked: never a reused pid)."""
    try:
        if str(SCRIPT).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
            os.kill(pid, signal.SIGKILL)
    except (OSError, ProcessLookupError):
        pass


def _recorded(stack: SimStack) -> dict[str, float]:
    """The run's totals as Prometheus recorded them: each category's seconds, `wall`,
    `recomputed_steps` and `attempts`."""
    run = f'job_name="{JOB}", run_id="{RUN_ID}"'
    found = {row["metric"]["category"]: float(row["value"][1])
             for row in stack.prometheus.query(f"{goodput.CATEGORY_TOTAL}{{{run}}}")}
    for name, record in (("wall", goodput.WALL), ("recomputed_steps", goodput.RECOMPUTED_TOTAL),
                         ("attempts", f"sum_over_time({goodput.ATTEMPTS}[10m])")):
        rows = stack.prometheus.query(record.replace("[", f"{{{run}}}[") if "[" in record
                                      else f"{record}{{{run}}}")
        if rows:
            found[name] = float(rows[0]["value"][1])
    return found


def _after_the_last_line(workdir: Path) -> dict[str, float]:
    """Seconds of the run after its last step's end (its last monitor line), by category,
    from the truth: the saves there, and the rest as input (the mean of the ranks)."""
    after = {"checkpoint": 0.0, "input": 0.0}
    for attempts in _truth(workdir):
        last = attempts[-1]
        assert last.end is not None
        ended = max(end for _, _, end in last.steps)
        saved = sum(e - b for b, e in last.saves if b >= ended)
        after["checkpoint"] += saved / RANKS
        after["input"] += (last.end - ended - saved) / RANKS
    return after


def _dump(stack: SimStack, path: Path) -> None:
    """The job's raw and recorded goodput series of the last 10 minutes, for a failure's
    reader (path: JSON, {name: [{metric, values}]})."""
    names = ["mindformers_train_steps_total", "mindformers_train_step",
             "mindformers_train_process_start_timestamp_seconds",
             "mindformers_train_time_seconds_total", goodput.STEPS_INCREASE, goodput.STEP_MIN,
             goodput.PROCESS_START, goodput.LAST_EVENT, goodput.ATTEMPTS, goodput.DOWNTIME,
             goodput.RECOMPUTED_STEPS, goodput.CATEGORY_INCREASE]
    path.write_text(json.dumps({name: stack.prometheus.query(f'{name}{{job_name="{JOB}"}}[10m]')
                                for name in names}))


def _table(truth: Truth, recorded: dict[str, float], logged: dict) -> str:
    lines = [f"{'category':<12} {'truth s':>9} {'truth':>7} {'prom s':>9} {'prom':>7} "
             f"{'logs s':>9} {'logs':>7}"]
    for name in (*CATEGORIES, "unaccounted"):
        t = truth.seconds.get(name, 0.0)
        lines.append(f"{name:<12} {t:>9.3f} {t / truth.wall:>7.2%} {recorded[name]:>9.3f} "
                     f"{recorded[name] / recorded['wall']:>7.2%} {logged['seconds'][name]:>9.3f} "
                     f"{logged['shares'][name]:>7.2%}")
    lines.append(f"{'wall':<12} {truth.wall:>9.3f} {'':>7} {recorded['wall']:>9.3f} {'':>7} "
                 f"{logged['wall_seconds']:>9.3f}")
    return "\n".join(lines)


def test_goodput_across_a_kill_and_a_resume_agrees_with_the_jobs_truth(tmp_path, monkeypatch):
    monkeypatch.setattr(goodput, "INTERVAL", GOODPUT_INTERVAL)
    began = time.time()
    port = free_port_block(RANKS)
    (tmp_path / "targets").mkdir()   # Prometheus watches it from its start
    stack = SimStack(tmp_path, tmp_path / "targets" / "*.json", 1.0, RULES).start()
    runs = []
    try:
        # attempt 1: killed after step 12, once Prometheus scraped it on both ranks
        runs.append(_launch(tmp_path, port, 1, "--block-after", str(KILL_AFTER)))
        pids = wait_for(lambda: _blocked(tmp_path), msrun_startup() + 60, 0.5,
                        "attempt 1 waiting after step 12", alive=runs)
        scraped = f'mindformers_train_step{{job_name="{JOB}"}} == {KILL_AFTER}'
        wait_for(lambda: len(stack.prometheus.query(scraped)) == RANKS, settle(5), 0.2,
                 "step 12 scraped on both ranks")
        for pid in pids:
            _kill(pid)
        stop(runs[0])
        time.sleep(PAUSE)
        # attempt 2: resumes from the checkpoint at step 8, stalls, completes
        runs.append(_launch(tmp_path, port, 2, "--resume", "--stall-after", "19",
                            "--stall-sleep", "7"))
        runs[1].wait(timeout=msrun_startup() + 180)
        assert runs[1].returncode == 0, (tmp_path / "msrun-2.log").read_text()[-3000:]
        truth = run_truth(_truth(tmp_path), STALL_SECONDS)

        def settled() -> dict[str, float] | None:
            found = _recorded(stack)
            # the run's last event reached the records: the wall clock ends at the run's end
            return found if "wall" in found and abs(found["wall"] - truth.wall) < 1.0 else None
        recorded = wait_for(settled, settle(15), 0.5, "the run's end in the goodput records")
    finally:
        for run in runs:
            stop(run)
        try:
            _dump(stack, tmp_path / "series.json")
        finally:
            stack.stop()
    logs = [str(tmp_path / f"monitor_{rank}.log") for rank in range(RANKS)]
    done = mfotel("goodput", *logs, "--json")
    assert done.returncode == 0, done.stderr
    logged = json.loads(done.stdout)
    print(f"\n[goodput e2e] {time.time() - began:.0f} s wall\n" + _table(truth, recorded, logged))

    # the steps done again: exactly those between the checkpoint and the kill
    assert truth.recomputed == list(range(CHECKPOINT_BEFORE + 1, KILL_AFTER + 1))
    assert recorded["attempts"] == 2
    assert recorded["recomputed_steps"] == len(truth.recomputed)
    assert logged["recomputed_steps"] == len(truth.recomputed)
    # every category of Prometheus' account within 2 points of the truth
    assert recorded["wall"] == pytest.approx(truth.wall, abs=1.0)
    for name in CATEGORIES:
        assert recorded[name] / recorded["wall"] == pytest.approx(
            truth.seconds[name] / truth.wall, abs=TOLERANCE), name
    assert abs(recorded["unaccounted"]) / recorded["wall"] < TOLERANCE
    # every phase happened: none of the agreements is 0 = 0
    assert all(truth.seconds[name] > 0.5 for name in CATEGORIES), truth.seconds
    # the logs' account agrees with Prometheus', but for what came after the last line (step
    # 24's end): the last save and the input to the end
    assert logged["attempts"] == 2 and logged["ranks"] == RANKS
    after = _after_the_last_line(tmp_path)
    for name in (*CATEGORIES, "unaccounted"):
        assert (logged["seconds"][name] + after.get(name, 0.0)) / recorded["wall"] == \
            pytest.approx(recorded[name] / recorded["wall"], abs=TOLERANCE), name
