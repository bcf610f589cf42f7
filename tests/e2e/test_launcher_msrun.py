"""A job of real msrun with 2 CPU ranks (examples/multirank/train_dp.py), cancelled through
`mfotel-instrument`: every rank reports cancelled, nobody is paged, no process is left behind.

msrun alone mishandles a cancel (tests below pin it, through `mfotel-instrument --exec`, which
behaves as before): on SIGTERM it exits and leaves its workers running, on SIGINT it SIGKILLs
them and they page as dead ranks. Real signals, a real Prometheus with the shipped rules at test
thresholds. The launcher's signal handling with plain commands (seconds, no MindSpore):
tests/unit/test_launcher_signals.py.
"""
from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mfotel import contract
from mfotel.localstack.servers import Prometheus, free_port_block
from tests.support.cli import INSTRUMENT
from tests.support.multirank import EXAMPLE, VENV_BIN, child_env, stop
from tests.support.processes import (
    TAG,
    kill_tagged,
    proc_stat,
    running,
    running_in_groups,
    session,
    signal_all,
    tree,
)
from tests.support.prometheus import INTERVAL, RANK_DOWN_FOR, alerts_until_quiet, rules_prometheus
from tests.support.waiting import msrun_startup, settle, wait_for

JOB = "launcher-signals"
LINGER = 20.0  # each rank keeps /metrics up at most this long for its final scrape
#: Each rank sleeps this long inside each step: what these tests watch is how the job ends,
#: and a bare step costs a rank ~5 ms of CPU (at 0.05 s, 10% of a core each, the whole test).
STEP_SLEEP = 0.2


class MsrunJob:
    """`mfotel-instrument [options] msrun` of 2 CPU ranks training train_dp.py slowly."""

    def __init__(self, work: Path, base_port: int, options: list[str]) -> None:
        self.work, self.base_port = work, base_port
        args = ["--steps", "100000", "--port", str(base_port), "--job-name", JOB,
                "--linger-seconds", str(LINGER), "--step-sleep", str(STEP_SLEEP), "--log-rank", "0"]
        msrun = [str(VENV_BIN / "msrun"), "--worker_num=2", "--local_worker_num=2",
                 "--master_addr=127.0.0.1", f"--master_port={free_port_block(1)}", "--join=True",
                 f"--log_dir={work / 'logs'}", str(EXAMPLE), *args]
        if "--exec" not in options:  # the node agent runs too, on loopback
            config = work / "agent.yaml"
            config.write_text(f"monitor_config:\n  job_name: {JOB}\n  prometheus: "
                              f"{{host: 127.0.0.1, port: {base_port}}}\n")
            options = ["--config", str(config), "--node-port", str(free_port_block(1)),
                       *options]
        self.log = work / "launcher.log"
        with open(self.log, "wb") as out:
            # tagged with the test's folder: the fixture finds the orphans by it
            env = child_env(PWD=str(work), **{TAG: str(work)})
            self.process = subprocess.Popen([*INSTRUMENT, *options, *msrun], cwd=work, env=env,
                                            stdout=out, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        self.exited_at: float | None = None

    def processes(self) -> dict[int, int]:
        """pid -> process group of every process below the launcher."""
        found = {}
        for pid in tree(self.process.pid):
            stat = proc_stat(pid)
            if stat is not None:
                found[pid] = stat[1]
        return found

    def workers(self) -> list[int]:
        """The ranks: msrun starts each in a session of its own."""
        return [pid for pid in self.processes() if session(pid) == pid]

    def wait(self, timeout: float = 120) -> int:
        code = self.process.wait(timeout=timeout)
        self.exited_at = time.time()
        return code

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture
def msrun_job(tmp_path) -> Iterator[Any]:
    jobs: list[MsrunJob] = []

    def start(base_port: int, *options: str) -> MsrunJob:
        jobs.append(MsrunJob(tmp_path, base_port, list(options)))
        return jobs[-1]
    yield start
    for job in jobs:
        stop(job.process)
    # the orphans of a test that pins msrun's own behaviour (msrun exited, its ranks and log
    # tails did not): no longer below msrun, found by the tag they inherited
    kill_tagged(str(tmp_path))


@pytest.fixture
def prometheus(tmp_path) -> Iterator[tuple[Prometheus, int]]:
    """A real Prometheus scraping both ranks every second with the generated rules."""
    base = free_port_block(2)
    with rules_prometheus(tmp_path, [f"127.0.0.1:{base}", f"127.0.0.1:{base + 1}"]) as prom:
        yield prom, base


def statuses(prom: Prometheus) -> dict[str, float]:
    """The last status Prometheus scraped from each rank."""
    result = prom.query(f'last_over_time(mindformers_train_status{{job_name="{JOB}"}}[10m])')
    return {r["metric"]["rank"]: float(r["value"][1]) for r in result}


def both_running(prom: Prometheus, job: MsrunJob) -> None:
    wait_for(lambda: statuses(prom) == {"0": contract.STATUS_RUNNING,
                                        "1": contract.STATUS_RUNNING},
             msrun_startup() + settle(INTERVAL), INTERVAL, "both ranks running in Prometheus",
             alive=[job.process])


def scrapes_of_the_end(prom: Prometheus, job: MsrunJob) -> str:
    """What a failure to see the final statuses needs: what Prometheus holds, how its last
    scrapes of the ranks went, the ranks' last log lines and the launcher's (the node agent's
    account of how each process ended)."""
    scrapes = prom.query("max_over_time(scrape_duration_seconds[2m]) or "
                         "min_over_time(up[2m])")
    logs = {path.name: path.read_text(errors="replace").splitlines()[-5:]
            for path in sorted((job.work / "logs").glob("worker_*.log"))}
    return (f"statuses: {statuses(prom)}\nscrapes: {scrapes}\nlogs: {logs}\n"
            f"launcher: {job.output()[-3000:]}")


def signal_every_process(job: MsrunJob, signum: int) -> None:
    """As Slurm cancels a step (proctrack/cgroup): every process of it, launcher included."""
    signal_all([job.process.pid, *job.processes()], signum)


@pytest.mark.slow
@pytest.mark.parametrize("signum, delivery", [
    (signal.SIGTERM, "launcher"), (signal.SIGINT, "launcher"), (signal.SIGTERM, "every")],
    ids=["SIGTERM", "SIGINT", "SIGTERM-to-every-process"])
def test_cancelled_msrun_job_reports_cancelled_on_every_rank_and_pages_nobody(
        prometheus, msrun_job, signum, delivery):
    prom, base = prometheus
    job = msrun_job(base)
    both_running(prom, job)
    processes = job.processes()
    assert len(job.workers()) == 2, job.output()[-3000:]
    if delivery == "launcher":
        job.process.send_signal(signum)  # kubectl delete pod (PID 1), kill, Ctrl-C
    else:
        signal_every_process(job, signum)  # scancel
    signalled = time.monotonic()
    # the conventional status
    assert job.wait(timeout=LINGER + 60) == -signum, scrapes_of_the_end(prom, job)
    assert time.monotonic() - signalled < LINGER + 30
    cancelled = {"0": contract.STATUS_CANCELLED, "1": contract.STATUS_CANCELLED}
    # the final scrapes were answered before the ranks exited; stored a moment later
    wait_for(lambda: statuses(prom) == cancelled, settle(INTERVAL), 0.1, "final statuses",
             details=lambda: scrapes_of_the_end(prom, job))
    assert alerts_until_quiet(prom, JOB, job.exited_at, "10m") == []
    # no worker, scheduler or log tail survives, by pid and by process group
    assert [pid for pid in processes if running(pid)] == []
    assert running_in_groups(set(processes.values())) == []
    assert "Traceback" not in (job.work / "logs" / "worker_0.log").read_text(errors="replace")
    # each rank said why it stayed after the signal, and that its final status was read (as
    # SIGTERM after SIGINT too: MindSpore's SIGINT handler sends the rank SIGTERM)
    for log in sorted((job.work / "logs").glob("worker_*.log")):
        told = log.read_text(errors="replace")
        assert "mfotel: SIGTERM: keeping /metrics up for the final scrape (at most " \
               f"{LINGER:.0f} s)" in told, told[-2000:]
        assert "mfotel: the final status was scraped after " in told, told[-2000:]


@pytest.mark.slow
def test_msrun_alone_leaves_its_workers_running_on_sigterm(prometheus, msrun_job):
    """Why mfotel-instrument passes signals on: `--exec` (as before) leaves them to msrun,
    which exits and leaves both ranks training as orphans, still saying running."""
    prom, base = prometheus
    job = msrun_job(base, "--exec")
    both_running(prom, job)
    workers = job.workers()
    job.process.send_signal(signal.SIGTERM)
    assert job.wait(timeout=60) == -signal.SIGTERM
    assert len(workers) == 2 and all(running(pid) for pid in workers)
    assert statuses(prom) == {"0": contract.STATUS_RUNNING, "1": contract.STATUS_RUNNING}


@pytest.mark.slow
def test_msrun_alone_kills_its_workers_on_sigint_and_they_page(prometheus, msrun_job):
    """Ctrl-C to msrun without mfotel-instrument passing it on: msrun SIGKILLs the ranks
    (they never report cancelled), exits 0, and the job pages MindFormersRankDown (for the
    rank seen leaving first: both vanish within a scrape, so which one is not told)."""
    prom, base = prometheus
    job = msrun_job(base, "--exec")
    both_running(prom, job)
    workers = job.workers()
    job.process.send_signal(signal.SIGINT)
    assert job.wait(timeout=60) == 0
    wait_for(lambda: not any(running(pid) for pid in workers), settle(), message="the ranks killed")
    firing = f'ALERTS{{alertname="MindFormersRankDown", alertstate="firing", job_name="{JOB}"}}'
    alerts = wait_for(lambda: prom.query(firing), settle(INTERVAL, RANK_DOWN_FOR, INTERVAL),
                      message="MindFormersRankDown firing")
    assert {a["metric"]["severity"] for a in alerts} == {"critical"}
    assert {a["metric"]["rank"] for a in alerts} <= {"0", "1"}
    assert statuses(prom) == {"0": contract.STATUS_RUNNING, "1": contract.STATUS_RUNNING}
