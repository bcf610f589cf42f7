"""The simulated restart the goodput tests watch (tests/e2e/test_goodput_sim_restart.py with
one Prometheus, tests/e2e/test_goodput_sharded.py with the sharded topology): one job of 8
simulated ranks (2 nodes), a step a second, a checkpoint every 12 steps, every rank SIGKILLed
20.5 s into training and its next process started 4 s later on the same port with the same run
id, 2 s of start-up, resuming after the last checkpoint."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mfotel.simulation.attempts import only_jobs, restart_job, resume_step
from mfotel.simulation.run import SimSettings, Simulation
from mfotel.simulation.scenario import SimJob, Timing

TIMING = Timing(step_seconds=1.0, startup_seconds=2.0, warmup_seconds=20.5,
                linger_seconds=3.0, checkpoint_steps=12, restart_pause_seconds=4.0)
#: Seconds of the second attempt's steps before the checks: it redoes steps 13-20 in the first
#: 8 and is past them when the goodput records (every 5 s in the tests) are read.
AFTER_RESTART = 16.0
RANKS = 8
#: The scrape interval of the tests' Prometheus (the simulation's interval).
SCRAPE_SECONDS = 1.0
#: The most a running job's goodput account leaves unaccounted: the step in progress and the
#: age of the ranks' last scrape, one interval, two where a scrape failed under load.
UNACCOUNTED_MOST = TIMING.step_seconds + 2 * SCRAPE_SECONDS + 0.5


@dataclass
class RestartRun:
    """The simulation (its targets in `workdir`/targets), its job and, once started, its
    clock."""

    sim: Simulation
    job: SimJob
    start: float = 0.0

    @property
    def restarted(self) -> float:
        """When the second attempt's processes start (unix time)."""
        return self.start + TIMING.fault_at + TIMING.restart_pause_seconds

    @property
    def run(self) -> str:
        """The matchers of the run's goodput records (its id as with `run.id`)."""
        return f'job_name="{self.job.name}", run_id="{self.job.name}-run"'

    @property
    def ranks(self) -> str:
        """A selector of the job's rank series."""
        return f'{{job_name="{self.job.name}"}}'

    def go(self) -> None:
        self.sim.start()
        self.start = self.sim.go()


def restart_run(workdir: Path, prefix: str) -> RestartRun:
    """The restarted job alone (32 ranks for the scenario's plan, which only_jobs replaces);
    the Simulation makes the targets folder, so a Prometheus started next watches it."""
    settings = SimSettings(ranks=32, ranks_per_node=4, prefix=prefix, timing=TIMING,
                           interval=SCRAPE_SECONDS, workdir=workdir)
    sim = Simulation(settings, workdir, lambda labels: 0.0)
    job = restart_job([], nodes=2, ranks_per_node=4, prefix=prefix)
    only_jobs(sim, [job])
    return RestartRun(sim, job)


def truth(last_steps: list[float], last_events: list[float], restarted: float
          ) -> tuple[float, float]:
    """What the records must show, from each rank's last scrape before the kill (its step and
    its last event): the steps redone (those at or below the high-water mark after the
    checkpoint attempt 2 resumes after) and the mean downtime, each checked against the script."""
    assert len(last_steps) == len(last_events) == RANKS, (last_steps, last_events)
    high_water = min(last_steps)
    last = int(TIMING.warmup_seconds // TIMING.step_seconds)   # the kill came after it
    checkpoint = resume_step(last, TIMING)
    assert checkpoint == 12 and 0 < high_water <= last, last_steps
    # a rank's last scrape before the kill may come several steps (scrape intervals) before
    # its last step on a loaded machine (seen: 16, and once 10, of 20): what no scrape showed,
    # no record can know was done, so it is not redone (the steps after the checkpoint are
    # then all goodput, as far as monitoring can tell)
    redone = max(high_water - checkpoint, 0)
    downtime = sum(restarted - event for event in last_events) / RANKS
    # from each rank's last scraped event: up to a step and a half before the kill, more for a
    # rank whose last scrapes before it were missed
    late = (last - high_water + 1.5) * TIMING.step_seconds
    assert TIMING.restart_pause_seconds < downtime < TIMING.restart_pause_seconds + late
    return redone, downtime
