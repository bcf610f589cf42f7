"""One job larger than one Prometheus (issue 36): a small simulated cluster whose every job is
split over 2 real Prometheus shards by target (`hashmod` of the address), each writing to a
real VictoriaMetrics, the global rules on a real vmalert over it, and two real Alertmanagers
clustered on loopback with the shipped routes and inhibitions.

Every scripted fault must page exactly once, naming the right rank, with one Alertmanager
killed as the faults begin; once they paged, one shard is killed: it pages once, as
MindFormersScraperDown naming it and each job's share it held, and its ranks page as nothing
else (not down, not missing, not stalled); it is the shard that scraped most of the ranks
the pages named, whose incidents keep their culprits and do not page again. Then the
simulation stops and nothing pages.
"""
from __future__ import annotations

import re
import time

import pytest
import yaml

from mfotel.alerting.rules import RulesConfig
from mfotel.alerting.sharded import HEARTBEAT
from mfotel.localstack.alerting import shipped_files
from mfotel.localstack.sharded import ShardedStack
from mfotel.simulation.run import SIM_RULES, SimSettings, Simulation, run_simulation
from mfotel.simulation.scenario import Timing
from mfotel.simulation.stack import CountingReceiver, route_setting
from tests.support.waiting import MIN_LOAD_FACTOR, load_factor, wait_for

pytestmark = pytest.mark.slow


def test_two_shards_by_target_page_each_fault_once_and_a_dead_shard_once(tmp_path):
    rules = {**SIM_RULES, "straggler_for": "10s"}
    stretch = load_factor() / MIN_LOAD_FACTOR
    settings = SimSettings(ranks=32, ranks_per_node=4, processes=2, prefix="t", seed=7,
                           timing=Timing(warmup_seconds=60.0), rules=rules, with_stack=True,
                           workdir=tmp_path, shards=2)
    shipped = yaml.safe_load(shipped_files()["alertmanager"])
    planned = Simulation(settings, tmp_path,
                         lambda labels: route_setting(shipped, labels, "group_wait", "30s"))
    settings.late_seconds = (stretch - 1) * planned.observe_seconds
    result = run_simulation(settings)
    by_fault = {job.fault: job for job in result.jobs}
    assert sum(w["export_errors"] for w in result.workers) == 0
    for check in result.checks:   # one notification per incident, the right alert and ranks
        e = check.expected
        assert (check.notifications, check.alertnames, check.ranks) == (
            1, (e.alertname,), e.ranks or ("",)), (e, check)
        assert check.delay is not None and 0 < check.delay <= e.deadline * stretch, \
            (e, check.delay, f"stretched x{stretch:.1f}")
    named = {c.expected.job_name: (c.alertnames, c.ranks) for c in result.checks}
    assert named == {
        "t-main": (("MindFormersStragglerRank",), (str(by_fault["input"].fault_ranks[0]),)),
        "t-compute": (("MindFormersThroughputDrop",), ("",)),
        "t-nan": (("MindFormersLossNotFinite",), (str(by_fault["nan"].fault_ranks[0]),)),
        "t-rank-down": (("MindFormersRankDown",), (str(by_fault["rank_down"].fault_ranks[0]),)),
        "t-hang": (("MindFormersTrainingStalled",), tuple(str(r) for r in range(4, 8)))}
    assert result.unexpected == [] and result.after_stop == [], "false pages"
    # the killed shard: one page naming it, its share of each job, nothing else
    topology = result.topology
    assert topology is not None and topology.alertmanager_killed_at is not None
    assert (topology.notifications, topology.shards_named, topology.others) == (
        1, (topology.killed_shard,), [])
    assert 0 < topology.shard_ranks < 32
    # it scraped ranks the pages named: their incidents kept their culprits (no page again)
    assert topology.held_named >= 1
    shares = dict(re.findall(r"job (t-[a-z-]+): ([0-9.]+)% of its ranks", topology.description))
    # (hashmod of the free ports split the targets: which jobs it held differs run to run)
    assert shares and all(0 < float(s) <= 100 for s in shares.values()), topology.description
    # the ranks it scraped last (its targets also hold ranks that ended before it died)
    [held] = re.findall(r"the ([0-9]+) rank\(s\) it scraped", topology.description)
    assert 0 < int(held) <= topology.shard_ranks, topology.description
    assert topology.delay is not None and topology.delay < 60 * stretch


def _pages(receiver: CountingReceiver, alertname: str) -> list[dict[str, str]]:
    """The firing `alertname` alerts of each notification naming it, one entry a call."""
    return [next(dict(a.labels) for a in n.alerts if a.firing and a.alertname == alertname)
            for n in receiver.notifications_seen
            if any(a.firing and a.alertname == alertname for a in n.alerts)]


def test_the_topology_pages_a_dead_shard_ruler_and_store_once_each(tmp_path):
    """The topology's own faults, without ranks: with Alertmanager 0 of the pair dead from
    the start, a killed shard, then the killed vmalert, then the killed store, each page once
    through the other Alertmanager, and nothing else pages."""
    stretch = load_factor() / MIN_LOAD_FACTOR
    rules = RulesConfig(rank_down_for="3s")
    receiver = CountingReceiver()
    with ShardedStack(tmp_path, tmp_path / "targets" / "*.json", 2, 1.0, rules,
                      receiver) as stack:
        assert stack.store is not None
        store = stack.store
        wait_for(lambda: len(store.query(HEARTBEAT)) == 2, 30 * stretch, 0.5,
                 "both shards' heartbeats in the store")
        stack.kill_alertmanager(0)
        steps = [(stack.kill_scraper, 1, "MindFormersScraperDown", {"shard": "1"}),
                 (stack.kill_ruler, None, "MindFormersGlobalRulerDown",
                  {"mfotel_component": "global-ruler"}),
                 (stack.kill_store, None, "MindFormersStoreDown", {"mfotel_component": "store"})]
        for kill, arg, alertname, labels in steps:
            killed = time.time()
            kill(*([] if arg is None else [arg]))
            [page] = wait_for(lambda name=alertname: _pages(receiver, name), 60 * stretch, 0.5,
                              f"{alertname}'s page")
            assert labels.items() <= page.items(), page
            print(f"{alertname}: {receiver.notifications_seen[-1].received_at - killed:.1f} s")
        time.sleep(12 * stretch)   # a second shard's copy would arrive within group_wait
        firing = [(a.alertname, a.labels.get("shard", a.labels.get("mfotel_component")))
                  for n in receiver.notifications_seen for a in n.alerts if a.firing]
        # (a dead vmalert's alerts resolve in Alertmanager: those calls page nobody)
        calls = [n for n in receiver.notifications_seen if any(a.firing for a in n.alerts)]
        assert len(calls) == 3, firing
        assert sorted(set(firing)) == [("MindFormersGlobalRulerDown", "global-ruler"),
                                       ("MindFormersScraperDown", "1"),
                                       ("MindFormersStoreDown", "store")], firing
