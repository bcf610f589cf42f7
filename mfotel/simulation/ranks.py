"""A worker process serving simulated ranks, each the real per-rank mfotel stack.

Each rank is built by `mfotel.rank_exporter` (MeterProviders, Resource, Prometheus reader,
cached exposition, HTTP server on its own port, instruments), exactly as `OTelMonitor` builds
it at train begin; `SimRank.step` assigns the state `OTelMonitor.on_train_step_end` assigns.
Only the training loop is synthetic (`scenario.TrainingModel`, `scenario.JobClock`).

    python -m mfotel.simulation.ranks WORKER.json      # started by `run`

JSON lines on stdin/stdout: the worker builds and serves its ranks and prints
`{"ready": n, "failed": [...]}`, reads `{"start": unix_time}`, runs the scenario until
`start + duration` or until its stdin closes (the orchestrator stopped or died), then every
rank still up reports cancelled and lingers for its final scrape (as `OTelMonitor` on
SIGTERM), and the worker shuts its ranks down and prints `{"done": ...}` with its resource use.
"""
from __future__ import annotations

import heapq
import itertools
import json
import math
import os
import random
import resource
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..config import MonitorConfig, parse_config
from ..contract import STATUS_COMPLETED, STATUS_RUNNING
from ..identity import RankIdentity, RunIdentity
from ..rank_exporter import rank_exporter
from ..time_account import TimeAccount
from .attempts import RESTART, resume_step
from .node_agents import RankEnd, SimNodeAgent
from .scenario import STATUS_CANCELLED, JobClock, RankSpec, Timing, TrainingModel

STEPS_PER_EPOCH = 1000


class SimRank:
    """One rank: the real rank exporter, serving /metrics on `host:port + local rank`;
    `process_start`: a restarted rank's process start (else its first step's begin);
    `attempt`: the attempt of a configured run (`run.id`: run_id and attempt on rank_info),
    0 for a run without one."""

    def __init__(self, spec: RankSpec, cfg: MonitorConfig, node_name: str, seed: int,
                 process_start: float | None = None, attempt: int = 0) -> None:
        self.spec, self.node_name, self.seed = spec, node_name, seed
        self.export_errors = 0
        identity = RankIdentity(rank=spec.rank, local_rank=spec.local_rank,
                                world_size=spec.world_size, node=node_name,
                                device_id=str(spec.local_rank),
                                local_world_size=spec.ranks_per_node, node_rank=spec.node_rank,
                                local_rank_source="init")
        self.exporter = rank_exporter(cfg, identity, spec.job,
                                      run=RunIdentity(run_id=f"{spec.job}-run",
                                                      attempt=max(attempt, 1),
                                                      configured=attempt > 0),
                                      on_error=self._count_error)
        self.telemetry, self.instruments = self.exporter.telemetry, self.exporter.instruments
        self.cfg = cfg
        self.rng = random.Random(f"{seed}/{spec.job}/{spec.rank}")
        self._last_record: tuple[float, int] | None = None  # (wall, samples) at the last record
        self.ended = False   # reported its final status, or died
        self.account: TimeAccount | None = None   # made at the first step: its process start
        if process_start is not None:
            self._account(process_start)

    def _account(self, started: float) -> TimeAccount:
        """The rank's time account (mfotel.time_account), as a real rank's process keeps it:
        its origin the simulated process start, `started`."""
        if self.account is None:
            self.account = TimeAccount(started)
            st = self.instruments.state
            st.time, st.process_start_timestamp = self.account.totals, started
        return self.account

    def _count_error(self, stage: str) -> None:
        self.export_errors += 1  # the exporter counts it in mfotel_export_errors_total too

    @property
    def served(self) -> bool:
        return self.telemetry.endpoint is not None

    def step(self, step: int, wall: float, seconds: float, loss: float, grad_norm: float,
             learning_rate: float, total_steps: int, batch_size: int, seq_length: int) -> None:
        """The state OTelMonitor assigns at the end of a step (mfotel/callback.py `_step_end`)."""
        st, inst = self.instruments.state, self.instruments
        st.status = STATUS_RUNNING
        if st.start_timestamp is None:   # train begin: just before the first step
            st.start_timestamp = wall - seconds
        elif st.last_step_timestamp is not None:   # the rest of the period: outside the step
            st.step_outside += max(wall - seconds - st.last_step_timestamp, 0.0)
        account = self._account(st.start_timestamp)
        account.step_begin(wall - seconds)
        account.step_end(wall)
        st.step_begin_timestamp = wall - seconds
        st.step, st.steps, st.last_step_timestamp = step, st.steps + 1, wall
        st.epoch = 1 + (step - 1) // STEPS_PER_EPOCH
        st.progress = min(step / total_steps, 1.0)
        st.loss_finite = int(math.isfinite(loss))
        if not st.loss_finite:
            st.nonfinite["loss"] += 1
            st.loss = loss   # exposed as it is, between records too
            if st.first_nonfinite_step is None:
                st.first_nonfinite_step = step
        if not math.isfinite(grad_norm):
            st.nonfinite["grad_norm"] += 1
            st.grad_norm = grad_norm
        inst.record_step_seconds(seconds)
        st.samples = (st.samples or 0) + batch_size
        st.tokens = (st.tokens or 0) + batch_size * seq_length
        if self.cfg.is_record_step(step):
            st.loss, st.grad_norm = loss, grad_norm
            if math.isfinite(learning_rate):
                st.learning_rate = learning_rate
            if self._last_record is not None and wall > self._last_record[0]:
                elapsed = wall - self._last_record[0]
                st.throughput = (st.samples - self._last_record[1]) / elapsed
                # a rank is one device: its tokens per second are the device's
                st.device_tokens = st.throughput * seq_length
            self._last_record = (wall, st.samples)
        inst.touch()

    def enter_step(self, wall: float) -> None:
        """The step begins at `wall` (OTelMonitor's step-begin mark); it may never end."""
        self.instruments.state.step_begin_timestamp = wall
        self.instruments.touch()

    def finish(self, status: int) -> None:
        """The final status of a rank that ends (OTelMonitor.close before its linger)."""
        self.ended = True
        self.instruments.state.status = status
        if self.account is not None:
            self.account.close(time.time())
        self.instruments.touch()

    def shutdown(self) -> None:
        self.ended = True
        self.telemetry.shutdown()


class Worker:
    """Runs the scenario for this worker's ranks on one event heap (unix times)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.timing = Timing(**spec["timing"])
        self.model = TrainingModel()
        self.duration = float(spec["duration"])
        self.seed = int(spec["seed"])
        self.slow: dict[str, float] = spec["slow"]   # job -> its period's factor after the fault
        self.faults: dict[str, str] = spec["faults"]  # job -> its fault
        self.ranks: list[SimRank] = []
        self.failed: list[str] = []
        configs: dict[tuple[str, int], MonitorConfig] = {}
        for item in spec["ranks"]:
            rank_spec = RankSpec(**item["spec"])
            key = (item["host"], item["port"])
            if key not in configs:   # one config per node, as on a real node
                base = spec["monitor_config"]
                configs[key] = parse_config({**base, "prometheus": {
                    **base.get("prometheus", {}), "host": item["host"], "port": item["port"],
                    "linger_seconds": self.timing.linger_seconds}}, source="mfotel simulate")
            rank = SimRank(rank_spec, configs[key], item["node_name"], self.seed,
                           attempt=1 if rank_spec.role == RESTART else 0)
            if not rank.served:
                self.failed.append(f"{rank_spec.job} rank {rank_spec.rank}: cannot serve "
                                   f"{item['host']}:{item['port'] + rank_spec.local_rank}")
            self.ranks.append(rank)
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._lingering: list[threading.Thread] = []
        self._last_steps: dict[str, int] = {}   # job -> steps ended before the fault
        self._clocks: dict[str, JobClock] = {}
        self.stopped = threading.Event()          # set when the orchestrator goes away
        self.ends: dict[tuple[str, int], RankEnd] = {}  # how ranks ended (node agents)
        self.agents = [SimNodeAgent(
            [(r.spec.job, r.spec.rank, r.spec.local_rank, r) for r in self.ranks
             if r.spec.node == node["node"]], node["host"], node["port"], self.ends)
            for node in spec.get("node_agents", [])]
        self.failed += [f"node agent of node {node['node']}: cannot serve "
                        f"{node['host']}:{node['port']}"
                        for node, agent in zip(spec.get("node_agents", []), self.agents,
                                               strict=True) if not agent.served]

    # ------------------------------------------------------------ scheduling
    def at(self, when: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (when, next(self._seq), action))

    def run(self, start: float) -> None:
        t = self.timing
        fault_at = start + t.fault_at
        clocks = {job: JobClock(start + t.startup_seconds, t, slow_from=fault_at,
                                slow_factor=self.slow.get(job, 1.0))
                  for job in {rank.spec.job for rank in self.ranks}}
        self._clocks = clocks
        for job, clock in clocks.items():
            self._last_steps[job] = clock.last_step_before(fault_at)
        for rank in self.ranks:
            self._schedule(rank, clocks[rank.spec.job], 1, fault_at)
        end = start + self.duration
        while self._heap and self._heap[0][0] < end and not self.stopped.is_set():
            when, _, action = self._heap[0]
            delay = when - time.time()
            if delay > 0:
                self.stopped.wait(min(delay, 0.5))
                continue
            heapq.heappop(self._heap)
            action()
        for rank in self.ranks:   # stopped: as OTelMonitor on SIGTERM
            if not rank.ended:
                self._finish(rank, STATUS_CANCELLED, wait_out=True)
        for thread in self._lingering:
            thread.join(timeout=t.linger_seconds + 5)

    def _schedule(self, rank: SimRank, clock: JobClock, step: int, fault_at: float) -> None:
        """Queue `rank`'s step `step`, or what its job's fault does to it."""
        role, fault = rank.spec.role, self.faults[rank.spec.job]
        ends = clock.step_end(step) + rank.spec.skew
        last = self._last_steps[rank.spec.job]
        if role == "complete":
            if step > last:
                self.at(clock.step_end(last) + rank.spec.skew + 0.01,
                        lambda: self._finish(rank, STATUS_COMPLETED))
                return
        elif step > last and fault == RESTART:   # every rank killed, then its next attempt
            restart_at = fault_at + self.timing.restart_pause_seconds
            self.at(fault_at, lambda: self._end(rank, RankEnd(time.time(), signal.SIGKILL)))
            self.at(restart_at, lambda: self._restart(rank, restart_at, last))
            return
        elif step > last and fault in ("rank_down", "hang", "cancel"):
            if role == "rank_down":      # the process dies: its port closes, no final status
                self.at(fault_at, lambda: self._end(rank, RankEnd(time.time(), signal.SIGKILL)))
            elif role == "cancel":
                self.at(fault_at, lambda: self._finish(rank, STATUS_CANCELLED))
            elif role == "healthy":      # into the next step's collective, never out of it
                begins = clock.step_end(last) + rank.spec.skew + self._outside(rank, step)
                self.at(begins, lambda: rank.enter_step(begins))
            return                       # hang: between steps, endpoint still answering

        def do_step() -> None:
            total = last if role == "complete" else self.model.total_steps
            self._step(rank, clock, step, ends, total, step > last)
            self._schedule(rank, clock, step + 1, fault_at)
        self.at(ends, do_step)

    def _restart(self, old: SimRank, at: float, last: int) -> None:
        """The rank's next attempt (mfotel/simulation/attempts.py): a new process started at
        `at` on the old one's port, resuming after the job's last checkpoint."""
        if self.stopped.is_set():
            return
        rank = SimRank(old.spec, old.cfg, old.node_name, old.seed, process_start=at,
                       attempt=2)
        self.ranks[self.ranks.index(old)] = rank
        clock = JobClock(at + self.timing.startup_seconds, self.timing)
        self._schedule_attempt(rank, clock, resume_step(last, self.timing), 1)

    def _schedule_attempt(self, rank: SimRank, clock: JobClock, resumed: int,
                          local: int) -> None:
        """Queue a restarted rank's `local`-th step (global step `resumed + local`)."""
        ends = clock.step_end(local) + rank.spec.skew

        def do_step() -> None:
            self._step(rank, clock, resumed + local, ends, self.model.total_steps, False,
                       clock_step=local)
            self._schedule_attempt(rank, clock, resumed, local + 1)
        self.at(ends, do_step)

    def _outside(self, rank: SimRank, step: int, faulty: bool = False) -> float:
        """The rank's host time between steps: a little, plus the straggler's input wait."""
        t = self.timing
        outside = t.outside_seconds * (1 + abs(rank.rng.gauss(0, 0.2)))
        return outside + (t.input_wait_seconds if faulty and rank.spec.role == "input" else 0.0)

    def _step(self, rank: SimRank, clock: JobClock, step: int, ends: float, total: int,
              faulty: bool, clock_step: int | None = None) -> None:
        """Step `step` of `rank` ends at `ends`: its timed step is the job's period minus its
        time outside the step (the ranks leave each step's collective together); the clock
        counts `clock_step` (a restarted attempt's own count), else `step`."""
        t, rng, role = self.timing, rank.rng, rank.spec.role
        k = step if clock_step is None else clock_step
        period = clock.step_end(k) - (clock.step_end(k - 1) if k > 1 else clock.start)
        seconds = period - self._outside(rank, step, faulty)
        loss = self.model.loss(step, rng.gauss(0, 0.02))
        grad_norm = self.model.grad_norm(step, rng.gauss(0, 0.05))
        if self.faults[rank.spec.job] == "nan" and faulty:
            # the origin's loss and the all-reduced grad norm at once, the others' loss a
            # step later (their weights are NaN after the update)
            grad_norm = float("nan")
            if role == "nan" or step > self._last_steps[rank.spec.job] + 1:
                loss = float("nan")
        rank.step(step, ends, seconds, loss, grad_norm, self.model.learning_rate(step), total,
                  t.batch_size, t.seq_length)

    def _finish(self, rank: SimRank, status: int, wait_out: bool = False) -> None:
        """Final status, then (on a thread) linger until scraped and shut down; `wait_out`:
        the whole linger even once the orchestrator has gone (the final status must be
        scraped)."""
        rank.finish(status)
        stop = threading.Event() if wait_out else self.stopped

        def linger() -> None:   # as OTelMonitor.close
            if rank.cfg.prometheus.linger_until_scraped:
                rank.telemetry.wait_scraped(self.timing.linger_seconds)
            else:
                stop.wait(self.timing.linger_seconds)
            self._end(rank, RankEnd(time.time(), 0, cancelled=status == STATUS_CANCELLED))
        thread = threading.Thread(target=linger, name="mfotel-sim-linger", daemon=True)
        thread.start()
        self._lingering.append(thread)

    def _end(self, rank: SimRank, end: RankEnd) -> None:
        """The rank's process ends: its endpoint closes; its node agent tells how."""
        self.ends[(rank.spec.job, rank.spec.rank)] = end
        rank.shutdown()

    def shutdown(self) -> None:
        # concurrently: each server's shutdown waits up to its 0.5 s poll interval
        with ThreadPoolExecutor(max_workers=64) as pool:
            list(pool.map(SimRank.shutdown, self.ranks))
        for agent in self.agents:
            agent.close()


def _usage() -> dict[str, float]:
    times = os.times()
    return {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "cpu_seconds": times.user + times.system}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(argv[0]).read_text())
    before = _usage()
    worker = Worker(spec)
    built = _usage()
    print(json.dumps({"ready": sum(r.served for r in worker.ranks), "failed": worker.failed,
                      "build_rss_bytes": built["peak_rss_bytes"] - before["peak_rss_bytes"],
                      "base_rss_bytes": before["peak_rss_bytes"]}), flush=True)
    line = sys.stdin.readline()
    if not line.strip():
        worker.shutdown()
        return 1

    def watch_parent() -> None:   # stdin closes when the orchestrator stops or dies
        sys.stdin.read()
        worker.stopped.set()
    threading.Thread(target=watch_parent, name="mfotel-sim-parent", daemon=True).start()
    try:
        worker.run(float(json.loads(line)["start"]))
    finally:
        worker.shutdown()
    done = _usage()
    print(json.dumps({"done": len(worker.ranks), **done,
                      "export_errors": sum(r.export_errors for r in worker.ranks)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
