"""The simulated cluster, pure: jobs and their faults, the training model, the expected pages.

A simulation of N ranks is one large job with an input-bound straggler in it, beside small
jobs, one per fault, so that Alertmanager's inhibitions (a job's critical alert mutes its
warnings) cannot hide one fault behind another. The jobs train as synchronous data-parallel
jobs do (docs/alerting.md, "Job-level truth"): every rank leaves each step's collective
together, so a rank's timed step is the job's step period minus its own time outside the step
(input, host work between steps); the others wait for the slowest inside their steps.

Each job (nodes), what happens at the fault time, and the one notification it must cause:

- `<prefix>-main` (the rest): one rank waits 0.5 s for its input before each step (outside
  it), the others wait for it inside theirs: `MindFormersStragglerRank` naming that rank.
- `<prefix>-compute` (1): one rank computes 8x slower, every rank's step is 8x longer:
  `MindFormersThroughputDrop` for the job, no rank named.
- `<prefix>-nan` (1): one rank's loss and grad norm go NaN; every other rank's grad norm at
  that step, its loss from the next: `MindFormersLossNotFinite` naming that rank.
- `<prefix>-rank-down` (1): one rank's process dies (its port closes), the others stay
  inside the next step: `MindFormersRankDown` naming that rank (the first to leave: the stall
  and the missing rank it causes never fire); with a node agent per node, the agent's
  `MindFormersRankExited` naming it and its signal (RankDown is muted where the agent reports
  the rank).
- `<prefix>-hang` (2): the ranks of its second node hang between steps, the others wait
  inside the next step: `MindFormersTrainingStalled` naming the hung ranks.
- `<prefix>-complete` (1): the last step, status completed, final scrape, exit: nothing.
- `<prefix>-cancel` (1): cancelled (SIGTERM), final status, final scrape, exit: nothing.

When the simulation stops, every rank still up reports cancelled and lingers for its final
scrape, as `OTelMonitor` does on SIGTERM: stopping it pages nobody.
"""
from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from .. import contract
from ..alerting.rules import RulesConfig, duration_seconds
from ..contract import STATUS_FAILED

FAULT_JOBS: tuple[tuple[str, int], ...] = (   # (fault, nodes); the main job takes the rest
    ("compute", 1), ("nan", 1), ("rank_down", 1), ("hang", 2), ("complete", 1), ("cancel", 1))
JOB_SUFFIX = {"input": "main", "compute": "compute", "nan": "nan", "rank_down": "rank-down",
              "hang": "hang", "complete": "complete", "cancel": "cancel",
              # opt-in, beside or instead of the others (mfotel/simulation/attempts.py)
              "restart": "restart"}
#: Status a cancelled rank reports: the contract's own "cancelled" value when it has one.
STATUS_CANCELLED: int = getattr(contract, "STATUS_CANCELLED", STATUS_FAILED)


@dataclass(frozen=True)
class SimJob:
    name: str
    fault: str                      # input (main job), compute, nan, rank_down, hang, ...
    first_node: int                 # global index of its first node
    nodes: int
    ranks_per_node: int
    fault_ranks: tuple[int, ...]    # ranks the fault hits (all ranks for complete / cancel)

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node


@dataclass(frozen=True)
class RankSpec:
    """One simulated rank: who it is, where it serves, what happens to it."""

    job: str
    rank: int
    local_rank: int
    node: int                       # global node index
    node_rank: int                  # node index within the job
    world_size: int
    ranks_per_node: int
    role: str                       # healthy, or the fault that hits this rank
    skew: float                     # seconds after the job's step boundary it ends its steps


@dataclass(frozen=True)
class Timing:
    """Seconds. The fault time is `startup + warmup` after the start."""

    step_seconds: float = 1.0       # a healthy job's step period
    outside_seconds: float = 0.02   # a rank's host time between steps (input, callbacks)
    input_wait_seconds: float = 0.5  # the input-bound straggler's extra wait before each step
    compute_factor: float = 8.0     # the compute-bound straggler's step over a healthy one's
    startup_seconds: float = 5.0    # status 0 (graph compilation) before the first step
    warmup_seconds: float = 60.0    # healthy running before the faults
    linger_seconds: float = 30.0    # completed / cancelled ranks wait this long for a scrape
    checkpoint_steps: int = 10      # a restarted job resumes after its last multiple of these
    restart_pause_seconds: float = 10.0  # a restarted job: its kill to its new processes' start
    batch_size: int = 4
    seq_length: int = 4096

    @property
    def fault_at(self) -> float:
        return self.startup_seconds + self.warmup_seconds


def plan_jobs(ranks: int, ranks_per_node: int = 8, prefix: str = "sim",
              seed: int = 0) -> list[SimJob]:
    """The jobs of a simulation of `ranks` ranks; ValueError naming the fix if they don't fit."""
    if ranks_per_node < 2:
        raise ValueError("ranks_per_node must be at least 2")
    if ranks % ranks_per_node:
        raise ValueError(f"--ranks {ranks} is not a multiple of --ranks-per-node {ranks_per_node}")
    fault_nodes = sum(nodes for _, nodes in FAULT_JOBS)
    main_nodes = ranks // ranks_per_node - fault_nodes
    if main_nodes < 1 or main_nodes * ranks_per_node < 4:
        need = (fault_nodes + max(1, -(-4 // ranks_per_node))) * ranks_per_node
        raise ValueError(f"{ranks} ranks of {ranks_per_node} per node leave no main job beside "
                         f"the {fault_nodes} fault nodes; use at least {need} ranks")
    rng = random.Random(seed)
    jobs, node = [], 0
    for fault, nodes in (("input", main_nodes), *FAULT_JOBS):
        size = nodes * ranks_per_node
        if fault in ("complete", "cancel"):
            hit: tuple[int, ...] = tuple(range(size))
        elif fault == "hang":
            hit = tuple(range(ranks_per_node, 2 * ranks_per_node))    # its second node
        else:
            hit = (rng.randrange(size),)
        jobs.append(SimJob(f"{prefix}-{JOB_SUFFIX[fault]}", fault, node, nodes, ranks_per_node,
                           hit))
        node += nodes
    return jobs


def rank_specs(jobs: list[SimJob], seed: int = 0) -> list[RankSpec]:
    """Every rank of `jobs`, node by node (the order of the global node index)."""
    rng = random.Random(seed + 1)
    specs = []
    for job in jobs:
        for rank in range(job.world_size):
            node_rank, local = divmod(rank, job.ranks_per_node)
            role = job.fault if rank in job.fault_ranks else "healthy"
            specs.append(RankSpec(job.name, rank, local, job.first_node + node_rank, node_rank,
                                  job.world_size, job.ranks_per_node, role,
                                  skew=rng.uniform(0.0, 0.05)))
    return specs


# ---------------------------------------------------------------- the training model
@dataclass(frozen=True)
class TrainingModel:
    """Loss, learning rate and grad norm of a pre-training run at global step `step`."""

    total_steps: int = 100_000
    peak_lr: float = 3e-4
    warmup_steps: int = 100

    def learning_rate(self, step: int) -> float:
        if step <= self.warmup_steps:
            return self.peak_lr * step / self.warmup_steps
        progress = min((step - self.warmup_steps) / max(self.total_steps - self.warmup_steps, 1), 1)
        return 0.1 * self.peak_lr + 0.45 * self.peak_lr * (1 + math.cos(math.pi * progress))

    @staticmethod
    def loss(step: int, noise: float) -> float:
        """Mean loss falling from ~10.4 to ~2.2, times this rank's batch noise (data parallel)."""
        return (2.2 + 8.2 * math.exp(-step / 400)) * (1 + noise)

    @staticmethod
    def grad_norm(step: int, noise: float) -> float:
        return (0.9 + 1.5 * math.exp(-step / 150)) * (1 + noise)


@dataclass
class JobClock:
    """When the job's steps end: lock step (every rank leaves the collective together), the
    period stretched by `slow_factor` from `slow_from` on (a straggler)."""

    start: float                    # unix time the first step begins
    timing: Timing
    slow_from: float = math.inf     # unix time the straggler slows the job down
    slow_factor: float = 1.0
    _ends: list[float] = field(default_factory=list)

    def period(self, at: float) -> float:
        step = self.timing.step_seconds
        return step * self.slow_factor if at >= self.slow_from else step

    def step_end(self, step: int) -> float:
        """Unix time global step `step` (1-based) ends."""
        while len(self._ends) < step:
            previous = self._ends[-1] if self._ends else self.start
            self._ends.append(previous + self.period(previous))
        return self._ends[step - 1]

    def last_step_before(self, at: float) -> int:
        """The number of steps ended by unix time `at`."""
        step = 0
        while self.step_end(step + 1) <= at:
            step += 1
        return step


def slow_factor(job: SimJob, timing: Timing) -> float:
    """How much longer the job's steps are once its straggler slows it: an input wait adds
    to every rank's period (the others wait for it), a slow device multiplies it."""
    if job.fault == "input":
        return 1 + timing.input_wait_seconds / timing.step_seconds
    if job.fault == "compute":
        return timing.compute_factor
    return 1.0


# ---------------------------------------------------------------- what should page
@dataclass(frozen=True)
class Expected:
    """The one notification an incident must cause: `alertname` naming `ranks` (empty: the
    job, a job-level alert) within `deadline` s of the fault."""

    alertname: str
    job_name: str
    ranks: tuple[str, ...]
    severity: str
    deadline: float
    how: str                        # the delay's terms, for the report


def expected_pages(jobs: list[SimJob], timing: Timing, rules: RulesConfig, interval: float,
                   group_wait: Callable[[Mapping[str, str]], float],
                   slack: float | None = None, node_agents: bool = False) -> list[Expected]:
    """The notification each fault must cause, with its documented delay. With
    `node_agents`, a dead rank is paged by its node agent's MindFormersRankExited (no `for:`).

    Delays count from the fault: one scrape to see it, one rule evaluation, the rule's own
    threshold, windows and `for:`, then Alertmanager's `group_wait` for the alert's route.
    `slack` (default: two intervals + 5 s) covers notification sending and a loaded machine.
    """
    slack = 2 * interval + 5.0 if slack is None else slack
    seconds = duration_seconds
    found: list[Expected] = []

    def add(name: str, job: SimJob, ranks: tuple[int, ...], severity: str,
            terms: dict[str, float]) -> None:
        labels = {"alertname": name, "job_name": job.name, "severity": severity}
        terms = {"scrape": interval, "evaluation": interval, **terms,
                 "group_wait": group_wait(labels)}
        how = " + ".join(f"{k} {v:g}s" for k, v in terms.items()) + f" (+ slack {slack:g}s)"
        found.append(Expected(name, job.name, tuple(str(r) for r in ranks), severity,
                              sum(terms.values()) + slack, how))

    for job in jobs:
        if job.fault == "input":
            add("MindFormersStragglerRank", job, job.fault_ranks, "warning",
                {"1m rate window": 60.0, "recording rule": interval,
                 "for": seconds(rules.straggler_for)})
        elif job.fault == "compute":
            add("MindFormersThroughputDrop", job, (), "warning",
                {"rate window": seconds(rules.throughput_window),
                 "for": seconds(rules.throughput_drop_for)})
        elif job.fault == "nan":
            # named once every rank of the job was scraped past the first non-finite step
            add("MindFormersLossNotFinite", job, job.fault_ranks, "critical",
                {"every rank scraped past it": interval + timing.step_seconds})
        elif job.fault == "rank_down" and node_agents:
            add("MindFormersRankExited", job, job.fault_ranks, "critical", {})
        elif job.fault == "rank_down":
            add("MindFormersRankDown", job, job.fault_ranks, "critical",
                {"for": seconds(rules.rank_down_for)})
        elif job.fault == "hang":
            threshold = max(rules.stall_seconds, rules.stall_step_factor * timing.step_seconds)
            add("MindFormersTrainingStalled", job, job.fault_ranks, "critical",
                {"threshold": threshold, "last change scraped": interval,
                 "for": seconds(rules.stall_for)})
        elif job.fault == "cancel" and STATUS_CANCELLED == STATUS_FAILED:
            # without a cancelled status, a cancelled rank reports "failed or stopped"
            add("MindFormersTrainingFailed", job, job.fault_ranks, "warning",
                {"final scrape": interval})
    return found


def quiet_seconds(rules: RulesConfig, interval: float) -> float:
    """How long after the last change nothing else may fire: the longest `for:` of the alerts
    a vanished or finished rank could wrongly raise, plus a scrape and two evaluations."""
    return max(duration_seconds(rules.rank_down_for),
               duration_seconds(rules.ranks_missing_for)) + 3 * interval
