"""SIGTERM and SIGINT: report the run cancelled, keep /metrics up for the final scrape, then
exit the way the signal's default would.

SIGTERM's default action ends Python at once (no `finally`, no atexit): a cancelled or
pre-empted job (scancel, pod deletion, a launcher stopping its workers) vanished while its last
scraped status said "running", and paged as a dead rank. While a monitor runs, this module
handles both signals:

- The run is marked cancelled (status 4), then the handler that was installed before is
  chained: Python's KeyboardInterrupt for SIGINT (the monitor finishes the run as the exception
  unwinds `Model.train`), a Python handler (e.g. MindSpore's OnRequestExit, which stops
  gracefully: the monitor finishes at the end of training), or the default action: the
  monitors finish (linger until the final status is scraped, flush the sinks, stop the
  endpoint, push OTLP), then the signal is re-delivered with its default action, so launchers
  see "killed by SIGTERM" as before.
- A signal that is ignored (SIG_IGN) or caught outside Python is left alone. The previous
  handlers are restored when the last monitor closes, unless someone replaced ours since.
- Python runs handlers on the main thread between bytecodes, not while a step, a collective
  or graph compilation runs in C++. A wakeup fd lets a watcher thread see the signal at once
  (when the C++ code released the GIL, as MindSpore steps do): it marks the run cancelled, so
  the next scrape shows it even if the step never returns (a peer already gone), and for a
  default-action SIGTERM it finishes the monitors itself; if the main thread is still away
  MAIN_GRACE_SECONDS later, the process exits with status 128 + signum.
- MindSpore's dataset answers the death of a worker process by sending SIGTERM to its own
  process: when a child died of a failure (killed by the OOM killer, crashed, exited with an
  error), the run is reported failed, not cancelled.
- A forked child (a dataset worker) forgets all this: it is not the training run.

    lifecycle.enter(run_end)   # at train begin, on the main thread (mfotel.run_end.RunEnd)
    lifecycle.leave(run_end)   # last step of the monitor's close(); re-delivers a deferred signal
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

Handler = Callable[[int, Any], Any] | int | None
log = logging.getLogger("mfotel")

TERMINATING = (signal.SIGTERM, signal.SIGINT)
#: How long the watcher waits, after finishing, for the main thread to exit by the signal.
MAIN_GRACE_SECONDS = 1.0
#: Added to the members' own bound when the main thread waits for them to finish.
FINISH_MARGIN_SECONDS = 5.0
_POLL_SECONDS = 0.05


class Finishable(Protocol):
    """What the guard needs from a monitor's run (mfotel.run_end.RunEnd: its close() is the
    monitor's)."""

    @property
    def closed(self) -> bool:
        """Whether close() has nothing left to do."""

    @property
    def closing_thread(self) -> int | None:
        """Ident of the thread running close(), once it began."""

    def on_signal(self, signum: int, failure: str | None) -> None:
        """Mark the run cancelled, or failed when `failure` (a dead child) explains the signal;
        called in a signal handler or the watcher: assignments only."""

    def close(self) -> None:
        """Final status, linger, flush, stop the endpoint; idempotent."""

    def close_seconds(self) -> float:
        """The longest close() may take."""


def caught_outside_python(signum: int) -> bool:
    """Whether `signum` has a handler Python does not know of (installed by native code after
    start-up; Linux /proc): signal.signal would replace it for good."""
    if signal.getsignal(signum) != signal.SIG_DFL:
        return False
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return False
    for line in status.splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def failed_child() -> str | None:
    """A child process that died of a failure and is not reaped yet, described; else None.

    Killed by SIGTERM / SIGINT is no failure: it fits a cancel that reached the whole process
    group. Peeks only (WNOWAIT): whoever owns the child still reaps it.
    """
    for pid in _children():
        try:
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except OSError:
            continue
        if info is None:
            continue
        if info.si_code == os.CLD_EXITED and info.si_status != 0:
            return f"child process {pid} exited with status {info.si_status}"
        if info.si_code == os.CLD_DUMPED or \
                (info.si_code == os.CLD_KILLED and info.si_status not in TERMINATING):
            return f"child process {pid} was killed by {signal.strsignal(info.si_status)}"
    return None


def _children() -> list[int]:
    """This process's child pids (Linux /proc; none where it cannot tell)."""
    pids: list[int] = []
    try:
        for task in Path("/proc/self/task").iterdir():
            pids += [int(pid) for pid in (task / "children").read_text().split()]
    except OSError:
        pass
    return pids


def note(text: str) -> None:
    """One line on stderr, written straight to fd 2: the signal path's threads must not wait
    for a lock (logging's, sys.stderr's) that the interrupted main thread may hold."""
    try:
        os.write(2, f"{text}\n".encode(errors="replace"))
    except OSError:
        pass


def _flush_stdio() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - closed, or reentrant inside an interrupted write
            pass


class SignalGuard:
    """Process-wide: one handler per signal, however many monitors run."""

    def __init__(self, signals: tuple[int, ...] = TERMINATING) -> None:
        self.signals = signals
        self.members: list[Finishable] = []
        self.previous: dict[int, Handler] = {}
        self._handler = self._handle  # one object, so that getsignal() can recognise it
        self._fork_hook = False
        # the forking thread's mask while it forks, per thread: two threads may fork at once
        self._forking = threading.local()
        self._reset()

    def _reset(self) -> None:
        self._finishing = threading.Lock()  # taken (never blocking) by whoever finishes
        self._main_waiting = False
        self._pending: int | None = None
        self._wakeup: tuple[int, int] | None = None  # (read fd, write fd)

    # ------------------------------------------------------------------ membership
    def enter(self, member: Finishable) -> bool:
        """Handle the signals while `member` runs; False when no signal could be handled
        (not the main thread, or every signal ignored / owned by native code)."""
        if threading.current_thread() is not threading.main_thread():
            return False  # signal.signal() works only there
        if not self.members:
            self._install()
        if member not in self.members:
            self.members.append(member)
        return bool(self.previous)

    def leave(self, member: Finishable) -> None:
        """`member` has finished; the last one out restores the handlers and, on the main
        thread, re-delivers a signal that arrived while it was finishing."""
        if member in self.members:
            self.members.remove(member)
        if self.members or threading.current_thread() is not threading.main_thread():
            return
        pending = self._pending
        self._uninstall()
        if pending is not None:
            self._die(pending)

    # ------------------------------------------------------------------ install
    def _install(self) -> None:
        for signum in self.signals:
            current = signal.getsignal(signum)
            if current == signal.SIG_IGN:
                continue  # ignored on purpose (nohup, a launcher): it stays ignored
            if current is None or caught_outside_python(signum):
                log.warning("mfotel: %s is handled outside Python; mfotel leaves it alone, so a "
                            "run ended by it will not report status cancelled",
                            signal.Signals(signum).name)
                continue
            self.previous[signum] = current
            signal.signal(signum, self._handler)
        if self.previous:
            self._start_watcher()
        if not self._fork_hook:  # hooks cannot be removed: register once, act when installed
            os.register_at_fork(before=self._block_for_fork,
                                after_in_parent=self._unblock_after_fork,
                                after_in_child=self._forget_in_child)
            self._fork_hook = True

    def _start_watcher(self) -> None:
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        try:
            theirs = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        except (ValueError, OSError):
            theirs = None
        if theirs != -1:  # in use (an asyncio loop): keep theirs, go without a watcher
            if theirs is not None:
                signal.set_wakeup_fd(theirs)
            os.close(read_fd)
            os.close(write_fd)
            return
        self._wakeup = (read_fd, write_fd)
        threading.Thread(target=self._watch, args=(read_fd,), name="mfotel-signals",
                         daemon=True).start()

    def _uninstall(self, reset: bool = True) -> None:
        for signum, previous in self.previous.items():
            if signal.getsignal(signum) is self._handler:
                signal.signal(signum, previous)
        self.previous = {}
        if self._wakeup is not None:
            self._uninstall_wakeup()  # the watcher reads EOF and closes its end
            self._wakeup = None
        if reset:
            self._reset()

    def _uninstall_wakeup(self) -> None:
        assert self._wakeup is not None
        current = signal.set_wakeup_fd(-1)
        if current != self._wakeup[1]:
            signal.set_wakeup_fd(current)  # someone set theirs after us
        os.close(self._wakeup[1])

    def _block_for_fork(self) -> None:
        """Before os.fork(): block our signals in the forking thread. A child inherits the
        mask, so a signal sent to it before _forget_in_child ran waits there instead of being
        written into the parent's wakeup pipe (the parent's watcher took a dataset worker's
        SIGTERM for its own). The parent's other threads still receive the parent's signals."""
        self._forking.mask = None
        if self.previous:
            self._forking.mask = signal.pthread_sigmask(signal.SIG_BLOCK, self.signals)

    def _unblock_after_fork(self) -> None:
        mask, self._forking.mask = getattr(self._forking, "mask", None), None
        if mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)

    def _forget_in_child(self) -> None:
        """A forked child (a dataset worker) is not the training run: it must not report,
        linger or exit for it, nor write into the parent's wakeup pipe. A signal that arrived
        since the fork is delivered once its handler is the one it had before (the default:
        the child ends). The mask is restored whatever fails here: a child left with the
        signals blocked would pass them blocked to every program it executes (a command that
        never sees Ctrl-C)."""
        try:
            if self._wakeup is not None:  # the pipe is the parent's watcher's
                self._uninstall_wakeup()
                os.close(self._wakeup[0])
                self._wakeup = None
            self._uninstall()
            self.members = []
        finally:
            self._unblock_after_fork()

    # ------------------------------------------------------------------ signals
    def _tell(self, members: list[Finishable], signum: int) -> None:
        failure = failed_child() if signum == signal.SIGTERM else None
        for member in members:
            member.on_signal(signum, failure)

    def _handle(self, signum: int, frame: Any) -> None:
        """The Python-level handler (main thread)."""
        members = list(self.members)
        self._tell(members, signum)
        previous = self.previous.get(signum, signal.SIG_DFL)
        if previous is signal.default_int_handler:
            raise KeyboardInterrupt
        if callable(previous):
            previous(signum, frame)  # it decides what follows (e.g. a graceful stop)
            return
        me = threading.get_ident()
        if any(member.closing_thread == me for member in members):
            self._pending = signum  # we interrupted a close (the final linger): it re-delivers
            return
        self._main_waiting = True
        if self._finishing.acquire(blocking=False):  # off this frame: it may hold any lock
            threading.Thread(target=self._finish, args=(members,), name="mfotel-finish",
                             daemon=True).start()
        self._wait_closed(members)
        self._die(signum)

    @staticmethod
    def _wait_closed(members: list[Finishable]) -> None:
        """Until every member closed, at most their own bound plus a margin (a close stuck on
        a lock the interrupted main thread holds must not keep the process alive)."""
        bound = max((m.close_seconds() for m in members), default=0.0) + FINISH_MARGIN_SECONDS
        deadline = time.monotonic() + bound
        while not all(m.closed for m in members) and time.monotonic() < deadline:
            time.sleep(_POLL_SECONDS)

    def _watch(self, read_fd: int) -> None:
        """The watcher thread: sees each signal as it arrives, whatever the main thread does."""
        try:
            while True:
                try:
                    data = os.read(read_fd, 64)
                except InterruptedError:
                    continue
                if not data:
                    return  # uninstalled
                for signum in data:
                    if signum in self.previous:
                        self._seen(signum)
        finally:
            os.close(read_fd)

    def _seen(self, signum: int) -> None:
        members = list(self.members)
        self._tell(members, signum)
        if signal.getsignal(signum) is not self._handler or \
                self.previous.get(signum) != signal.SIG_DFL:
            return  # KeyboardInterrupt or a chained / replacing handler decides what follows
        if any(member.closing_thread is not None for member in members):
            return  # already finishing; the main thread's handler re-delivers
        if not self._finishing.acquire(blocking=False):
            return
        self._finish(members)  # returns at once for a member the main thread is closing
        self._wait_closed(members)
        deadline = time.monotonic() + MAIN_GRACE_SECONDS
        while not (self._main_waiting or self._pending is not None):
            if time.monotonic() >= deadline:  # stuck in C++ (a collective whose peers are gone)
                _flush_stdio()
                os._exit(128 + signum)
            time.sleep(_POLL_SECONDS)

    @staticmethod
    def _finish(members: list[Finishable]) -> None:
        for member in members:
            try:
                member.close()
            except Exception:  # noqa: BLE001 - close() counts its own failures; keep going
                pass

    def _die(self, signum: int) -> None:
        """Main thread: restore everything, then let the signal's default action happen."""
        self._uninstall(reset=False)  # the watcher may still be reading _main_waiting
        _flush_stdio()
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)
        os._exit(128 + signum)  # reached only if the signal is blocked in this thread


_GUARD = SignalGuard()


def enter(member: Finishable) -> bool:
    """Handle SIGTERM / SIGINT while `member` runs (see the module docstring)."""
    return _GUARD.enter(member)


def leave(member: Finishable) -> None:
    """`member` finished; may end the process if a signal is waiting for it."""
    _GUARD.leave(member)
