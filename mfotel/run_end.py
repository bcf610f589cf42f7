"""The end of a run, in one place: the final status, what ends it, and close()'s ordered
shutdown (no MindSpore).

    end = RunEnd(instruments, warn_once)      # at train begin (mfotel.run_parts assembles it)
    end.arm(monitor.close, close_seconds(cfg))   # atexit, SIGTERM / SIGINT (mfotel.lifecycle)
    end.stop(run_context.request_stop)        # on_nonfinite: stop, an action: once
    end.on_signal(signal.SIGTERM, None)       # mfotel.lifecycle: show cancelled at once
    end.fail(exc)                             # an exception leaves Model.train: close now
    end.finish(parts, total_steps=100, last_step=100)   # the monitor's close()

mfotel.lifecycle finishes the run's end (a `Finishable`): its close() is the monitor's.

Final status (`final_status`, a table in tests/unit/test_run_end.py): completed when the run
reached its last step without being stopped; an exception leaving `Model.train` is failed,
or cancelled when it is Ctrl-C or a chained signal handler's sys.exit(); otherwise a run
ended by SIGTERM / SIGINT is cancelled, unless a dead child process explains the signal
(MindSpore SIGTERMs itself when a dataset worker dies): then, like any early end, failed.

close() runs once, from whichever thread comes first (the training thread at train end, the
signal watcher, atexit). Every shutdown step runs even when an earlier one fails; a failure
is counted in `mfotel_export_errors_total{stage="shutdown"}` and warned about once, never
raised. KeyboardInterrupt (a second Ctrl-C during the linger) cuts the first steps short, and
the rest still run.
"""
from __future__ import annotations

import atexit
import logging
import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from . import contract, lifecycle
from .config import MonitorConfig
from .identity import finish_run
from .instruments import Instruments
from .sinks import LineWriter

if TYPE_CHECKING:
    from .run_parts import RunParts

log = logging.getLogger("mfotel")

Step = tuple[str, Callable[[], object]]


def final_status(*, error: BaseException | None, stopped: bool, total_steps: int | None,
                 last_step: int, signalled: int | None, child_failure: str | None) -> int:
    """The run's final `mindformers_train_status` (see the module docstring)."""
    if error is not None:
        cancelled = isinstance(error, KeyboardInterrupt) or (
            isinstance(error, SystemExit) and signalled is not None and child_failure is None)
        return contract.STATUS_CANCELLED if cancelled else contract.STATUS_FAILED
    if not stopped and (total_steps is None or last_step >= total_steps):
        return contract.STATUS_COMPLETED
    if signalled is not None and child_failure is None:
        return contract.STATUS_CANCELLED
    return contract.STATUS_FAILED


def close_seconds(cfg: MonitorConfig) -> float:
    """The longest close() may take: the last lines (flushed before the linger, then the
    writer stopped), the linger, and the final OTLP push of each provider."""
    return (3 * LineWriter.FLUSH_SECONDS + cfg.prometheus.linger_seconds
            + 2 * cfg.otlp.timeout_seconds)


class RunEnd:
    """What ends one run and how (see the module docstring): the facts the final status is
    decided from, the status shown meanwhile on `instruments`, and close() run once."""

    def __init__(self, instruments: Instruments, warn_once: Callable[[str, str], None]) -> None:
        self.instruments = instruments
        self.warn_once = warn_once
        self.stopped = False                  # stopped before its last step (request_stop)
        self.error: BaseException | None = None   # what left Model.train, if anything
        self.signalled: int | None = None     # SIGTERM / SIGINT received (mfotel.lifecycle)
        self.child_failure: str | None = None  # a dead child explains the SIGTERM
        self.closing_thread: int | None = None  # ident of the thread running close()
        self.closed = False
        self.final_status: int | None = None   # decided when close() begins
        self.final_scraped = False    # whether a scrape saw the final status before shutdown
        self._once = threading.Lock()
        self._close: Callable[[], None] | None = None   # the monitor's close(), once armed
        self._close_seconds = 0.0

    # ------------------------------------------------------------------ while the run goes on
    def arm(self, close: Callable[[], None], seconds: float) -> None:
        """From now on the run ends whatever becomes of training: `close` (the monitor's, at
        most `seconds` long) at interpreter exit and at SIGTERM / SIGINT (last: a failed start
        leaves the signal handlers alone). Raises what lifecycle.enter raises; the last
        shutdown steps undo both."""
        self._close, self._close_seconds = close, seconds
        atexit.register(close)
        lifecycle.enter(self)

    def stop(self, ask: Callable[[], None]) -> None:
        """Stop before the last step, once: `ask` MindSpore to (run_context.request_stop)."""
        if not self.stopped:
            self.stopped = True
            ask()

    def fail(self, error: BaseException) -> bool:
        """`error` left Model.train; True when it is the first (close now: it ends failed, or
        cancelled, before the exception leaves train())."""
        if self.error is not None:
            return False
        self.error = error
        return True

    def on_signal(self, signum: int, failure: str | None) -> None:
        """Note a terminating signal and show its status at once: cancelled, or failed when
        `failure` (a dead child) explains it; a run already ending keeps its final status.
        Assignments only: a signal handler or the watcher thread (mfotel.lifecycle)."""
        if self.signalled is None:
            self.signalled = signum
        if failure is not None and self.child_failure is None:
            self.child_failure = failure
        if self.closing_thread is None:
            failed = self.child_failure is not None
            self.instruments.state.status = \
                contract.STATUS_FAILED if failed else contract.STATUS_CANCELLED
            self.instruments.version += 1

    def running_again(self) -> None:
        """A step ended while the status is not running: the first step, or steps that go on
        after a signal (a chained handler that stops later or never, a KeyboardInterrupt
        MindSpore swallowed). Running, unless close() began: checked before the assignment
        and after it, since close() may begin on another thread in between (begin() sets the
        final status before `closing_thread`, so the second check restores it)."""
        state = self.instruments.state
        if self.closing_thread is not None:
            return
        state.status = contract.STATUS_RUNNING
        if self.closing_thread is not None and self.final_status is not None:
            state.status = self.final_status

    # ------------------------------------------------------------------ close
    @property
    def reason(self) -> str:
        """Why the run ended (`mindformers_train_end_timestamp_seconds{reason}`): completed,
        cancelled, failed (an exception, a dead child) or stopped (early, as asked)."""
        status = self.final_status
        if status == contract.STATUS_COMPLETED:
            return "completed"
        if status == contract.STATUS_CANCELLED:
            return "cancelled"
        return "failed" if self.error is not None or self.child_failure else "stopped"

    def decide(self, total_steps: int | None, last_step: int) -> int:
        return final_status(error=self.error, stopped=self.stopped, total_steps=total_steps,
                            last_step=last_step, signalled=self.signalled,
                            child_failure=self.child_failure)

    def begin(self, status: int) -> bool:
        """Claim the close (False: another thread has it, or it ran) with `status`."""
        if not self._once.acquire(blocking=False):
            return False
        self.final_status = status
        self.closing_thread = threading.get_ident()  # after the status: see running_again
        if self.child_failure is not None:
            log.warning("mfotel: SIGTERM after %s (MindSpore ends a run whose dataset worker "
                        "died that way): status failed", self.child_failure)
        return True

    def finish(self, parts: RunParts, total_steps: int | None, last_step: int) -> None:
        """Final status, last lines, linger, then everything else in `shutdown_steps`'s order;
        once, whichever thread comes first."""
        if self.begin(self.decide(total_steps, last_step)):
            self.shutdown(shutdown_steps(parts, self, last_step))

    # mfotel.lifecycle.Finishable: the signal guard finishes the run through the monitor
    def close(self) -> None:
        if self._close is not None:
            self._close()

    def close_seconds(self) -> float:
        return self._close_seconds

    def forget_close(self) -> None:
        """Interpreter exit has nothing to close any more (undoes arm's atexit)."""
        if self._close is not None:
            atexit.unregister(self._close)

    def shutdown(self, steps: tuple[Sequence[Step], Sequence[Step], Step]) -> None:
        """Run `first` (cut short by KeyboardInterrupt), then `then`, mark closed, then `last`
        (which may end the process: lifecycle re-delivers a signal that waited for us)."""
        first, then, last = steps
        try:
            for step in first:
                self._run(step)
        finally:
            for step in then:
                self._run(step)
            self.closed = True
            self._run(last)

    def _run(self, step: Step) -> None:
        name, action = step
        try:
            action()
        except Exception as exc:  # noqa: BLE001 - the end of training must not raise into MindSpore
            self.instruments.count_error("shutdown")
            self.warn_once(f"shutdown:{name}", f"mfotel: {name} failed at the end of training "
                           f"({type(exc).__name__}: {exc}); the other shutdown steps ran, "
                           f"failures are counted in mfotel_export_errors_total"
                           f"{{stage=\"shutdown\"}}")


def show_status(parts: RunParts, status: int, reason: str) -> None:
    """The final status, when and why the run ended; the node agent's heartbeat says it too
    (it lingers now: no stopped rank to capture stacks of)."""
    instruments = parts.exporter.instruments
    state, ended = instruments.state, time.time()
    if parts.account is not None:   # its last event: the final scrape and lines add up to it
        parts.account.close(ended)
    state.status, state.end_timestamp, state.end_reason = status, ended, reason
    instruments.touch()
    if parts.node_link is not None:
        parts.node_link.run_ended(ended)


def linger(parts: RunParts, signalled: int | None = None) -> bool:
    """Keep /metrics up for the final scrape; whether a scrape saw the final values. After a
    signal (`signalled`) the wait and its outcome go to stderr (lifecycle.note): why a
    cancelled process is still there, and why it then left."""
    prom, telemetry = parts.config.prometheus, parts.exporter.telemetry
    if not prom.linger_seconds or telemetry.endpoint is None:
        return False
    waiting = f"keeping /metrics up for the final scrape (at most {prom.linger_seconds:.0f} s)"
    if signalled is None:
        log.info("mfotel: %s", waiting)
    else:
        lifecycle.note(f"mfotel: {signal.Signals(signalled).name}: {waiting}")
    if not prom.linger_until_scraped:
        time.sleep(prom.linger_seconds)
        return False
    began = time.monotonic()
    scraped = telemetry.wait_scraped(prom.linger_seconds)
    if signalled is not None:
        lifecycle.note(f"mfotel: the final status was scraped after "
                       f"{time.monotonic() - began:.1f} s" if scraped else
                       f"mfotel: no scrape read the final status in {prom.linger_seconds:.0f} s")
    return scraped


def shutdown_steps(parts: RunParts, end: RunEnd, last_step: int
                   ) -> tuple[list[Step], list[Step], Step]:
    """close()'s steps, (first, then, last) for RunEnd.shutdown: the status and the last lines
    before the linger; the final checkpoint save (train end) happened before, or never will;
    the endpoint stops after every part that a scrape or the node agent reads."""
    assert end.final_status is not None
    status, reason = end.final_status, end.reason
    completed = status == contract.STATUS_COMPLETED
    lines = parts.lines

    def keep_up() -> None:
        end.final_scraped = linger(parts, end.signalled)

    def close_listeners() -> None:
        for listener in parts.listeners:
            listener.on_close()
    first: list[Step] = [("status", lambda: show_status(parts, status, reason))]
    if lines is not None:
        first.append(("monitor lines", lines.flush))
    first.append(("linger", keep_up))
    then: list[Step] = []
    if parts.checkpoint is not None:
        then.append(("checkpoint watch", parts.checkpoint.detach))
    then.append(("listeners", close_listeners))
    if lines is not None:
        then.append(("file sinks", lines.close))
    then.append(("run state", lambda: finish_run(parts.config.run, parts.rank, parts.job_name,
                                                 parts.run, last_step, completed)))
    if parts.file_sd is not None and completed:
        then.append(("file_sd", parts.file_sd.remove))
    if parts.node_link is not None:
        then.append(("node link", parts.node_link.close))
    then += [("telemetry", parts.exporter.shutdown), ("atexit", end.forget_close)]
    # last: lifecycle re-delivers a signal that waited for the close (it may end the process)
    return first, then, ("signal handlers", lambda: lifecycle.leave(end))
