"""Attempts: a simulated job killed and restarted with the same run id (goodput's restarts).

The `restart` fault, opt-in (`restart_job`, `only_jobs`): at the fault time every rank of the
job is SIGKILLed (its endpoint closes, no final status, its time account left as last
scraped); `Timing.restart_pause_seconds` later each rank's next process starts on the same
port with the same run id (a configured run: `run_id` and `attempt` 1, then 2, on
rank_info; a new process start, a time account from 0, status initialising),
spends `Timing.startup_seconds` before its first step and resumes after the job's last
checkpoint (every `Timing.checkpoint_steps` steps): the steps since it are done again.

    sim = Simulation(settings, workdir, group_wait)
    only_jobs(sim, [restart_job([], nodes=2, ranks_per_node=4)])
    sim.start(); sim.go()
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .scenario import JOB_SUFFIX, SimJob, Timing, rank_specs

if TYPE_CHECKING:   # run.py imports the worker's side; this module only needs its type
    from .run import Simulation

RESTART = "restart"


def restart_job(jobs: list[SimJob], nodes: int, ranks_per_node: int,
                prefix: str = "sim") -> SimJob:
    """A job of `nodes` nodes after `jobs`' nodes that restarts (every rank hit)."""
    first = max((job.first_node + job.nodes for job in jobs), default=0)
    return SimJob(f"{prefix}-{JOB_SUFFIX[RESTART]}", RESTART, first, nodes, ranks_per_node,
                  tuple(range(nodes * ranks_per_node)))


def resume_step(last: int, timing: Timing) -> int:
    """The step a job killed after step `last` resumes after: its last checkpoint's."""
    return last - last % timing.checkpoint_steps


def only_jobs(sim: Simulation, jobs: list[SimJob]) -> None:
    """Make `sim` (not started yet) run `jobs` instead of the scenario's; no page expected
    (a killed job's RankDown pages, which the goodput checks do not count)."""
    sim.jobs = jobs
    sim.specs = rank_specs(jobs, sim.settings.seed)
    sim.expected = []
