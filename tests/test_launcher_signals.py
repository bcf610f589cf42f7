"""A cancelled job launched through `mfotel-instrument` ends with every rank reporting
cancelled, pages nobody and leaves no process behind; plain commands keep their output, input
and exit status.

msrun alone mishandles a cancel (tests below pin it, through `mfotel-instrument --exec`, which
behaves as before): on SIGTERM it exits and leaves its workers running, on SIGINT it SIGKILLs
them and they page as dead ranks. mfotel-instrument stays the parent and passes the signal to
every process of the job, holding msrun until its workers ended.

Real msrun with 2 CPU ranks (examples/multirank/train_dp.py), real signals, a real Prometheus
with the shipped rules at test thresholds, a real terminal (pty) for job control. The fast
tests use small Python scripts as commands; `msrun_policy.py` copies msrun's signal policy in
a few lines so that the hold is tested in seconds (the msrun tests check it for real).
"""
from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from mfotel import contract
from mfotel.alerting.rules import write_rules
from mfotel.demo.stack import Prometheus, free_port_block
from multirank_support import EXAMPLE, VENV_BIN, child_env, stop, wait_until
from test_lifecycle import TEST_RULES, alerts_until_quiet

INSTRUMENT = [sys.executable, "-m", "mfotel.integrations.instrument"]
JOB = "launcher-signals"
LINGER = 20.0  # each rank keeps /metrics up at most this long for its final scrape


# ---------------------------------------------------------------- processes
def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, process group) of `pid`, None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[2])


def session(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[3])
    except (OSError, IndexError):
        return None


def running(pid: int) -> bool:
    stat = proc_stat(pid)
    return stat is not None and stat[0] != "Z"


def children(pid: int) -> list[int]:
    """The children of `pid` (from /proc/PID/task/TID/children)."""
    found: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return found
    for task in tasks:
        try:
            found += [int(child) for child in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


def tree(pid: int) -> list[int]:
    """Every descendant of `pid`."""
    return [found for child in children(pid) for found in (child, *tree(child))]


def running_in_groups(groups: set[int]) -> list[int]:
    """Pids of running processes whose process group is one of `groups`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = proc_stat(int(entry.name))
            if stat is not None and stat[0] != "Z" and stat[1] in groups:
                found.append(int(entry.name))
    return found


# ---------------------------------------------------------------- fast: plain commands
def launch(args: list[str], cwd: Path, **kwargs: Any) -> subprocess.Popen:
    """mfotel-instrument ARGS in a session of its own (no terminal: SIGINT is not ignored)."""
    kwargs.setdefault("stdout", subprocess.PIPE)
    kwargs.setdefault("stderr", subprocess.PIPE)
    return subprocess.Popen([*INSTRUMENT, *args], cwd=cwd, env=child_env(), text=True,
                            start_new_session=True, **kwargs)


@pytest.fixture
def launched() -> Iterator[list[subprocess.Popen]]:
    """Launchers a test started; whatever still runs of their jobs is killed at the end."""
    started: list[subprocess.Popen] = []
    yield started
    for process in started:
        leftovers = tree(process.pid)
        stop(process, timeout=5)
        for pid in leftovers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def python(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def wait_file(path: Path, timeout: float = 30) -> str:
    return wait_until(lambda: path.exists() and path.read_text(), timeout, f"{path.name} written")


@pytest.mark.parametrize("code", [0, 7])
def test_output_input_and_exit_status_pass_through(tmp_path, code):
    process = launch(python(f"""
        import sys
        print(input().upper())
        print("to stderr", file=sys.stderr)
        sys.exit({code})"""), tmp_path, stdin=subprocess.PIPE)
    out, err = process.communicate("hello\n", timeout=60)
    assert (process.returncode, out, err) == (code, "HELLO\n", "to stderr\n")


def test_a_command_killed_by_a_signal_ends_the_launcher_the_same_way(tmp_path):
    """`yes` into a closed pipe dies by SIGPIPE (the command gets the default action back,
    which Python itself ignores); the launcher then dies by SIGPIPE too."""
    process = launch(["yes"], tmp_path)
    assert process.stdout.readline() == "y\n"
    process.stdout.close()
    assert process.wait(timeout=30) == -signal.SIGPIPE
    assert process.stderr.read() == ""


def test_exec_replaces_the_launcher_by_the_command(tmp_path):
    process = launch(["--exec", *python("import os; print(os.getpid())")], tmp_path)
    out, _ = process.communicate(timeout=60)
    assert int(out) == process.pid


MSRUN_POLICY = '''
"""msrun's signal policy in a few lines: workers each in a session of its own; SIGINT
SIGKILLs them and exits 0; a worker that exits with an error gets the others SIGKILLed."""
import os, signal, subprocess, sys, time
out = sys.argv[1]
worker = """
import os, signal, sys, time
out, rank = sys.argv[1], int(sys.argv[2])
def cancelled(signum, frame):
    time.sleep(1 + 2 * rank)  # lingers for its final scrape; rank 1 longer
    open(os.path.join(out, f"rank{rank}"), "w").write(signal.Signals(signum).name)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
signal.signal(signal.SIGTERM, cancelled)
signal.signal(signal.SIGINT, cancelled)
open(os.path.join(out, f"pid{rank}"), "w").write(str(os.getpid()))
while True:
    time.sleep(1)
"""
workers = [subprocess.Popen([sys.executable, "-c", worker, out, str(r)], start_new_session=True)
           for r in (0, 1)]
def kill_workers():
    for w in workers:
        if w.poll() is None:
            os.killpg(w.pid, signal.SIGKILL)
def on_sigint(signum, frame):
    kill_workers()
    sys.exit(0)
signal.signal(signal.SIGINT, on_sigint)
while True:
    codes = [w.poll() for w in workers]
    if any(c not in (None, 0) for c in codes):
        kill_workers()
        sys.exit(1)
    if all(c == 0 for c in codes):
        sys.exit(0)
    time.sleep(0.2)
'''


def start_policy_job(tmp_path: Path, *options: str) -> tuple[subprocess.Popen, list[int]]:
    script = tmp_path / "msrun_policy.py"
    script.write_text(MSRUN_POLICY)
    process = launch([*options, sys.executable, str(script), str(tmp_path)], tmp_path)
    pids = [int(wait_file(tmp_path / f"pid{rank}")) for rank in (0, 1)]
    return process, pids


@pytest.mark.parametrize("received, delivered", [(signal.SIGTERM, "SIGTERM"),
                                                 (signal.SIGINT, "SIGINT"),
                                                 (signal.SIGHUP, "SIGTERM")],
                         ids=["SIGTERM", "SIGINT", "SIGHUP"])
def test_cancel_reaches_detached_workers_and_their_launcher_cannot_kill_them(
        tmp_path, launched, received, delivered):
    process, pids = start_policy_job(tmp_path)
    launched.append(process)
    process.send_signal(received)
    assert process.wait(timeout=60) == -received
    # both lingered to the end, rank 1 two seconds after rank 0 exited: not SIGKILLed
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == [delivered, delivered]
    assert not any(running(pid) for pid in pids)
    err = process.stderr.read()
    assert f"{signal.Signals(received).name}: passing it" in err and "holding 1" in err


def test_with_exec_the_policy_kills_or_orphans_the_workers(tmp_path, launched):
    """The problem, with msrun's policy: without forwarding, SIGINT kills the workers before
    they could report (no rank file), SIGTERM leaves them running."""
    interrupted, terminated = tmp_path / "int", tmp_path / "term"
    interrupted.mkdir()
    terminated.mkdir()
    process, pids = start_policy_job(interrupted, "--exec")
    launched.append(process)
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=60) == 0  # the policy exits 0 on Ctrl-C
    wait_until(lambda: not any(running(pid) for pid in pids), 30, "workers killed")
    assert not list(interrupted.glob("rank*"))

    process, pids = start_policy_job(terminated, "--exec")
    launched.append(process)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == -signal.SIGTERM
    assert all(running(pid) for pid in pids)  # orphans, still training
    for pid in pids:
        os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("handler_exit, launcher_status", [(99, 99), (0, -signal.SIGTERM)],
                         ids=["own-status-passes", "success-after-cancel-is-the-cancel"])
def test_status_after_a_cancel(tmp_path, launched, handler_exit, launcher_status):
    process = launch(python(f"""
        import signal, sys, time
        signal.signal(signal.SIGTERM, lambda *a: sys.exit({handler_exit}))
        print("ready", flush=True)
        time.sleep(300)"""), tmp_path)
    launched.append(process)
    assert process.stdout.readline() == "ready\n"
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == launcher_status


def test_ignored_signal_stays_ignored_and_others_pass_as_they_are(tmp_path, launched):
    """Started under nohup (SIGHUP ignored): the command inherits the ignore and a SIGHUP
    does nothing; SIGUSR1 reaches the command, whose exit status passes through."""
    process = launch(python("""
        import signal, sys, time
        signal.signal(signal.SIGUSR1, lambda *a: sys.exit(5))
        print(signal.getsignal(signal.SIGHUP) == signal.SIG_IGN, flush=True)
        time.sleep(300)"""), tmp_path,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    launched.append(process)
    assert process.stdout.readline() == "True\n"
    process.send_signal(signal.SIGHUP)
    process.send_signal(signal.SIGUSR1)
    assert process.wait(timeout=60) == 5


def test_what_ignores_the_cancel_is_killed_after_the_stop_timeout(tmp_path, launched):
    process = launch(["--stop-timeout", "1", *python("""
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ready", flush=True)
        time.sleep(300)""")], tmp_path)
    launched.append(process)
    assert process.stdout.readline() == "ready\n"
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == -signal.SIGKILL
    assert "still running 1 s after SIGTERM: SIGKILL" in process.stderr.read()


@pytest.mark.parametrize("args, message", [
    (["--frobnicate", "true"], "unknown option --frobnicate"),
    (["--stop-timeout", "soon", "true"], "--stop-timeout needs seconds"),
    (["--stop-timeout=0", "true"], "--stop-timeout needs seconds"),
])
def test_bad_options_are_clear_errors(tmp_path, args, message):
    process = launch(args, tmp_path)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 2 and message in err


# ---------------------------------------------------------------- fast: a real terminal
class Terminal:
    """mfotel-instrument COMMAND as the session leader of a new pseudo terminal, like a shell
    running it in the foreground."""

    def __init__(self, command: list[str], cwd: Path) -> None:
        env = child_env()
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: exec at once, nothing else
            os.chdir(cwd)
            os.execve(sys.executable, [*INSTRUMENT, *command], env)
        self.output = b""
        self.status: int | None = None

    def expect(self, text: bytes, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output:
            ready, _, _ = select.select([self.fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError(f"{text!r} not seen; the terminal shows {self.output!r}")
            try:
                self.output += os.read(self.fd, 4096)
            except OSError:  # the session ended
                raise AssertionError(f"{text!r} not seen; the terminal showed {self.output!r}")

    def type(self, keys: bytes) -> None:
        os.write(self.fd, keys)

    def wait(self, timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = status
                return status
            try:
                self.expect(b"\0never", timeout=0.1)
            except (TimeoutError, AssertionError):
                pass
        raise TimeoutError("mfotel-instrument did not exit")

    def close(self) -> None:
        if self.status is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        os.close(self.fd)


@pytest.fixture
def terminal(tmp_path) -> Iterator[Any]:
    opened: list[Terminal] = []

    def open_(command: list[str]) -> Terminal:
        opened.append(Terminal(command, tmp_path))
        return opened[-1]
    yield open_
    for term in opened:
        term.close()


def test_ctrl_c_at_a_terminal_reaches_the_command_once(terminal):
    term = terminal(python("""
        import signal, time
        got = []
        signal.signal(signal.SIGINT, lambda *a: got.append(1))
        print("ready", flush=True)
        while not got:
            time.sleep(0.05)
        time.sleep(1)  # a second SIGINT (the terminal's and a forwarded one) would land here
        print("SIGINT x", len(got), flush=True)"""))
    term.expect(b"ready")
    term.type(b"\x03")  # Ctrl-C
    term.expect(b"SIGINT x 1")
    status = term.wait()
    # the command exited 0 after the cancel: reported as killed by SIGINT, as the shell expects
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGINT


def test_a_command_reading_the_terminal_gets_it_and_ctrl_c_as_without_mfotel(terminal):
    term = terminal(python("""
        print("name?", flush=True)
        print(input().upper(), flush=True)
        input()"""))
    term.expect(b"name?")
    term.type(b"hello\r")
    term.expect(b"HELLO")
    term.type(b"\x03")  # the command holds the foreground now: KeyboardInterrupt, as usual
    status = term.wait()
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGINT
    assert b"KeyboardInterrupt" in term.output


# ---------------------------------------------------------------- slow: real msrun
class MsrunJob:
    """`mfotel-instrument [options] msrun` of 2 CPU ranks training train_dp.py slowly."""

    def __init__(self, work: Path, base_port: int, options: list[str]) -> None:
        self.work, self.base_port = work, base_port
        args = ["--steps", "100000", "--port", str(base_port), "--job-name", JOB,
                "--linger-seconds", str(LINGER), "--step-sleep", "0.05", "--log-rank", "0"]
        msrun = [str(VENV_BIN / "msrun"), "--worker_num=2", "--local_worker_num=2",
                 "--master_addr=127.0.0.1", f"--master_port={free_port_block(1)}", "--join=True",
                 f"--log_dir={work / 'logs'}", str(EXAMPLE), *args]
        self.log = work / "launcher.log"
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen([*INSTRUMENT, *options, *msrun], cwd=work,
                                            env=child_env(PWD=str(work)), stdout=out,
                                            stderr=subprocess.STDOUT, start_new_session=True)
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
        leftovers = list(job.processes())
        stop(job.process)
        for pid in leftovers:  # orphans of a test that pins msrun's own behaviour
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def prometheus(tmp_path) -> Iterator[tuple[Prometheus, int]]:
    """A real Prometheus scraping both ranks every second with the generated rules."""
    base = free_port_block(2)
    rules = write_rules(tmp_path / "rules", TEST_RULES)
    names = "\n".join(f"  - {path.name}" for path in rules)
    targets = json.dumps([f"127.0.0.1:{base}", f"127.0.0.1:{base + 1}"])
    config = (f"global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n  scrape_timeout: 1s\n"
              f"rule_files:\n{names}\nscrape_configs:\n  - job_name: mfotel\n"
              f"    static_configs:\n      - targets: {targets}\n")
    with Prometheus(config, rule_files=rules, workdir=tmp_path / "prom") as prom:
        yield prom, base


def statuses(prom: Prometheus) -> dict[str, float]:
    """The last status Prometheus scraped from each rank."""
    result = prom.query(f'last_over_time(mindformers_train_status{{job_name="{JOB}"}}[10m])')
    return {r["metric"]["rank"]: float(r["value"][1]) for r in result}


def both_running(prom: Prometheus, job: MsrunJob) -> None:
    wait_until(lambda: statuses(prom) == {"0": contract.STATUS_RUNNING,
                                          "1": contract.STATUS_RUNNING},
               600, "both ranks running in Prometheus", interval=1, alive=job.process)


def signal_every_process(job: MsrunJob, signum: int) -> None:
    """As Slurm cancels a step (proctrack/cgroup): every process of it, launcher included."""
    for pid in [job.process.pid, *job.processes()]:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


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
    assert job.wait(timeout=LINGER + 60) == -signum  # the conventional status
    assert time.monotonic() - signalled < LINGER + 30
    cancelled = {"0": contract.STATUS_CANCELLED, "1": contract.STATUS_CANCELLED}
    try:  # the final scrapes were answered before the ranks exited; stored a moment later
        wait_until(lambda: statuses(prom) == cancelled, 5, "final statuses", interval=0.1)
    except TimeoutError:
        pass
    assert statuses(prom) == cancelled
    assert alerts_until_quiet(prom, JOB, job.exited_at, "10m") == []
    # no worker, scheduler or log tail survives, by pid and by process group
    assert [pid for pid in processes if running(pid)] == []
    assert running_in_groups(set(processes.values())) == []
    assert "Traceback" not in (job.work / "logs" / "worker_0.log").read_text(errors="replace")


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
    (they never report cancelled), exits 0, and both ranks page MindFormersRankDown."""
    prom, base = prometheus
    job = msrun_job(base, "--exec")
    both_running(prom, job)
    workers = job.workers()
    job.process.send_signal(signal.SIGINT)
    assert job.wait(timeout=60) == 0
    wait_until(lambda: not any(running(pid) for pid in workers), 30, "the ranks killed")
    firing = f'ALERTS{{alertname="MindFormersRankDown", alertstate="firing", job_name="{JOB}"}}'
    alerts = wait_until(lambda: len(prom.query(firing)) == 2 and prom.query(firing), 60,
                        "MindFormersRankDown firing for both ranks")
    assert {a["metric"]["severity"] for a in alerts} == {"critical"}
    assert statuses(prom) == {"0": contract.STATUS_RUNNING, "1": contract.STATUS_RUNNING}
