"""The cluster simulator (`mfotel simulate`): its plan, its ranks, and a small simulated cluster
against the real Prometheus and Alertmanager with the shipped configs.

The slow test runs 32 ranks (nodes of 4) with every scripted fault and checks, at a real webhook
receiver, that each fault pages exactly once, for the right job and rank, within its documented
delay, and that nothing else pages.
"""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import samples, scrape
from mfotel.alerting.rules import RulesConfig
from mfotel.cluster.simulation.ranks import SimRank
from mfotel.cluster.simulation.run import (SIM_RULES, SimSettings, Simulation, rank_config,
                                           run_simulation)
from mfotel.cluster.simulation.scenario import (STATUS_CANCELLED, JobClock, RankSpec, Timing,
                                                expected_pages, plan_jobs)
from mfotel.cluster.simulation.stack import route_setting
from mfotel.config import parse_config
from mfotel.contract import STATUS_FAILED
from mfotel.cluster.discovery import target_groups, write_target_file
from mfotel.demo.alerting import operator_alertmanager_config as alertmanager_config, shipped_files
from mfotel.demo.stack import Prometheus, find_binary, free_port

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def shipped_am() -> dict:
    return yaml.safe_load(shipped_files()["alertmanager"])


# ---------------------------------------------------------------- the plan
def test_each_fault_gets_its_own_job_and_the_main_job_takes_the_rest():
    jobs = {job.name: job for job in plan_jobs(1024, 8, prefix="big", seed=3)}
    assert {name: (job.fault, job.world_size) for name, job in jobs.items()} == {
        "big-main": ("straggler", 976), "big-nan": ("nan", 8), "big-rank-down": ("rank_down", 8),
        "big-node-stall": ("node_stall", 16), "big-complete": ("complete", 8),
        "big-cancel": ("cancel", 8)}
    nodes = [n for job in jobs.values() for n in range(job.first_node, job.first_node + job.nodes)]
    assert sorted(nodes) == list(range(128)), "every node belongs to exactly one job"
    assert jobs["big-node-stall"].fault_ranks == tuple(range(8, 16)), "its whole second node"
    assert jobs["big-complete"].fault_ranks == tuple(range(8))
    [straggler] = jobs["big-main"].fault_ranks
    assert 0 <= straggler < 976
    assert plan_jobs(1024, 8, prefix="big", seed=3) == list(jobs.values()), "seeded"


@pytest.mark.parametrize("ranks, per_node, message", [
    (40, 8, "use at least 56 ranks"),
    (30, 4, "not a multiple of --ranks-per-node 4"),
])
def test_a_cluster_too_small_for_the_faults_is_refused_with_the_fix(ranks, per_node, message):
    with pytest.raises(ValueError, match=message):
        plan_jobs(ranks, per_node)
    done = subprocess.run([sys.executable, "-m", "mfotel", "simulate", "--ranks", str(ranks),
                           "--ranks-per-node", str(per_node)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and message in done.stderr


def test_a_straggler_slows_its_lock_step_job_but_stays_in_step():
    timing = Timing(step_seconds=1.0)
    clock = JobClock(start=100.0, timing=timing, slow_from=110.0)
    assert [clock.step_end(k) for k in (1, 10)] == [101.0, 110.0]
    # after the fault: slowest compute (0.8 s x 1.8) + the synchronisation share (0.2 s)
    assert clock.step_end(11) - clock.step_end(10) == pytest.approx(1.64)
    assert clock.last_step_before(110.5) == 10


def test_targets_files_list_every_rank_once_per_job(tmp_path):
    loopback = Simulation(SimSettings(ranks=64, port=20000), tmp_path / "a", lambda labels: 0.0)
    one_host = Simulation(SimSettings(ranks=64, port=20000, host="0.0.0.0", advertise="sim-host"),
                          tmp_path / "b", lambda labels: 0.0)
    for sim in (loopback, one_host):
        sim.workdir.mkdir(parents=True, exist_ok=True)
        sim.write_targets()
    files = {path.stem: json.loads(path.read_text())
             for path in (tmp_path / "a" / "targets").glob("*.json")}
    assert set(files) == {job.name for job in loopback.jobs}
    # one group per node, node k on 127.77.0.1 + k, ports 20000..20007 as on a real node
    assert files["sim-nan"] == target_groups(["127.77.0.3"], 8, 20000)
    assert sum(len(g["targets"]) for f in files.values() for g in f) == 64
    # one address: node k's ranks on ports 20000 + 8k .. 20000 + 8k + 7
    nan = json.loads((tmp_path / "b" / "targets" / "sim-nan.json").read_text())
    assert nan == [{"targets": [f"sim-host:{20016 + i}" for i in range(8)], "labels": {}}]
    every = [t for path in (tmp_path / "b" / "targets").glob("*.json")
             for g in json.loads(path.read_text()) for t in g["targets"]]
    assert len(every) == len(set(every)) == 64


# ---------------------------------------------------------------- what must page, and when
def test_the_shipped_routes_page_criticals_no_later_than_warnings(shipped_am):
    critical = {"alertname": "MindFormersLossNotFinite", "severity": "critical"}
    warning = {"alertname": "MindFormersStragglerRank", "severity": "warning"}
    assert route_setting(shipped_am, critical, "group_wait", "30s") <= \
        route_setting(shipped_am, warning, "group_wait", "30s")


def test_route_settings_match_regex_negation_and_inherit():
    config = {"route": {"group_wait": "30s", "routes": [
        {"matchers": ['team != "ml"'], "group_wait": "1m"},
        {"matchers": ['alertname =~ "MindFormers(Loss|GradNorm)NotFinite"'], "group_wait": "0s"},
        {"matchers": ['severity="critical"'], "routes": [{"matchers": ['rank = "0"']}]},
    ]}}
    wait = lambda **labels: route_setting(config, {"team": "ml", **labels}, "group_wait", "30s")  # noqa: E731
    assert wait(alertname="MindFormersLossNotFinite") == 0
    assert wait(alertname="MindFormersLossSpike", severity="critical", rank="0") == 30  # inherited
    assert route_setting(config, {}, "group_wait", "30s") == 60   # team != "ml"


def test_each_fault_expects_one_alert_for_the_hit_ranks_with_its_documented_delay(shipped_am):
    jobs = plan_jobs(64, 8, prefix="p")
    rules = RulesConfig(**SIM_RULES)
    group_wait = lambda labels: route_setting(shipped_am, labels, "group_wait", "30s")  # noqa: E731
    expected = {(e.alertname, e.job_name, e.rank): e
                for e in expected_pages(jobs, Timing(), rules, 5.0, group_wait, slack=0)}
    by_job = {job.fault: job for job in jobs}
    nan_rank = str(by_job["nan"].fault_ranks[0])
    nan = expected["MindFormersLossNotFinite", "p-nan", nan_rank]
    gw_critical = group_wait({"severity": "critical", "alertname": "MindFormersLossNotFinite",
                              "job_name": "p-nan"})
    assert nan.deadline == 5 + 5 + gw_critical       # scrape + evaluation, no `for`
    stalled = [e for e in expected.values() if e.alertname == "MindFormersTrainingStalled"]
    assert sorted(int(e.rank) for e in stalled) == list(range(8, 16))
    assert stalled[0].deadline == 30 + 5 + 5 + 5 + 10 + group_wait(
        {"severity": "critical", "alertname": "MindFormersTrainingStalled", "job_name": "p-node-stall"})
    names = {e.alertname for e in expected.values()}
    assert "MindFormersRanksMissing" not in names, "inhibited by RankDown of the same job"
    assert ("MindFormersTrainingFailed" in names) == (STATUS_CANCELLED == STATUS_FAILED)
    assert not any(e.job_name == "p-complete" for e in expected.values())


def test_only_the_webhook_urls_of_the_shipped_alertmanager_config_change(shipped_am):
    changed = yaml.safe_load(alertmanager_config(yaml.safe_dump(shipped_am), "http://x/alerts"))
    urls = [w["url"] for r in changed["receivers"] for w in r.get("webhook_configs", [])]
    assert urls and set(urls) == {"http://x/alerts"}
    for receiver in changed["receivers"]:
        for webhook in receiver.get("webhook_configs", []):
            webhook["url"] = None
    for receiver in shipped_am["receivers"]:
        for webhook in receiver.get("webhook_configs", []):
            webhook["url"] = None
    assert changed == shipped_am


# ---------------------------------------------------------------- a simulated rank
def _documented_counts() -> dict[str, int]:
    """The series-per-rank table of docs/multirank.md, which a real callback run pins
    (tests/test_multirank_callback.py)."""
    text = (ROOT / "docs" / "multirank.md").read_text()
    rows = re.findall(r"^\| `(full|health)`[^|]*\| ([^|]+) \| (\d+) \|", text, re.M)
    return {f"{level} {who.strip()}": int(n) for level, who, n in rows}


def _served_series(cardinality: str, rank: int) -> dict[tuple, float]:
    settings = SimSettings(cardinality=cardinality)
    cfg = parse_config({**rank_config(settings),
                        "prometheus": {"host": "127.0.0.1", "port": free_port()}})
    spec = RankSpec("sim-main", rank, local_rank=0, node=0, node_rank=0, world_size=16,
                    ranks_per_node=8, role="healthy", skew=0.0)
    sim_rank = SimRank(spec, cfg, "sim-node-000", seed=0)
    try:
        for step in (1, 2):
            sim_rank.step(step, 1000.0 + step, 0.8, loss=3.0, grad_norm=1.0, learning_rate=1e-4,
                          total_steps=100, batch_size=4, seq_length=4096)
        return samples(scrape(sim_rank.telemetry.endpoint.url))
    finally:
        sim_rank.shutdown()


def test_a_simulated_rank_serves_what_a_real_rank_serves():
    full, metric_rank, other_rank = (_served_series("full", 0), _served_series("health", 0),
                                     _served_series("health", 1))
    assert _documented_counts() == {"full every rank": len(full),
                                    "health metric ranks": len(metric_rank),
                                    "health other ranks": len(other_rank)}
    values = {name: v for (name, labels), v in full.items()
              if ("rank", "0") in labels and ("job_name", "sim-main") in labels}
    assert values["mindformers_train_step"] == 2 and values["mindformers_train_steps_total"] == 2
    assert values["mindformers_train_status"] == 1 and values["mindformers_train_loss"] == 3.0
    assert values["mindformers_train_samples_total"] == 8
    assert values["mindformers_train_tokens_total"] == 8 * 4096
    assert values["mindformers_train_throughput_samples_per_second"] == 4.0   # 4 samples in 1 s
    assert values["mindformers_train_step_duration_seconds_count"] == 2
    assert math.isclose(values["mindformers_train_step_duration_seconds_sum"], 1.6)
    info = [dict(labels) for (name, labels) in full if name == "mindformers_train_rank_info"]
    assert info == [{"job_name": "sim-main", "rank": "0", "local_rank": "0", "node": "sim-node-000",
                     "host": "sim-node-000", "device_id": "0", "world_size": "16"}]


def test_a_nan_step_is_exposed_as_the_callback_does():
    cfg = parse_config({**rank_config(SimSettings()),
                        "prometheus": {"host": "127.0.0.1", "port": free_port()}})
    spec = RankSpec("sim-nan", rank=3, local_rank=0, node=0, node_rank=0, world_size=8,
                    ranks_per_node=8, role="nan", skew=0.0)
    sim_rank = SimRank(spec, cfg, "n0", seed=0)
    try:
        sim_rank.step(1, 1001.0, 0.8, 3.0, 1.0, 1e-4, 100, 4, 16)
        sim_rank.step(2, 1002.0, 0.8, math.nan, math.nan, 1e-4, 100, 4, 16)
        got = {(n, dict(labels).get("metric")): v
               for (n, labels), v in samples(scrape(sim_rank.telemetry.endpoint.url)).items()}
    finally:
        sim_rank.shutdown()
    assert got["mindformers_train_loss_finite", None] == 0
    assert got["mindformers_train_loss", None] == 3.0           # the last finite value
    assert got["mindformers_train_nonfinite_total", "loss"] == 1
    assert got["mindformers_train_nonfinite_total", "grad_norm"] == 1
    assert got["mindformers_train_first_nonfinite_step", None] == 2


# ---------------------------------------------------------------- the small cluster
@pytest.mark.slow
def test_small_cluster_pages_once_per_fault_for_the_right_rank_and_nothing_else(tmp_path):
    # the shortened rules of a simulated run, with a shorter straggler `for` to keep it brief
    rules = {**SIM_RULES, "straggler_for": "10s"}
    settings = SimSettings(ranks=32, ranks_per_node=4, processes=2, prefix="t", seed=7,
                           timing=Timing(warmup_seconds=25.0), rules=rules, with_stack=True,
                           workdir=tmp_path)
    result = run_simulation(settings)
    by_fault = {job.fault: job for job in result.jobs}
    assert [w["done"] for w in result.workers] == [16, 16]
    assert sum(w["export_errors"] for w in result.workers) == 0
    notified = {c.expected.key: (c.firings, c.delay) for c in result.checks}
    for check in result.checks:
        assert check.firings == 1, f"{check.expected.key} fired {check.firings} times"
        assert check.delay is not None and 0 < check.delay <= check.expected.deadline, \
            (check.expected.key, check.delay, check.expected.how)
    assert result.unexpected == [], [p.key for p in result.unexpected]
    # the right ranks
    expected_keys = {
        ("MindFormersLossNotFinite", "t-nan", str(by_fault["nan"].fault_ranks[0])),
        ("MindFormersRankDown", "t-rank-down", str(by_fault["rank_down"].fault_ranks[0])),
        ("MindFormersStragglerRank", "t-main", str(by_fault["straggler"].fault_ranks[0])),
        *(("MindFormersTrainingStalled", "t-node-stall", str(r)) for r in range(4, 8))}
    if STATUS_CANCELLED == STATUS_FAILED:
        expected_keys |= {("MindFormersTrainingFailed", "t-cancel", str(r)) for r in range(4)}
    assert set(notified) == expected_keys
    # Alertmanager's API agrees with the webhook: the same alerts active, nothing else
    assert [c.firings for c in result.api_checks] == [1] * len(result.api_checks)
    assert result.api_unexpected == []
    # inhibited, not absent: the rank-down job's job-level alert fired in Prometheus
    firing = {(a["alertname"], a["job_name"]) for a in result.firing_in_prometheus}
    assert ("MindFormersRanksMissing", "t-rank-down") in firing
    assert not any(job == "t-complete" for _, job in firing)
    assert result.prometheus["prometheus_tsdb_head_series"] > 32 * 41
    assert result.ok


# ---------------------------------------------------------------- past one Prometheus
SCALE_EXAMPLES = ("shard.yml", "federation.yml", "remote-write.yml")


@pytest.mark.parametrize("name", SCALE_EXAMPLES)
def test_scale_out_examples_are_valid_prometheus_configs(name):
    promtool = find_binary(("promtool",))
    assert promtool, "promtool not found on PATH; install it: apt-get install prometheus"
    done = subprocess.run([promtool, "check", "config", f"examples/prometheus/{name}"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "is valid prometheus config file syntax" in done.stdout


def _poll(fetch, timeout: float) -> list:
    """`fetch()` until it returns something (bounded), else fail."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = fetch()
        if found:
            return found
        time.sleep(0.2)
    pytest.fail(f"nothing from {fetch} after {timeout}s")


@pytest.mark.slow
def test_shards_split_the_cluster_by_job_never_a_job_by_rank(tmp_path):
    """Two real Prometheus servers with examples/prometheus/shard.yml (modulus 2): every job's
    targets are discovered by exactly one shard, and together they discover every job."""
    jobs = {f"job-{i}": [f"10.0.{i}.{n}" for n in range(1, 3)] for i in range(8)}
    for job, hosts in jobs.items():
        write_target_file(tmp_path / "targets" / f"{job}.json", target_groups(hosts, 8, 9464))
    shipped = yaml.safe_load((ROOT / "examples" / "prometheus" / "shard.yml").read_text())
    found: dict[str, set[str]] = {}
    for shard in ("0", "1"):
        config = dict(shipped, rule_files=[], alerting={"alertmanagers": []})
        [job] = config["scrape_configs"]
        job["file_sd_configs"][0]["files"] = [str(tmp_path / "targets" / "*.json")]
        job["relabel_configs"][0]["modulus"] = 2
        job["relabel_configs"][1]["regex"] = shard
        with Prometheus(yaml.safe_dump(config), workdir=tmp_path / f"shard-{shard}") as prom:
            targets = _poll(prom.targets, timeout=30)
        files = [t["discoveredLabels"]["__meta_filepath"] for t in targets]
        assert all(files.count(f) == 16 for f in files), "a job's 16 ranks are all on one shard"
        found[shard] = {Path(f).stem for f in files}
    assert found["0"] | found["1"] == set(jobs) and not found["0"] & found["1"]
    assert found["0"] and found["1"], "8 jobs over 2 shards: both shards get some"
