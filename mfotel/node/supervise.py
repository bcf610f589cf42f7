"""Run a command as the parent of its whole job: pass signals to every process, end as it ended.

`exec` would leave signals to the command, and msrun (the usual one) mishandles a cancel: on
SIGTERM it exits and leaves its workers, each in a session of its own, running; on SIGINT
(Ctrl-C) it SIGKILLs them. Either way no rank reports "cancelled" and every rank pages as
dead. So `mfotel-instrument` stays the parent:

- The command runs in a process group of its own, and mfotel-instrument is the child
  subreaper (Linux): processes orphaned inside the job (msrun's workers once msrun exited)
  stay its own, to signal and to wait for.
- SIGTERM, SIGINT and SIGHUP cancel the job. Every process group of the job gets the signal
  (SIGHUP as SIGTERM: a training process reports a cancel for SIGTERM and SIGINT). A process
  that started processes into groups of their own (msrun) is held (SIGSTOP) until the
  processes outside its group ended, then resumed with the signal pending, so it cannot
  SIGKILL ranks that linger for their final scrape. Processes still running `stop_timeout`
  seconds after the signal are killed (SIGKILL).
- SIGQUIT, SIGUSR1, SIGUSR2, SIGWINCH and SIGCONT go to every process group of the job as they
  are; SIGTSTP (Ctrl-Z) stops the job, then mfotel-instrument.
- The command starts with the signal mask mfotel-instrument was started with, except that
  SIGTERM and SIGINT are unblocked: a cancel passed on must reach it.
- At a terminal the command starts in the background, so that Ctrl-C reaches mfotel-instrument,
  not msrun. When the command reads from the terminal (input(), pdb), it is given the
  foreground, as a shell would: Ctrl-C then reaches it directly, as without mfotel.
- mfotel-instrument ends as the command ended: its exit status, or killed by the same signal
  (without a core dump of its own). After a cancel, exit status 0 is reported as killed by the
  signal mfotel-instrument received: a cancelled job did not succeed (msrun exits 0 after
  Ctrl-C); an exit status of the command's own choosing passes through.

Signals are taken synchronously (blocked, then `sigwaitinfo`), as tini does: no handler runs
in the middle of the loop, and as PID 1 of a container no signal is lost.

An observer (the node agent, `service.NodeService`) hears what the supervisor sees: the
start (threads it starts then inherit the blocked signals), every process reaped, the cancel;
when the job ended it may ask for a linger, which any cancel signal cuts short.

    supervise.run(["msrun", ...], env, stop_timeout=60.0)   # never returns
"""
from __future__ import annotations

import ctypes
import os
import resource
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn, Protocol

from .procfs import ProcStat, descendants, read_stat

#: Signals that cancel the job, and the signal each reaches the job as.
CANCELS: dict[int, int] = {signal.SIGTERM: signal.SIGTERM, signal.SIGINT: signal.SIGINT,
                           signal.SIGHUP: signal.SIGTERM}
#: Signals passed to every process group of the job as they are.
PASSED = (signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGWINCH, signal.SIGCONT)
DEFAULT_STOP_TIMEOUT = 60.0
MAX_STOP_TIMEOUT = 86400.0
#: After SIGKILL, how long to wait for the job before exiting anyway (a process stuck in the
#: kernel, state D, ends when it returns).
KILL_GRACE_SECONDS = 5.0
_POLL_SECONDS = 0.1
_HOLD_SECONDS = 1.0
_PR_SET_CHILD_SUBREAPER = 36


def launchers(job: Sequence[ProcStat]) -> set[int]:
    """Live processes of `job` with a descendant in another process group: they started
    processes of their own into groups of their own (msrun: a session per worker) and manage
    them (msrun SIGKILLs them on SIGINT, or when one of them exits with an error)."""
    by_pid = {proc.pid: proc for proc in job}
    found: set[int] = set()
    for proc in job:
        parent = by_pid.get(proc.ppid)
        while parent is not None:
            if parent.pgid != proc.pgid and not parent.ended:
                found.add(parent.pid)
            parent = by_pid.get(parent.ppid)
    return found


def _signal(pid: int, signum: int, group: bool = False) -> bool:
    """Send, ignoring a process that is gone or not ours to signal."""
    try:
        (os.killpg if group else os.kill)(pid, signum)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _state(pid: int) -> str:
    stat = read_stat(pid)
    return "X" if stat is None else stat.state


def become_subreaper() -> bool:
    """Adopt the orphans of the job instead of init (Linux >= 3.4); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def note(text: str) -> None:
    """One `mfotel-instrument: ...` line on stderr (a closed stderr is no error)."""
    try:
        sys.stderr.write(f"mfotel-instrument: {text}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass  # stderr closed: the job matters more than the note


def _listed(procs: Sequence[ProcStat], most: int = 8) -> str:
    """'pid 12 (python), pid 13 (tail)': which processes did not stop, the first `most`."""
    named = ", ".join(f"pid {proc.pid} ({proc.name or '?'})" for proc in procs[:most])
    return named + (f" and {len(procs) - most} more" if len(procs) > most else "")


def _name(signum: int) -> str:
    return signal.Signals(signum).name


class Observer(Protocol):
    """What the supervisor tells (see the module docstring)."""

    def started(self, supervisor_pid: int) -> None: ...
    def reaped(self, pid: int, status: int) -> None: ...
    def cancelling(self) -> None: ...
    def ended(self) -> float: ...  # seconds to linger before exiting
    def close(self) -> None: ...


@dataclass
class Cancel:
    """A cancel in progress."""

    received: int  # what mfotel-instrument got
    delivered: int  # what the job gets
    deadline: float  # monotonic: SIGKILL for whatever still runs
    held: set[int]  # launchers stopped until the processes in other groups ended
    held_groups: set[int] = field(default_factory=set)
    groups: set[int] = field(default_factory=set)  # process groups signalled
    released: bool = False
    killed_at: float | None = None


class Supervisor:
    """One command, its job, and the signals that reach mfotel-instrument."""

    def __init__(self, argv: Sequence[str], env: dict[str, str],
                 stop_timeout: float = DEFAULT_STOP_TIMEOUT,
                 observer: Observer | None = None) -> None:
        self.argv, self.env, self.stop_timeout = list(argv), env, stop_timeout
        self.observer = observer
        self.me, self.my_group = os.getpid(), os.getpgrp()
        # A signal ignored at start (nohup, `&` in a script) stays ignored, here and in the job.
        self.waited = {signum for signum in (*CANCELS, *PASSED, signal.SIGTSTP)
                       if signal.getsignal(signum) != signal.SIG_IGN} | {signal.SIGCHLD}
        self.tty = next((fd for fd in (0, 1, 2) if _isatty(fd)), None)
        self.child = 0
        self.status: int | None = None  # the command's wait status, once reaped
        self.cancel: Cancel | None = None
        self.handed_over = False  # the command was given the terminal's foreground
        self.job_stopped = False  # stopped for job control (Ctrl-Z) until SIGCONT

    # ------------------------------------------------------------------ the loop
    def run(self) -> NoReturn:
        """Start the command, supervise it until the job ended, end the same way."""
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, self.waited)
        become_subreaper()
        try:
            # As subprocess does: Python ignores SIGPIPE / SIGXFSZ; the command must not inherit it.
            self.child = os.posix_spawnp(self.argv[0], self.argv, self.env, setpgroup=0,
                                         setsigmask=command_mask(mask),
                                         setsigdef=(signal.SIGPIPE, signal.SIGXFSZ))
        except BaseException:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            raise
        self.observe("started", self.me)
        while not self.finished():
            info: signal.struct_siginfo | None
            if self.cancel is None:
                info = signal.sigwaitinfo(self.waited)
            else:
                info = signal.sigtimedwait(self.waited, _POLL_SECONDS)
            if info is not None:
                self.on_signal(info.si_signo)
            self.reap()
            if self.cancel is not None:
                self.advance(self.cancel)
        self.take_back_terminal()
        self.linger()
        assert self.status is not None
        end_like(self.status, self.cancel.received if self.cancel else None)

    def observe(self, event: str, *args: int) -> Any:
        """Tell the observer; one that fails is dropped (noted once): the job comes first."""
        if self.observer is None:
            return None
        try:
            return getattr(self.observer, event)(*args)
        except Exception as exc:  # noqa: BLE001 - supervision must go on whatever it does
            note(f"the node agent failed ({type(exc).__name__}: {exc}) and is stopped; the "
                 "job runs on without it")
            observer, self.observer = self.observer, None
            try:
                observer.close()
            except Exception:  # noqa: BLE001 - already failed and noted; the job comes first
                pass
            return None

    def linger(self) -> None:
        """Stay as long as the observer asks after the job ended; a cancel signal ends it."""
        if self.observer is None:
            return
        try:
            seconds = self.observe("ended") or 0.0
            if seconds > 0:
                note(f"the job ended; the node endpoint stays up {seconds:g} s for the final "
                     "scrapes (SIGTERM / SIGINT ends it now)")
            deadline = time.monotonic() + seconds
            while (left := deadline - time.monotonic()) > 0:
                info = signal.sigtimedwait(self.waited, left)
                if info is not None and info.si_signo in CANCELS:
                    break
                self.reap()  # stragglers the job left behind
        finally:
            self.observe("close")

    def finished(self) -> bool:
        if self.status is None:
            return False
        if self.cancel is None:
            return True  # as before: the command ended, whatever it left running
        if self.cancel.killed_at is not None and \
                time.monotonic() > self.cancel.killed_at + KILL_GRACE_SECONDS:
            return True
        return not any(not proc.ended for proc in descendants(self.me))

    def reap(self) -> None:
        """Wait for every child that changed state: the command, and adopted orphans."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG | os.WUNTRACED)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if os.WIFSTOPPED(status):
                self.on_stopped(pid, os.WSTOPSIG(status))
                continue
            if pid == self.child:
                self.status = status
            self.observe("reaped", pid, status)

    # ------------------------------------------------------------------ signals
    def on_signal(self, signum: int) -> None:
        if signum == signal.SIGCHLD:
            return  # reap() follows
        if signum in CANCELS:
            self.start_cancel(signum)
        elif self.cancel is not None:
            if signum not in (signal.SIGTSTP, signal.SIGCONT):  # never resume a held launcher
                self.send_job(signum)
        elif signum == signal.SIGTSTP:
            self.send_job(signal.SIGTSTP)
            self.stop_as_a_job()
        else:
            if signum == signal.SIGCONT:
                self.job_stopped = False
            self.send_job(signum)

    def send_job(self, signum: int, job: Sequence[ProcStat] | None = None) -> set[int]:
        """`signum` to every process group of the job; the groups reached."""
        job = [p for p in (descendants(self.me) if job is None else job) if not p.ended]
        groups = {proc.pgid for proc in job}
        for proc in job:
            if proc.pgid == self.my_group:  # never our own group (our caller's job)
                _signal(proc.pid, signum)
        groups.discard(self.my_group)
        if not job and self.status is None:
            groups.add(self.child)  # no /proc: the command's group at least
        return {group for group in groups if _signal(group, signum, group=True)}

    def start_cancel(self, received: int) -> None:
        delivered = CANCELS[received]
        if self.cancel is not None:  # asked again: pass it on again
            self.send_job(delivered)
            return
        self.observe("cancelling")
        job = [proc for proc in descendants(self.me) if not proc.ended]
        held = launchers(job)
        for pid in held:
            _signal(pid, signal.SIGSTOP)
        deadline = time.monotonic() + _HOLD_SECONDS
        while any(_state(pid) not in ("T", "t", "Z", "X") for pid in held) and \
                time.monotonic() < deadline:
            time.sleep(0.01)
        self.cancel = Cancel(received, delivered, time.monotonic() + self.stop_timeout, held,
                             {proc.pgid for proc in job if proc.pid in held})
        passed = "" if delivered == received else f" as {_name(delivered)}"
        holding = f"; holding {len(held)} that started processes of their own until those " \
                  "ended" if held else ""
        note(f"{_name(received)}: passing it{passed} to the {len(job)} processes of the job"
             f"{holding}; SIGKILL for any still running in {self.stop_timeout:g} s")
        # held launchers get it too: pending until they are resumed (a fatal one ends them now)
        self.cancel.groups = self.send_job(delivered, job)

    def advance(self, cancel: Cancel) -> None:
        """One step of a cancel: late process groups, release of the held, the deadline."""
        live = [proc for proc in descendants(self.me) if not proc.ended]
        late = {proc.pgid for proc in live} - cancel.groups - {self.my_group}
        if late and cancel.killed_at is None:  # started after the signal (a worker at start-up)
            cancel.groups |= self.send_job(cancel.delivered,
                                           [proc for proc in live if proc.pgid in late])
        if not cancel.released and all(proc.pgid in cancel.held_groups for proc in live):
            cancel.released = True  # what they could harm has ended; the rest is theirs
            for pid in cancel.held:
                _signal(pid, signal.SIGCONT)
        if cancel.killed_at is None and live and time.monotonic() >= cancel.deadline:
            cancel.killed_at = time.monotonic()
            note(f"{len(live)} processes of the job still running {self.stop_timeout:g} s "
                 f"after {_name(cancel.received)}: SIGKILL ({_listed(live)}; a rank killed "
                 "so pages as down; keep --stop-timeout above the monitor's "
                 "prometheus.linger_seconds)")
            for proc in live:
                _signal(proc.pid, signal.SIGKILL)

    # ------------------------------------------------------------------ terminal
    def on_stopped(self, pid: int, signum: int) -> None:
        """A child stopped: ours to hold, or job control of the terminal."""
        if self.cancel is not None or self.job_stopped or pid != self.child:
            return
        if signum in (signal.SIGTTIN, signal.SIGTTOU) and self.owns_terminal():
            assert self.tty is not None
            os.tcsetpgrp(self.tty, self.child)  # the command's group: pgid == its pid
            self.handed_over = True
            _signal(self.child, signal.SIGCONT, group=True)
        elif signum in (signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU):
            self.stop_as_a_job()

    def stop_as_a_job(self) -> None:
        """Stop as the job did (Ctrl-Z), so that the shell sees it stopped; its SIGCONT
        (fg, bg) reaches on_signal and resumes the job."""
        self.job_stopped = True
        os.kill(self.me, signal.SIGSTOP)

    def owns_terminal(self) -> bool:
        try:
            return self.tty is not None and os.tcgetpgrp(self.tty) == self.my_group
        except OSError:
            return False

    def take_back_terminal(self) -> None:
        """Give the foreground back to our group if the command still holds it."""
        if not self.handed_over or self.tty is None:
            return
        try:
            if os.tcgetpgrp(self.tty) == self.child:
                # a background group may take the terminal only with SIGTTOU blocked
                old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTTOU})
                try:
                    os.tcsetpgrp(self.tty, self.my_group)
                finally:
                    signal.pthread_sigmask(signal.SIG_SETMASK, old)
        except OSError:
            pass


def command_mask(started_with: set[int | signal.Signals]) -> set[int | signal.Signals]:
    """The command's signal mask: the one mfotel-instrument was started with (as tini passes
    it), less the signals a cancel reaches the job as. Those are passed on and must be
    receivable: blocked (a launcher started from a thread that blocks them), the cancel would
    wait in every rank's mask until the stop timeout's SIGKILL, and every rank would page."""
    return set(started_with) - set(CANCELS.values())


def _isatty(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False


def end_like(status: int, cancelled_by: int | None = None) -> NoReturn:
    """Exit as a process whose wait status is `status`. After a cancel by `cancelled_by`,
    success or death by the signal the job got are reported as killed by `cancelled_by`."""
    if cancelled_by is not None and (status == 0 or (
            os.WIFSIGNALED(status) and os.WTERMSIG(status) == CANCELS[cancelled_by])):
        die_by(cancelled_by)
    if os.WIFSIGNALED(status):
        die_by(os.WTERMSIG(status))
    _flush()
    os._exit(os.waitstatus_to_exitcode(status))


def die_by(signum: int) -> NoReturn:
    """Be killed by `signum` (without a core file of our own); 128 + signum where the signal
    cannot kill us (PID 1 of a container ignores default actions)."""
    _flush()
    try:
        _, hard = resource.getrlimit(resource.RLIMIT_CORE)
        resource.setrlimit(resource.RLIMIT_CORE, (0, hard))
    except (ValueError, OSError):
        pass
    if signum not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
    os.kill(os.getpid(), signum)
    os._exit(128 + signum)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def run(argv: Sequence[str], env: dict[str, str], stop_timeout: float = DEFAULT_STOP_TIMEOUT,
        observer: Observer | None = None) -> NoReturn:
    """Run `argv` under supervision (see the module docstring); never returns."""
    Supervisor(argv, env, stop_timeout, observer).run()
