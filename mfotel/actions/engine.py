"""Monitor-driven actions: local rules and the control file, applied at the same step on every rank.

    engine = ActionEngine(cfg.actions, "llama", rank=0, world_size=1)
    engine.start(optimizer, train_network)        # at train begin, before compilation
    for request in engine.step_end(step, loss, recorded, optimizer):
        if request.action == "stop":
            run_context.request_stop()

Sources of a decision: the plateau rule (no loss improvement of `min_delta` over `patience`
records), the non-finite rule (the loss turns NaN/Inf) and `control.json` (`mfotel control`, or
the alerts receiver). Only rank 0 decides: data-parallel ranks see different local losses and
must not diverge. It applies a decision at once when it is alone; with several ranks it writes
it to `schedule.json` with a step `lead_steps` ahead, and every rank (rank 0 included) applies
it after that step. Each rank logs each applied action once and counts it in
`mindformers_train_actions_total{action,source}`.

Nothing in the control directory can stop or stall training by itself: a file that cannot be
read or written (a FIFO, a directory, garbage, a full disk) is warned about once, counted
through `on_error("control")` (mfotel_export_errors_total{stage="control"}), and ignored until
it changes.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..config import ActionsConfig, ConfigError, PlateauRule
from ..instruments import Instruments
from ..listeners import StepListener, StepSample
from .control import (
    CONTROL_FILE,
    CONTROL_MAX_BYTES,
    SCHEDULE_FILE,
    SCHEDULE_MAX_BYTES,
    FileWatch,
    Request,
    make_job_dir,
    new_request,
    parse_schedule,
    write_schedule,
)
from .ownership import UnsafeControlDir, check_control_dir

log = logging.getLogger("mfotel")


class Plateau:
    """Fires when `patience` records in a row bring no loss improvement of `min_delta`.

    Non-finite losses are not records. After firing it waits `patience` records again.
    """

    def __init__(self, rule: PlateauRule) -> None:
        self.rule = rule
        self.best = math.inf
        self.waited = 0

    def update(self, loss: float | None) -> bool:
        if loss is None or not math.isfinite(loss):
            return False
        if loss < self.best - self.rule.min_delta:
            self.best, self.waited = loss, 0
            return False
        self.waited += 1
        if self.waited >= self.rule.patience:
            self.waited = 0
            return True
        return False


class ActionEngine(StepListener):
    """Decides (rank 0), schedules and applies actions; see the module docstring.

    The callback attaches it as a listener (mfotel.listeners): `attach(instruments)` exposes
    its counts, then `on_step` runs after every step's record.
    """

    #: Stage label of mfotel_export_errors_total for control-file problems.
    ERROR_STAGE = "control"
    MAX_WARNINGS = 10

    def __init__(self, cfg: ActionsConfig, job_name: str, rank: int = 0,
                 world_size: int = 1, on_error: Callable[[str], None] | None = None) -> None:
        self.cfg, self.job_name, self.rank, self.world_size = cfg, job_name, rank, world_size
        self.on_error = on_error  # called with ERROR_STAGE for every swallowed file problem
        self.errors = 0
        self.leader = rank == 0
        self.job_dir: Path | None = cfg.resolved_control_dir(job_name)
        self.plateau = Plateau(cfg.plateau) if cfg.plateau else None
        self.counts: dict[tuple[str, str], int] = {}
        self.applied: list[Request] = []
        self._schedule: list[Request] = []
        self._ignored: set[str] = set()   # request ids from before this run
        self._done: set[str] = set()
        self._loss_was_finite = True
        self._control = FileWatch(self.job_dir / CONTROL_FILE, CONTROL_MAX_BYTES) \
            if self.job_dir else None
        self._schedule_watch = FileWatch(self.job_dir / SCHEDULE_FILE, SCHEDULE_MAX_BYTES) \
            if self.job_dir else None
        self._warned: set[str] = set()
        self._verified = False   # the control directory passed check_control_dir

    # ------------------------------------------------------------ start
    def start(self, optimizer: Any = None, train_network: Any = None) -> None:
        """Check the setup, prepare the control directory and the optimizer.

        ConfigError when the setup cannot work (raised at train begin, before any step).
        """
        source = "monitor_config.actions"
        rules = self.cfg.plateau or self.cfg.nonfinite
        if self.world_size > 1 and rules and self.job_dir is None:
            raise ConfigError(source, "control_dir", f"local rules on {self.world_size} ranks "
                              "need a control directory: only rank 0 decides, and the other "
                              "ranks learn the decision from it", "set actions.control_dir to a "
                              "directory every rank can read, e.g. "
                              "/shared/mfotel-control/{job_name}")
        if self.job_dir is not None:
            self._prepare_dir(source)
        for pair in self._possible():
            self.counts.setdefault(pair, 0)  # so that increase() sees the first action
        if self.cfg.may_scale_lr and optimizer is not None:
            from .lr_scale import make_scalable
            try:
                problem = make_scalable(optimizer, train_network)
            except Exception as exc:  # noqa: BLE001 - an odd optimizer must not stop training
                problem = f"{type(exc).__name__}: {exc}"
            if problem:
                log.warning("mfotel: scale_lr will not work: %s", problem)

    def _prepare_dir(self, source: str) -> None:
        assert self.job_dir is not None and self._control and self._schedule_watch
        if self.leader:
            try:
                make_job_dir(self.job_dir)
                if not self._owned():
                    return
                write_schedule(self.job_dir, [])  # a new run: nothing scheduled yet
            except OSError as exc:
                raise ConfigError(source, "control_dir", f"cannot write {self.job_dir} "
                                  f"({exc.strerror or exc})", "choose a directory rank 0 can "
                                  "create and write, readable by every rank") from None
            stale = self._poll(self._control)
            if isinstance(stale, dict) and stale.get("id"):
                self._ignored.add(str(stale["id"]))
                log.warning("mfotel: ignoring %s written before this run started (request %s)",
                            self.job_dir / CONTROL_FILE, stale["id"])
        else:
            self._ignored.update(r.id for r in self._read_schedule())
            if self.job_dir is None:
                return
        log.info("mfotel: control directory %s (rank %d %s)", self.job_dir, self.rank,
                 "decides" if self.leader else "follows rank 0")

    def _owned(self) -> bool:
        """Whether the control directory is the trainer's and nobody else could write or
        replace it (mfotel.actions.ownership); if not, warn once, count it and use none."""
        if self._verified or self.job_dir is None:
            return self.job_dir is not None
        try:
            check_control_dir(self.job_dir)
        except OSError as exc:
            message = str(exc) if isinstance(exc, UnsafeControlDir) else \
                f"not using the control directory {self.job_dir}: {exc.strerror or exc}"
            rules = self.world_size > 1 and (self.cfg.plateau or self.cfg.nonfinite)
            self.job_dir = self._control = self._schedule_watch = None
            if rules:   # rank 0 could not tell the others: acting alone would split the job
                self.cfg = dataclasses.replace(self.cfg, plateau=None, nonfinite=None)
                self.plateau = None
            off = " and its local rules are off" if rules else ""
            self._file_problem(f"mfotel: {message}; rank {self.rank} ignores control requests "
                               f"and schedules for this run{off}, training goes on")
            return False
        self._verified = True
        return True

    def _possible(self) -> list[tuple[str, str]]:
        pairs = [(rule.action, name) for name, rule in
                 (("plateau", self.cfg.plateau), ("nonfinite", self.cfg.nonfinite)) if rule]
        if self.job_dir is not None:
            pairs += [(action, source) for source in ("control", "alert")
                      for action in ("stop", "scale_lr")]
        return pairs

    # ------------------------------------------------------------ the run
    def attach(self, instruments: Instruments) -> None:
        """Expose the actions taken and count control-file problems (also those met at
        start) in mfotel_export_errors_total{stage="control"}."""
        instruments.state.actions = self.counts
        instruments.state.export_errors[self.ERROR_STAGE] = self.errors
        self.on_error = instruments.count_error

    def on_step(self, sample: StepSample) -> None:
        """Decide and apply after the step's record; stop or re-read the lr through the run."""
        run = sample.run
        for request in self.step_end(sample.step, sample.outputs.loss, sample.recorded,
                                     run.optimizer()):
            if request.action == "stop":
                run.request_stop(request.describe())
            elif request.action == "scale_lr":
                run.learning_rate_changed()

    # ------------------------------------------------------------ every step
    def step_end(self, step: int, loss: float | None, recorded: bool,
                 optimizer: Any = None) -> list[Request]:
        """Decide, schedule and apply; returns the requests applied after `step`."""
        if self.leader:
            for request in self._decide(loss, recorded):
                self._accept(request, step)
        elif self._schedule_watch is not None:
            changed, data = self._poll_schedule()
            if changed:
                self._merge(data)
        due = [r for r in self._schedule if r.id not in self._done and r.step is not None
               and r.step <= step]
        return [request for request in due if self._apply(request, step, optimizer)]

    def _decide(self, loss: float | None, recorded: bool) -> list[Request]:
        decided: list[Request] = []
        finite = loss is None or math.isfinite(loss)
        rule = self.cfg.nonfinite
        if rule and not finite and self._loss_was_finite:
            decided.append(new_request(rule.action, rule.factor, "nonfinite", f"loss is {loss}"))
        self._loss_was_finite = finite
        if self.plateau and recorded and self.plateau.update(loss):
            p = self.plateau.rule
            decided.append(new_request(p.action, p.factor, "plateau", f"no loss improvement of "
                                       f"{p.min_delta:g} in {p.patience} records, best "
                                       f"{self.plateau.best:.6g}"))
        if self._control is not None:
            data = self._poll(self._control)
            if data is not None:
                try:
                    request = Request.from_json(data)
                except ValueError as exc:
                    self._file_problem(f"mfotel: ignoring {self._control.path}: {exc}")
                else:
                    known = self._ignored | {r.id for r in self._schedule}
                    if request.id not in known:
                        decided.append(request)
        return decided

    def _accept(self, request: Request, step: int) -> None:
        lead = self.cfg.lead_steps if self.world_size > 1 else 0
        scheduled = dataclasses.replace(request, step=step + lead)
        self._schedule.append(scheduled)
        if self.job_dir is not None:
            try:
                write_schedule(self.job_dir, self._schedule)
            except OSError as exc:  # rank 0 still applies it; the others cannot learn it
                self._file_problem(f"mfotel: cannot write {self.job_dir / SCHEDULE_FILE} "
                                   f"({exc.strerror or exc}); the other ranks will not apply "
                                   f"{request.describe()}")
        if lead:
            log.warning("mfotel: step %d: rank 0 scheduled %s for step %d on all %d ranks",
                        step, request.describe(), step + lead, self.world_size)

    def _merge(self, data: Any) -> None:
        try:
            scheduled = parse_schedule(data)
        except ValueError as exc:
            self._file_problem(f"mfotel: ignoring {SCHEDULE_FILE}: {exc}")
            return
        known = {r.id for r in self._schedule}
        self._schedule += [r for r in scheduled if r.id not in known and r.id not in self._ignored]

    def _apply(self, request: Request, step: int, optimizer: Any) -> bool:
        self._done.add(request.id)
        late = step - (request.step or step)
        if late:
            log.error("mfotel: rank %d applies %s at step %d, %d steps after the scheduled step "
                      "%d: it read %s late. Fix: raise actions.lead_steps", self.rank,
                      request.describe(), step, late, request.step, SCHEDULE_FILE)
        if request.action == "scale_lr":
            from .lr_scale import LrNotScalable, scale_learning_rate
            try:
                scale_learning_rate(optimizer, request.factor or 1.0)
            except LrNotScalable as exc:
                log.error("mfotel: step %d: cannot apply %s: %s", step, request.describe(), exc)
                return False
        log.warning("mfotel: step %d: %s on rank %d (job %s, request %s)", step,
                    request.describe(), self.rank, self.job_name, request.id)
        key = (request.action, request.source)
        self.counts[key] = self.counts.get(key, 0) + 1
        self.applied.append(request)
        return True

    # ------------------------------------------------------------ files
    def _poll(self, watch: FileWatch) -> Any:
        try:
            return watch.poll()[1]
        except ValueError as exc:
            self._file_problem(f"mfotel: {exc}; ignored until it changes")
            return None

    def _poll_schedule(self) -> tuple[bool, Any]:
        """A follower's poll; the directory is checked once rank 0 made it (the schedule)."""
        assert self._schedule_watch is not None
        try:
            changed, data = self._schedule_watch.poll()
        except ValueError as exc:
            self._file_problem(f"mfotel: {exc}; ignored until it changes")
            return False, None
        if data is not None and not self._owned():
            return False, None
        return changed, data

    def _read_schedule(self) -> list[Request]:
        changed, data = self._poll_schedule()
        if not changed or data is None:
            return []
        try:
            return parse_schedule(data)
        except ValueError:
            return []

    def _file_problem(self, message: str) -> None:
        """Count a control-file problem; warn once per distinct problem, at most MAX_WARNINGS
        times in all (a file rewritten with garbage in a loop must not flood the log)."""
        self.errors += 1
        if self.on_error is not None:
            self.on_error(self.ERROR_STAGE)
        if message not in self._warned and len(self._warned) < self.MAX_WARNINGS:
            self._warned.add(message)
            log.warning("%s (control-file problems are counted in "
                        "mfotel_export_errors_total{stage=\"%s\"})", message, self.ERROR_STAGE)
