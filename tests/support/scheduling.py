"""How `pytest -n N --dist loadscope` hands the suite to its workers: longest work first.

xdist's loadscope keeps a module's tests on one worker (its module-scoped servers and training
runs start once) and, by default, queues the modules with the most tests first. Here the
longest tests are the few end-to-end ones that each run a whole multi-rank job (one to four
minutes apiece), so that order left them for last, in one module on one worker: a 20-minute
tail while the other workers sat idle. This scheduler

- keeps the collection order (tests/conftest.py sorts the slow end-to-end tests first), so
  the long work starts at once and the short modules fill the gaps;
- schedules the tests of the modules in `ONE_BY_ONE` one by one: each starts its own job,
  servers and ports, or its own promtool run (no module-scoped fixture), so they can run on
  different workers at once;
- gives a worker its next unit only when it is down to its last queued test (xdist's default
  queues up to three ahead, which ties several long tests to one worker).
"""
from __future__ import annotations

from typing import Any

from xdist.scheduler import LoadScopeScheduling

#: Modules whose tests share no module-scoped fixture, each test a job of its own: the
#: whole-job tests, and the promtool runs of every rule setting (25-60 s of CPU each; as one
#: module on one worker they were a two-minute tail of the suite while the others sat idle).
ONE_BY_ONE = frozenset({
    "tests/e2e/test_cluster_sim_e2e.py",
    "tests/e2e/test_job_truth_msrun.py",
    "tests/e2e/test_node_agent_msrun.py",
    "tests/unit/test_rule_tests.py",
})


class LongestFirstScheduling(LoadScopeScheduling):
    """loadscope in collection order, with the modules of `ONE_BY_ONE` split per test."""

    def __init__(self, config: Any, log: Any = None) -> None:
        super().__init__(config, log)
        config.option.loadscopereorder = False

    def _split_scope(self, nodeid: str) -> str:
        if nodeid.split("::", 1)[0] in ONE_BY_ONE:
            return nodeid
        return super()._split_scope(nodeid)

    def _reschedule(self, node: Any) -> None:
        # a worker runs a test only once it holds the next one: keep exactly one queued
        if not node.shutting_down and self.workqueue \
                and self._pending_of(self.assigned_work[node]) > 1:
            return
        super()._reschedule(node)
