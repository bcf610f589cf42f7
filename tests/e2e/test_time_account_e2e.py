"""The process's time account in a real training (MindSpore, CPU, its own process): what a
scrape of the finished run shows adds up to the process's wall time since it started, and the
monitor lines carry the account `mfotel goodput` reads, in agreement with the scrape.

The run (tests/support/scripts/time_account_train.py): 30 steps recorded every 5, a
checkpoint every 10 steps (the checkpoint callback after the monitor: its saves fall between
steps), an evaluation after the epoch (Model.fit), /metrics kept up until the final status is
scraped. Its last line is written at step 30's end; after it come step 30's save, the
evaluation and the end.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

import psutil
import pytest

from mfotel.time_account import PHASES
from tests.support.cli import mfotel
from tests.support.metrics import samples, scrape, value
from tests.support.multirank import child_env
from tests.support.paths import SUPPORT
from tests.support.waiting import startup, wait_for

pytestmark = pytest.mark.slow
SCRIPT = SUPPORT / "scripts" / "time_account_train.py"
COMPLETED = 2
MS = 2e-3   # the text line writes seconds to the millisecond (0.5 ms each way, two fields)
FIELD = 0.5e-3   # one field of a line, written to the millisecond
#: A line's process start is its time less its phases: 7 fields (seen: the unaccounted time,
#: the difference of two lines' starts, at 2.00004 ms)
START = (len(PHASES) + 1) * FIELD


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """(the scrape that saw the final status, when it was taken, the process's start by
    psutil, `mfotel goodput --json` of its log)."""
    from mfotel.localstack.servers import free_port
    workdir = tmp_path_factory.mktemp("time-account")
    port, log = free_port(), workdir / "monitor.log"
    opts = {"port": port, "log_file": str(log), "checkpoint_dir": str(workdir / "ckpt")}
    with open(workdir / "run.out", "wb") as out:
        process = subprocess.Popen([sys.executable, str(SCRIPT), json.dumps(opts)],
                                   env=child_env(PWD=str(workdir)), cwd=workdir, stdout=out,
                                   stderr=subprocess.STDOUT)
    try:
        started = psutil.Process(process.pid).create_time()
        url = f"http://127.0.0.1:{port}/metrics"

        def final() -> dict | None:
            try:
                body = samples(scrape(url))
            except OSError:
                return None
            return body if value(body, "mindformers_train_status") == COMPLETED else None
        body = wait_for(final, startup() + 120, interval=0.2, alive=[process],
                        message="the run's final status on /metrics")
        scraped_at = time.time()
        assert process.wait(timeout=60) == 0, (workdir / "run.out").read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    done = mfotel("goodput", str(log), "--json")
    assert done.returncode == 0, done.stderr
    return body, scraped_at, started, json.loads(done.stdout), log.read_text()


def phases(body: dict) -> dict[str, float]:
    found = {phase: value(body, "mindformers_train_time_seconds_total", phase=phase)
             for phase in PHASES}
    assert None not in found.values(), found
    return found  # type: ignore[return-value]


def test_the_phases_add_up_to_the_process_wall_time_since_its_start(finished_run):
    body, scraped_at, started, _, _ = finished_run
    seconds, origin = phases(body), value(body, "mindformers_train_process_start_timestamp_seconds")
    ended = value(body, "mindformers_train_end_timestamp_seconds")
    assert origin == pytest.approx(started, abs=1.0)             # /proc, as psutil reads it
    assert sum(seconds.values()) == pytest.approx(ended - origin, abs=1e-6)  # closed at the end
    assert 0 <= scraped_at - ended < 60                          # the linger until this scrape
    print("\n" + ", ".join(f"{phase} {s:.3f} s" for phase, s in seconds.items()))
    assert seconds["startup"] > 0 and seconds["step"] > 0 and seconds["input"] > 0
    assert seconds["stall"] == 0
    # saves at steps 10, 20, 30 and the evaluation, carved out where they ran
    assert value(body, "mindformers_train_checkpoints_total") == 3
    assert seconds["checkpoint"] >= value(body, "mindformers_train_checkpoint_duration_seconds")
    assert seconds["evaluation"] == pytest.approx(
        value(body, "mindformers_train_eval_duration_seconds"), abs=1e-6)


def test_the_lines_carry_the_account_and_mfotel_goodput_agrees_with_the_scrape(finished_run):
    body, _, _, account, text = finished_run
    lines = [line for line in text.splitlines() if line.startswith("[Monitor]")]
    assert len(lines) == 6 and all("account_steps: " in line and "account_stall: " in line
                                   for line in lines)
    assert "account_steps: 30," in lines[-1]
    seconds, origin = phases(body), value(body, "mindformers_train_process_start_timestamp_seconds")
    logged = account["seconds"]
    assert account["attempts"] == 1 and account["recomputed_steps"] == 0
    assert account["start"] == pytest.approx(origin, abs=START)   # the line's time less its phases
    assert logged["unaccounted"] == pytest.approx(0, abs=2 * START)   # last line's start - first's
    assert logged["downtime"] == 0 and logged["recomputed"] == 0
    # the same account, read at step 30's end: what came after is the scrape's alone
    assert logged["goodput"] == pytest.approx(seconds["step"], abs=MS)
    assert logged["startup"] == pytest.approx(seconds["startup"], abs=MS)
    assert logged["stall"] == seconds["stall"] == 0
    assert logged["evaluation"] == 0 < seconds["evaluation"]
    last_save = value(body, "mindformers_train_checkpoint_duration_seconds")   # step 30's
    assert seconds["checkpoint"] - logged["checkpoint"] == pytest.approx(last_save, abs=MS)
    assert logged["input"] < seconds["input"]
    # the log's wall clock ends at its last line, the scrape's account at the run's end
    ended = value(body, "mindformers_train_end_timestamp_seconds")
    assert account["wall_seconds"] == pytest.approx(account["end"] - origin, abs=START)
    assert sum(seconds.values()) - account["wall_seconds"] == pytest.approx(
        ended - account["end"], abs=START)
