"""`mfotel-instrument` with plain commands: output, input and exit status pass through, a cancel
reaches every process of the job (detached workers included) and a terminal's Ctrl-C reaches the
command once, as without mfotel.

The commands are small Python scripts; `msrun_policy.py` copies msrun's signal policy in a few
lines so that the hold is tested in seconds. Real msrun jobs: tests/e2e/test_launcher_msrun.py.
"""
from __future__ import annotations

import os
import platform
import pty
import select
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import INSTRUMENT
from tests.support.multirank import child_env, stop
from tests.support.processes import TAG, kill_tagged, running, signal_states, tree
from tests.support.waiting import settle, wait_for


# ---------------------------------------------------------------- fast: plain commands
def launch(args: list[str], cwd: Path, **kwargs: Any) -> subprocess.Popen:
    """mfotel-instrument ARGS in a session of its own (no terminal: SIGINT is not ignored)."""
    kwargs.setdefault("stdout", subprocess.PIPE)
    kwargs.setdefault("stderr", subprocess.PIPE)
    # tagged with the test's folder: the `launched` fixture finds orphans by it
    return subprocess.Popen([*INSTRUMENT, *args], cwd=cwd, env=child_env(**{TAG: str(cwd)}),
                            text=True, start_new_session=True, **kwargs)


@pytest.fixture
def launched(tmp_path) -> Iterator[list[subprocess.Popen]]:
    """Launchers a test started; whatever still runs of their jobs is killed at the end, found
    by the test's tag (orphans of a launcher that exited are no longer below it)."""
    started: list[subprocess.Popen] = []
    yield started
    for process in started:
        stop(process, timeout=5)
    kill_tagged(str(tmp_path))


def exit_status(process: subprocess.Popen, timeout: float = 60) -> int:
    """The launcher's exit status; if it is still running after `timeout` s, fail with what
    it noted so far and where each process of the job waits (signal masks, syscalls)."""
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        states = signal_states([process.pid, *tree(process.pid)])
        notes = ""
        if process.stderr is not None:  # what is in the pipe, without waiting for its end
            os.set_blocking(process.stderr.fileno(), False)
            try:
                notes = os.read(process.stderr.fileno(), 65536).decode(errors="replace")
            except BlockingIOError:
                pass
        raise AssertionError(f"mfotel-instrument still running {timeout:g} s later; its notes:"
                             f"\n{notes}\nthe job:\n{states}") from None


def python(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def wait_file(path: Path, timeout: float = 30) -> str:
    return wait_for(lambda: path.exists() and path.read_text(), timeout,
                    message=f"{path.name} written")


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
    assert exit_status(process) == -received
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
    assert exit_status(process) == 0  # the policy exits 0 on Ctrl-C
    wait_for(lambda: not any(running(pid) for pid in pids), settle(), message="workers killed")
    assert not list(interrupted.glob("rank*"))

    process, pids = start_policy_job(terminated, "--exec")
    launched.append(process)
    process.send_signal(signal.SIGTERM)
    assert exit_status(process) == -signal.SIGTERM
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
    assert exit_status(process) == launcher_status


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
    assert exit_status(process) == 5


def test_a_launcher_that_does_not_end_is_reported_with_its_notes_and_signal_states(
        tmp_path, launched):
    """Started with SIGTERM ignored, the launcher keeps ignoring it (as nohup asks): the
    failure exit_status gives then says so, with the launcher's notes and each process's
    signal masks, threads and syscalls; SIGUSR1 still reaches the command."""
    process = launch(python("""
        import signal, sys, time
        signal.signal(signal.SIGUSR1, lambda *a: sys.exit(5))
        print("ready", flush=True)
        time.sleep(300)"""), tmp_path,
        preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_IGN))
    launched.append(process)
    assert process.stdout.readline() == "ready\n"
    process.send_signal(signal.SIGTERM)
    with pytest.raises(AssertionError) as failure:
        exit_status(process, timeout=2)
    report = str(failure.value)
    assert "still running 2 s later" in report
    launcher = next(line for line in report.splitlines() if line.startswith(f"pid {process.pid} "))
    ignored = int(launcher.split("SigIgn: ")[1].split(",")[0], 16)
    assert ignored & 1 << (signal.SIGTERM - 1), launcher
    assert "  thread " in report and "syscall" in report
    process.send_signal(signal.SIGUSR1)
    assert exit_status(process) == 5


def test_a_cancel_reaches_the_command_when_the_launcher_started_with_it_blocked(
        tmp_path, launched):
    """Started with SIGINT, SIGTERM and SIGALRM blocked (from a thread that blocks them): the
    command gets the cancel signals unblocked, so the SIGTERM passed on ends it at once (with
    them blocked it waited for the stop timeout's SIGKILL); SIGALRM stays blocked, as tini
    passes the mask."""
    blocked = {signal.SIGINT, signal.SIGTERM, signal.SIGALRM}
    process = launch(["--stop-timeout", "30", *python("""
        import signal, time
        print(sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])), flush=True)
        time.sleep(300)""")], tmp_path,
        preexec_fn=lambda: signal.pthread_sigmask(signal.SIG_BLOCK, blocked))
    launched.append(process)
    assert process.stdout.readline() == f"[{int(signal.SIGALRM)}]\n"
    process.send_signal(signal.SIGTERM)
    assert exit_status(process) == -signal.SIGTERM  # not the stop timeout's SIGKILL


def test_what_ignores_the_cancel_is_killed_after_the_stop_timeout(tmp_path, launched):
    process = launch(["--stop-timeout", "1", *python("""
        import os, signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ready", os.getpid(), flush=True)
        time.sleep(300)""")], tmp_path)
    launched.append(process)
    ready, command_pid = process.stdout.readline().split()
    assert ready == "ready"
    process.send_signal(signal.SIGTERM)
    assert exit_status(process) == -signal.SIGKILL
    told = process.stderr.read()
    # which process did not stop: the command itself (python), by pid and name
    assert f"1 processes of the job still running 1 s after SIGTERM: SIGKILL (pid " \
           f"{command_pid} (python" in told, told


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
#: The read(2) system call's number, as /proc/PID/syscall shows it.
READ_SYSCALL = {"x86_64": "0", "aarch64": "63"}


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
                raise AssertionError(f"{text!r} not seen; the terminal showed "
                                     f"{self.output!r}") from None

    def type(self, keys: bytes) -> None:
        os.write(self.fd, keys)

    def wait_reading(self, timeout: float = 60) -> None:
        """Until the command (the launcher's child) is blocked reading the terminal (fd 0).
        A Ctrl-C typed a moment earlier, between its last output and its read(), runs Python's
        handler with no read() to interrupt: input() then waits on, with or without mfotel."""
        read = READ_SYSCALL[platform.machine()]

        def reading() -> bool:
            for pid in tree(self.pid):
                try:
                    call = Path(f"/proc/{pid}/syscall").read_text().split()
                except OSError:
                    continue
                if call[:2] == [read, "0x0"]:
                    return True
            return False
        wait_for(reading, timeout, 0.02, "the command blocked reading the terminal",
                 details=self.shows)

    def wait(self, timeout: float = 60) -> int:
        def exited() -> bool:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = status
                return True
            try:  # meanwhile, keep reading what the terminal shows
                self.expect(b"\0never", timeout=0.1)
            except (TimeoutError, AssertionError):
                pass
            return False
        wait_for(exited, timeout, 0, "mfotel-instrument to exit",
                 details=self.shows)
        assert self.status is not None
        return self.status

    def shows(self) -> str:
        """What the terminal shows and the job's state (a failed wait's details)."""
        return f"the terminal shows {self.output!r}\n{self.job_state()}"

    def job_state(self) -> str:
        """Who holds the terminal, and each process's state, group and signal masks (what a
        Ctrl-C that changed nothing needs explained)."""
        try:
            foreground: int | str = os.tcgetpgrp(self.fd)
        except OSError as exc:
            foreground = str(exc)
        return f"terminal foreground group: {foreground}\n" + \
            signal_states([self.pid, *tree(self.pid)])

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
    term.wait_reading()
    term.type(b"\x03")  # the command holds the foreground now: KeyboardInterrupt, as usual
    status = term.wait()
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGINT
    assert b"KeyboardInterrupt" in term.output
