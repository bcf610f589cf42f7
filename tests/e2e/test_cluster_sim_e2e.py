"""A small simulated cluster against the real Prometheus and Alertmanager with the shipped
configs, and two real Prometheus shards over the cluster's target files.

The cluster runs 32 ranks (nodes of 4) with every scripted fault and checks, at a real webhook
receiver, that each fault pages exactly once, for the right job and rank, within its documented
delay, and that nothing else pages. The plan and the ranks are tested in
tests/unit/test_cluster_sim.py.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import yaml

from mfotel.cluster.discovery import target_groups, write_target_file
from mfotel.contract import STATUS_FAILED
from mfotel.localstack.alerting import shipped_files
from mfotel.localstack.servers import Prometheus
from mfotel.simulation.run import (
    SIM_RULES,
    SimSettings,
    Simulation,
    run_simulation,
)
from mfotel.simulation.scenario import (
    STATUS_CANCELLED,
    Timing,
)
from mfotel.simulation.stack import route_setting
from tests.support.paths import ROOT
from tests.support.waiting import MIN_LOAD_FACTOR, load_factor, settle, wait_for


@pytest.mark.slow
def test_small_cluster_pages_once_per_fault_for_the_right_rank_and_nothing_else(tmp_path):
    """With a node agent per node, the dead rank is paged by its agent (RankExited, naming the
    rank) instead of RankDown, which the agent's report mutes; nothing else changes. The same
    cluster without node agents (the dead rank paged by RankDown) is the sharded topology's
    (tests/e2e/test_sharded_topology_e2e.py): run twice here, it took 280 s of the suite."""
    # the shortened rules of a simulated run, with a shorter straggler `for` to keep it brief;
    # a minute of warm-up: the throughput rule's baseline, before the compute-bound straggler
    rules = {**SIM_RULES, "straggler_for": "10s"}
    # each documented delay holds on a quiet machine; on a loaded one (other test runs beside
    # this one) the ranks, Prometheus and Alertmanager all run slower: the delays stretch by
    # the load, and the run waits that much longer for a page still missing after its window
    stretch = load_factor() / MIN_LOAD_FACTOR
    settings = SimSettings(ranks=32, ranks_per_node=4, processes=2, prefix="t", seed=7,
                           timing=Timing(warmup_seconds=60.0), rules=rules, with_stack=True,
                           workdir=tmp_path, node_agents=True)
    shipped = yaml.safe_load(shipped_files()["alertmanager"])
    planned = Simulation(settings, tmp_path,
                         lambda labels: route_setting(shipped, labels, "group_wait", "30s"))
    settings.late_seconds = (stretch - 1) * planned.observe_seconds
    result = run_simulation(settings)
    by_fault = {job.fault: job for job in result.jobs}
    assert [w["done"] for w in result.workers] == [16, 16]
    assert sum(w["export_errors"] for w in result.workers) == 0
    for check in result.checks:   # one notification per incident, the right alert and ranks
        e = check.expected
        assert (check.notifications, check.alertnames, check.ranks) == (
            1, (e.alertname,), e.ranks or ("",)), (e, check)
        assert check.delay is not None and 0 < check.delay <= e.deadline * stretch, \
            (e, check.delay, f"stretched x{stretch:.1f}")
    assert result.unexpected == [] and result.after_stop == [], "false pages"
    named = {c.expected.job_name: (c.alertnames, c.ranks) for c in result.checks}
    expected = {
        "t-main": (("MindFormersStragglerRank",), (str(by_fault["input"].fault_ranks[0]),)),
        "t-compute": (("MindFormersThroughputDrop",), ("",)),
        "t-nan": (("MindFormersLossNotFinite",), (str(by_fault["nan"].fault_ranks[0]),)),
        "t-rank-down": (("MindFormersRankExited",), (str(by_fault["rank_down"].fault_ranks[0]),)),
        "t-hang": (("MindFormersTrainingStalled",), tuple(str(r) for r in range(4, 8)))}
    if STATUS_CANCELLED == STATUS_FAILED:
        expected["t-cancel"] = (("MindFormersTrainingFailed",), tuple(map(str, range(4))))
    assert named == expected
    # Alertmanager's API agrees: the alerts it held active and uninhibited are these
    active = {(job, name, rank) for job, name, rank in result.active_in_alertmanager}
    assert active == {(job, name, rank) for job, (names, ranks) in expected.items()
                      for name in names for rank in ranks}
    # the rules page a cascade's first cause only: what a dead rank causes (the job short of a
    # rank, the others stalled waiting for it) never fires, not even in Prometheus (ALERTS:
    # dashboards, a second Alertmanager)
    firing = {(a["alertname"], a["job_name"], a.get("rank", "")) for a in
              result.firing_in_prometheus}
    assert not {name for name, job, _ in firing if job == "t-rank-down"} & {
        "MindFormersRanksMissing", "MindFormersTrainingStalled"}, firing
    dead = str(by_fault["rank_down"].fault_ranks[0])
    # the agent reports the rank: RankDown muted at its source (the rule)
    assert ("MindFormersRankExited", "t-rank-down", dead) in firing
    assert ("MindFormersRankDown", "t-rank-down", dead) not in firing
    nan_rank = by_fault["nan"].fault_ranks[0]
    assert {("MindFormersLossNotFiniteFollower", "t-nan", str(r)) for r in range(4)
            if r != nan_rank} <= firing
    assert not any(job == "t-complete" for _, job, _ in firing)
    assert result.prometheus["prometheus_tsdb_head_series"] > 32 * 41
    assert result.checked   # (result.ok also holds the delays to the quiet machine's)


@pytest.mark.slow
def test_shards_split_the_cluster_by_job_never_a_job_by_rank(tmp_path):
    """Two real Prometheus servers with examples/prometheus/shard.yml (modulus 2): every job's
    targets are discovered by exactly one shard, and together they discover every job."""
    jobs = {f"job-{i}": [f"10.0.{i}.{n}" for n in range(1, 3)] for i in range(8)}
    for job, hosts in jobs.items():
        write_target_file(tmp_path / "targets" / f"{job}.json", target_groups(hosts, 8, 9464))
    shipped = yaml.safe_load((ROOT / "examples" / "prometheus" / "shard.yml").read_text())
    # Prometheus' hashmod: the last 8 bytes of the md5 of the file's path, big-endian, mod 2
    # (the paths hold tmp_path: now and then every job hashes to one shard)
    expected = {str(n): {job for job in jobs if _hashmod(str(tmp_path / "targets" / f"{job}.json"),
                                                         2) == n} for n in range(2)}
    found: dict[str, set[str]] = {}
    for shard in ("0", "1"):
        # the ranks' job alone (the example also scrapes Prometheus itself)
        [job] = [j for j in shipped["scrape_configs"] if j["job_name"] == "mindformers"]
        config = dict(shipped, rule_files=[], alerting={"alertmanagers": []},
                      scrape_configs=[job])
        job["file_sd_configs"][0]["files"] = [str(tmp_path / "targets" / "*.json")]
        job["relabel_configs"][0]["modulus"] = 2
        job["relabel_configs"][1]["regex"] = shard
        with Prometheus(yaml.safe_dump(config), workdir=tmp_path / f"shard-{shard}") as prom:
            # file_sd reads the files at start: discovered at once, nominally
            want = 16 * len(expected[shard])

            def discovered(prom: Prometheus = prom, want: int = want) -> tuple | None:
                targets = prom.targets()   # (a tuple: a shard that gets no job holds none)
                return (targets,) if len(targets) == want else None
            [targets] = wait_for(discovered, settle(), 0.2, f"shard {shard}'s {want} targets")
        files = [t["discoveredLabels"]["__meta_filepath"] for t in targets]
        assert all(files.count(f) == 16 for f in files), "a job's 16 ranks are all on one shard"
        found[shard] = {Path(f).stem for f in files}
    assert found == expected
    assert found["0"] | found["1"] == set(jobs) and not found["0"] & found["1"]


def _hashmod(value: str, modulus: int) -> int:
    return int.from_bytes(hashlib.md5(value.encode()).digest()[8:], "big") % modulus
