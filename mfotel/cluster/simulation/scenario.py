"""The simulated cluster, pure: jobs and their faults, the training model, the expected pages.

A simulation of N ranks is one large healthy job with a straggler in it, beside five small
jobs, one per fault, so that Alertmanager's shipped inhibition (a job's critical alert mutes
its warnings) cannot hide one fault behind another:

| job | nodes | at the fault time | expected notification |
|---|---|---|---|
| `<prefix>-main` | the rest | one rank's step time x1.8 | `MindFormersStragglerRank` for that rank |
| `<prefix>-nan` | 1 | one rank's loss (and grad norm) NaN from then on | `MindFormersLossNotFinite` for that rank |
| `<prefix>-rank-down` | 1 | one rank's process dies (its port closes) | `MindFormersRankDown` for that rank |
| `<prefix>-node-stall` | 2 | every rank of its second node stops stepping, endpoints up | `MindFormersTrainingStalled` for those ranks |
| `<prefix>-complete` | 1 | the last step: status completed, final scrape, exit | nothing |
| `<prefix>-cancel` | 1 | cancelled (SIGTERM): final status, final scrape, exit | nothing (status cancelled), else the status 3 alert |

Ranks of a job step in lock step (data parallel): the job's step period is the slowest rank's
compute plus a synchronisation share. The straggler's timed step is its own compute (the wait
of the others falls outside their timed step), so its own step time stands out while the job
as a whole slows down (x1.64, above the throughput-drop threshold of 0.5).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Callable, Mapping

from ... import contract
from ...alerting.rules import RulesConfig
from ...contract import STATUS_FAILED
from ...alerting.rules import duration_seconds

FAULT_JOBS: tuple[tuple[str, int], ...] = (   # (fault, nodes); the main job takes the rest
    ("nan", 1), ("rank_down", 1), ("node_stall", 2), ("complete", 1), ("cancel", 1))
JOB_SUFFIX = {"straggler": "main", "nan": "nan", "rank_down": "rank-down",
              "node_stall": "node-stall", "complete": "complete", "cancel": "cancel"}
#: Status a cancelled rank reports: the contract's own "cancelled" value when it has one.
STATUS_CANCELLED: int = getattr(contract, "STATUS_CANCELLED", STATUS_FAILED)


@dataclass(frozen=True)
class SimJob:
    name: str
    fault: str                      # straggler (main job), nan, rank_down, node_stall, ...
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
    compute_share: float = 0.8      # of the period, the timed step; the rest is synchronisation
    straggler_factor: float = 1.8   # the straggler's timed step over a healthy rank's
    startup_seconds: float = 5.0    # status 0 (graph compilation) before the first step
    warmup_seconds: float = 60.0    # healthy running before the faults
    linger_seconds: float = 30.0    # completed / cancelled ranks wait this long for a scrape
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
    for fault, nodes in (("straggler", main_nodes), *FAULT_JOBS):
        size = nodes * ranks_per_node
        if fault in ("complete", "cancel"):
            hit: tuple[int, ...] = tuple(range(size))
        elif fault == "node_stall":
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
    """When the job's steps end: lock step, period = slowest compute + synchronisation."""

    start: float                    # unix time the first step begins
    timing: Timing
    slow_from: float = math.inf     # unix time the straggler slows the job down
    _ends: list[float] = field(default_factory=list)

    def period(self, at: float) -> float:
        t = self.timing
        if at >= self.slow_from:
            return t.step_seconds * (t.compute_share * t.straggler_factor + 1 - t.compute_share)
        return t.step_seconds

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


# ---------------------------------------------------------------- what should page
@dataclass(frozen=True)
class Expected:
    """A notification a fault must cause: for `rank` (None: job-level) within `deadline` s."""

    alertname: str
    job_name: str
    rank: str | None
    severity: str
    deadline: float
    how: str                        # the delay's terms, for the report

    @property
    def key(self) -> tuple[str, str, str | None]:
        return (self.alertname, self.job_name, self.rank)


def expected_pages(jobs: list[SimJob], timing: Timing, rules: RulesConfig, interval: float,
                   group_wait: Callable[[Mapping[str, str]], float],
                   slack: float | None = None) -> list[Expected]:
    """The notifications the faults of `jobs` must cause, each with its documented delay.

    Delays count from the fault: one scrape to see it, one rule evaluation, the rule's own
    threshold and `for:`, then Alertmanager's `group_wait` for the alert's route. `slack`
    (default: two intervals + 5 s) covers notification sending and a loaded machine.
    """
    slack = 2 * interval + 5.0 if slack is None else slack
    seconds = duration_seconds
    found: list[Expected] = []

    def add(name: str, job: SimJob, rank: int | None, severity: str, terms: dict[str, float]) -> None:
        labels = {"alertname": name, "job_name": job.name, "severity": severity}
        terms = {"scrape": interval, "evaluation": interval, **terms,
                 "group_wait": group_wait(labels)}
        how = " + ".join(f"{k} {v:g}s" for k, v in terms.items()) + f" (+ slack {slack:g}s)"
        found.append(Expected(name, job.name, None if rank is None else str(rank), severity,
                              sum(terms.values()) + slack, how))

    for job in jobs:
        for rank in job.fault_ranks:
            if job.fault == "nan":
                add("MindFormersLossNotFinite", job, rank, "critical", {})
            elif job.fault == "rank_down":
                add("MindFormersRankDown", job, rank, "critical",
                    {"for": seconds(rules.rank_down_for)})
            elif job.fault == "node_stall":
                threshold = max(rules.stall_seconds, rules.stall_step_factor * timing.step_seconds)
                add("MindFormersTrainingStalled", job, rank, "critical",
                    {"threshold": threshold, "last change scraped": interval,
                     "for": seconds(rules.stall_for)})
            elif job.fault == "straggler":
                add("MindFormersStragglerRank", job, rank, "warning",
                    {"1m mean window": 60.0, "recording rule": interval,
                     "for": seconds(rules.straggler_for)})
            elif job.fault == "cancel" and STATUS_CANCELLED == STATUS_FAILED:
                # without a cancelled status, a cancelled rank reports "failed or stopped"
                add("MindFormersTrainingFailed", job, rank, "warning", {"final scrape": interval})
    return found


def quiet_seconds(rules: RulesConfig, interval: float) -> float:
    """How long after the last change nothing else may fire: the longest `for:` of the alerts
    a vanished or finished rank could wrongly raise, plus a scrape and two evaluations."""
    return max(duration_seconds(rules.rank_down_for),
               duration_seconds(rules.ranks_missing_for)) + 3 * interval
