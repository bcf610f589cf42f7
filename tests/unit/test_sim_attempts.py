"""The simulator's attempts, pure parts (mfotel/simulation/attempts.py); a restarted job against
a real Prometheus: tests/e2e/test_goodput_sim_restart.py."""
from __future__ import annotations

from mfotel.simulation.attempts import RESTART, restart_job, resume_step
from mfotel.simulation.scenario import Timing, plan_jobs, rank_specs


def test_a_restarted_job_resumes_after_its_last_checkpoint():
    timing = Timing(checkpoint_steps=8)
    assert [resume_step(last, timing) for last in (7, 8, 12, 16, 20)] == [0, 8, 8, 16, 16]


def test_the_restart_job_follows_the_scenarios_nodes_and_hits_every_rank():
    jobs = plan_jobs(64, 4, prefix="b")
    job = restart_job(jobs, nodes=2, ranks_per_node=4, prefix="b")
    assert (job.name, job.fault, job.first_node, job.world_size) == ("b-restart", RESTART, 16, 8)
    specs = rank_specs([*jobs, job])
    mine = [s for s in specs if s.job == job.name]
    assert [s.role for s in mine] == [RESTART] * 8
    assert sorted({s.node for s in mine}) == [16, 17]
    assert restart_job([], 1, 8).first_node == 0
