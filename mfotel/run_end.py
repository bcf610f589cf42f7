"""The end of a run: the final status, and the ordered shutdown steps of close() (no MindSpore).

    end = RunEnd(report)                      # report(step_name, exc): count and warn once
    end.on_signal(signal.SIGTERM, None)       # mfotel.lifecycle: show cancelled at once
    if end.begin(end.decide(total_steps=100, last_step=100)):   # once, first thread wins
        end.shutdown(parts.shutdown_steps(end, last_step, monitor, monitor.close))

Final status (`final_status`, a table in tests/unit/test_run_end.py): completed when the run
reached its last step without being stopped; an exception leaving `Model.train` is failed,
or cancelled when it is Ctrl-C or a chained signal handler's sys.exit(); otherwise a run
ended by SIGTERM / SIGINT is cancelled, unless a dead child process explains the signal
(MindSpore SIGTERMs itself when a dataset worker dies): then, like any early end, failed.

Every shutdown step runs even when an earlier one fails; a failure is reported, never raised.
KeyboardInterrupt (a second Ctrl-C during the linger) cuts the first steps short, and the
rest still run.
"""
from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from . import contract, lifecycle
from .checkpoints import CheckpointWatch
from .config import MonitorConfig
from .identity import RunIdentity, finish_run
from .listeners import StepListener
from .node_link import NodeLink
from .rank_exporter import RankExporter
from .sinks import LineWriter

log = logging.getLogger("mfotel")

Step = tuple[str, Callable[[], object]]


class Removable(Protocol):
    """A file the run wrote that a normal end removes (mfotel.cluster.discovery.FileSdWriter)."""

    def remove(self) -> None: ...


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


class RunEnd:
    """What decides the end of one run, and close() run once from whichever thread comes."""

    def __init__(self, report: Callable[[str, BaseException], None]) -> None:
        self.report = report
        self.stopped = False                  # stopped before its last step (request_stop)
        self.error: BaseException | None = None   # what left Model.train, if anything
        self.signalled: int | None = None     # SIGTERM / SIGINT received (mfotel.lifecycle)
        self.child_failure: str | None = None  # a dead child explains the SIGTERM
        self.closing_thread: int | None = None  # ident of the thread running close()
        self.closed = False
        self.final_status: int | None = None   # decided when close() begins
        self._once = threading.Lock()

    def on_signal(self, signum: int, failure: str | None) -> int | None:
        """Note a terminating signal; the status to show at once, or None when the run is
        already ending (it keeps its final status). Assignments only: a signal handler."""
        if self.signalled is None:
            self.signalled = signum
        if failure is not None and self.child_failure is None:
            self.child_failure = failure
        if self.closing_thread is not None:
            return None
        return contract.STATUS_FAILED if self.child_failure else contract.STATUS_CANCELLED

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
        self.closing_thread = threading.get_ident()  # after the status: see the step path
        if self.child_failure is not None:
            log.warning("mfotel: SIGTERM after %s (MindSpore ends a run whose dataset worker "
                        "died that way): status failed", self.child_failure)
        return True

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
            self.report(name, exc)


def linger(exporter: RankExporter, cfg: MonitorConfig) -> bool:
    """Keep /metrics up for the final scrape; whether a scrape saw the final values."""
    prom = cfg.prometheus
    if not prom.linger_seconds or exporter.telemetry.endpoint is None:
        return False
    log.info("mfotel: keeping /metrics up for the final scrape (at most %.0f s)",
             prom.linger_seconds)
    if prom.linger_until_scraped:
        return exporter.telemetry.wait_scraped(prom.linger_seconds)
    time.sleep(prom.linger_seconds)
    return False


@dataclass
class RunParts:
    """The parts of one run that its end shuts down, in this order (`shutdown_steps`)."""

    config: MonitorConfig
    rank: int
    job_name: str
    exporter: RankExporter
    run: RunIdentity
    lines: LineWriter | None = None
    checkpoints: list[CheckpointWatch] = field(default_factory=list)
    listeners: list[StepListener] = field(default_factory=list)
    file_sd: Removable | None = None
    node_link: NodeLink | None = None  # what the node agent reads (mfotel-instrument)
    final_scraped: bool = False    # whether a scrape saw the final status before shutdown

    def show_status(self, status: int, reason: str) -> None:
        state = self.exporter.instruments.state
        ended = time.time()
        state.status, state.end_timestamp, state.end_reason = status, ended, reason
        self.exporter.instruments.touch()
        if self.node_link is not None:  # it lingers now: no stopped rank to capture stacks of
            self.node_link.run_ended(ended)

    def _linger(self) -> None:
        self.final_scraped = linger(self.exporter, self.config)

    def _close_listeners(self) -> None:
        for listener in self.listeners:
            listener.on_close()

    def _detach_checkpoints(self) -> None:
        for watch in self.checkpoints:
            watch.detach()

    def shutdown_steps(self, end: RunEnd, last_step: int, member: lifecycle.Finishable,
                       close: Callable[[], None]) -> tuple[list[Step], list[Step], Step]:
        """close()'s steps: (first, then, last) for RunEnd.shutdown. `member` is the monitor
        registered with mfotel.lifecycle, `close` its close() registered with atexit."""
        assert end.final_status is not None
        status, reason = end.final_status, end.reason
        completed = status == contract.STATUS_COMPLETED
        lines = self.lines
        first: list[Step] = [("status", lambda: self.show_status(status, reason))]
        if lines is not None:  # the last lines before the linger, not after it
            first.append(("monitor lines", lines.flush))
        first.append(("linger", self._linger))
        # the final checkpoint save (train end) happened before, or never will
        then: list[Step] = [("checkpoint watch", self._detach_checkpoints),
                            ("listeners", self._close_listeners)]
        if lines is not None:
            then.append(("file sinks", lines.close))
        then.append(("run state", lambda: finish_run(self.config.run, self.rank, self.job_name,
                                                     self.run, last_step, completed)))
        if self.file_sd is not None and completed:
            then.append(("file_sd", self.file_sd.remove))
        if self.node_link is not None:
            then.append(("node link", self.node_link.close))
        then += [("telemetry", self.exporter.shutdown),
                 ("atexit", lambda: atexit.unregister(close))]
        return first, then, ("signal handlers", lambda: lifecycle.leave(member))
