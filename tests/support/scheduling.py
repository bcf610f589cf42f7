"""How `pytest -n N --dist loadscope` hands the suite to its workers: longest work first, the
waiting kept beside the computing.

xdist's loadscope keeps a module's tests on one worker (its module-scoped servers and training
runs start once) and, by default, queues the modules with the most tests first. Here the
longest tests are the whole-job ones (`WHOLE_JOB`): each runs a multi-rank job, Prometheus and
Alertmanager for one to four minutes, and mostly waits (0.05-0.2 of a core). The rest of the
suite computes. Measured on 2 cores with 6 workers: all six started on whole-job tests, the
cores were 78% busy for the first 3.5 minutes, then saturated by the rest. This scheduler

- keeps the collection order (tests/conftest.py sorts the slow end-to-end tests first), so
  the long work starts at once and the short modules fill the gaps;
- schedules the tests of the modules in `ONE_BY_ONE` one by one: each starts its own job,
  servers and ports, or its own promtool run (no module-scoped fixture), so they can run on
  different workers at once;
- runs at most `workers - COMPUTING_WORKERS` whole-job tests at once (and at most
  `WHOLE_JOBS_PER_CORE` a core, one per `GIB_PER_WHOLE_JOB` of available memory), so that the
  other workers keep the cores busy from the start;
- queues short work behind a long test, never another long one. An xdist worker runs a test
  only once it holds the next one, so the scheduler queues one unit ahead; a whole-job test
  queued behind another waited up to 4 minutes while other workers were free.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from xdist.scheduler import LoadScopeScheduling

#: The whole-job tests: a multi-rank job and its Prometheus and Alertmanager each, 1-4 minutes.
WHOLE_JOB = frozenset({
    "tests/e2e/test_cascades_msrun.py",
    "tests/e2e/test_cluster_sim_e2e.py",
    "tests/e2e/test_goodput_restart_msrun.py",
    "tests/e2e/test_goodput_sharded.py",
    "tests/e2e/test_job_truth_msrun.py",
    "tests/e2e/test_node_agent_msrun.py",
    "tests/e2e/test_sharded_topology_e2e.py",
    "tests/e2e/test_stacks_msrun.py",
})
#: Seconds a whole-job test took in a full run (2 cores, 12 workers, 2026-12-06), by test
#: function: the longest start first (tests/conftest.py), since one started late is the
#: suite's tail (a 200 s test started at minute 9.5 of a 12-minute run). Others: DEFAULT_SECONDS.
EXPECTED_SECONDS = {
    "test_a_hang_past_a_long_time_out_pages_once_before_and_nothing_after": 219,
    "test_two_shards_by_target_page_each_fault_once_and_a_dead_shard_once": 390,
    "test_the_topology_pages_a_dead_shard_ruler_and_store_once_each": 102,
    "test_small_cluster_pages_once_per_fault_for_the_right_rank_and_nothing_else": 264,
    "test_a_stopped_rank_past_a_long_time_out_pages_once_and_resumes": 182,
    "test_a_hang_with_mindsporess_time_out_pages_the_hung_rank_once_with_its_stacks": 223,
    "test_compute_bound_straggler_blames_no_rank_and_the_job_slows": 172,
    "test_a_stopped_rank_is_named_as_stopped_when_the_job_times_out": 173,
    "test_an_exception_pages_its_rank_not_the_ranks_killed_after_it": 143,
    "test_dead_rank_is_paged_by_name_and_the_stall_it_causes_is_not": 153,
    "test_nan_pages_once_naming_the_rank_it_started_on": 112,
    "test_the_nan_origin_stays_over_the_jobs_end_and_a_finishing_job_misses_nobody": 160,
    "test_a_clean_finish_with_long_end_work_pages_nobody": 146,
}
DEFAULT_SECONDS = 100


def expected_seconds(nodeid: str) -> float:
    """EXPECTED_SECONDS of the test `nodeid` (its parameters aside), else DEFAULT_SECONDS."""
    return EXPECTED_SECONDS.get(nodeid.rsplit("::", 1)[-1].split("[", 1)[0], DEFAULT_SECONDS)


#: Modules whose tests share no module-scoped fixture, each test a job of its own: the
#: whole-job tests, and the promtool runs of every rule setting (10-15 CPU-seconds each; as one
#: module on one worker they were a two-minute tail of the suite while the others sat idle).
ONE_BY_ONE = WHOLE_JOB | {"tests/unit/test_rule_tests.py"}
#: Workers kept off the whole-job tests: on 2 cores, the computing share of the suite (its
#: tests wait on subprocesses and servers too: with 2 beside 8 whole-job tests the cores were
#: 82% busy and the rest of the suite ran 90 s past the last whole-job test).
COMPUTING_WORKERS = 4
#: Whole-job tests at once per core, at most: each starts 3-5 processes importing MindSpore
#: at its start (6 and 8 at once on 2 cores ran green; 10 workers each starting one
#: overloaded the machine: Prometheus queries over 5 s, false pages of the 32-rank
#: simulation). Together they need ~4,000 s of waiting: at 6 at once that alone was 11
#: minutes of the suite.
WHOLE_JOBS_PER_CORE = 4
#: GiB of available memory per whole-job test at once (with 10 workers and 6 of them, the
#: machine used at most 8.3 GB; a process that imported MindSpore holds ~0.42 GB, and a job of
#: 2 ranks runs four such processes).
GIB_PER_WHOLE_JOB = 2


def available_gib() -> int:
    """MemAvailable of /proc/meminfo, in GiB (a large number where it cannot be read)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // (1 << 20)
    except (OSError, ValueError, IndexError):
        pass
    return 1 << 20


def whole_job_cap(workers: int) -> int:
    """How many whole-job tests may run at once with `workers` workers, here."""
    return max(1, min(workers - COMPUTING_WORKERS, WHOLE_JOBS_PER_CORE * (os.cpu_count() or 1),
                      available_gib() // GIB_PER_WHOLE_JOB))


def _module(scope: str) -> str:
    return scope.split("::", 1)[0]


class LongestFirstScheduling(LoadScopeScheduling):
    """loadscope in collection order, with the modules of `ONE_BY_ONE` split per test, at most
    `whole_job_cap()` whole-job tests at once, and short work queued behind long."""

    def __init__(self, config: Any, log: Any = None) -> None:
        super().__init__(config, log)
        config.option.loadscopereorder = False

    def _split_scope(self, nodeid: str) -> str:
        if _module(nodeid) in ONE_BY_ONE:
            return nodeid
        return super()._split_scope(nodeid)

    def _reschedule(self, node: Any) -> None:
        # a worker runs a test only once it holds the next one: keep exactly one queued
        if not node.shutting_down and self.workqueue \
                and self._pending_of(self.assigned_work[node]) > 1:
            return
        super()._reschedule(node)

    def _whole_jobs_pending(self, node: Any | None = None) -> int:
        """Whole-job tests assigned and not finished (on `node`, or on every worker)."""
        nodes = [node] if node is not None else list(self.assigned_work)
        return sum(1 for each in nodes for scope, unit in self.assigned_work.get(each, {}).items()
                   if _module(scope) in WHOLE_JOB and not all(unit.values()))

    def _assign_work_unit(self, node: Any) -> None:
        """The first unit of the queue, unless it is a whole-job test and either `node` already
        holds one (it would wait behind it) or the cap is reached: then another unit, the last
        of the queue (the shortest kind, unit tests) behind a whole-job test on `node` (the
        first other unit there, a slow module, kept the node from its next whole-job test for
        minutes after its first ended: 200 s with every whole-job place free), else the
        first other unit."""
        cap = whole_job_cap(len(self.nodes))
        holds_one = self._whole_jobs_pending(node)
        if holds_one or self._whole_jobs_pending() >= cap:
            others = (scope for scope in (reversed(self.workqueue) if holds_one
                                          else self.workqueue)
                      if _module(scope) not in WHOLE_JOB)
            other = next(others, None)
            if other is not None:
                self.workqueue.move_to_end(other, last=False)
        super()._assign_work_unit(node)
