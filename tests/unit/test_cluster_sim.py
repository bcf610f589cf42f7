"""The cluster simulator (`mfotel simulate`): its plan, its routes, its ranks (each the real
per-rank stack) and the scale-out examples. tests/e2e/test_cluster_sim_e2e.py runs a small
simulated cluster against the real Prometheus and Alertmanager.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import yaml

from mfotel.alerting.rules import RulesConfig
from mfotel.alerting.webhook import ReceivedAlert
from mfotel.cluster.discovery import target_groups
from mfotel.config import parse_config
from mfotel.contract import STATUS_FAILED
from mfotel.localstack.alerting import operator_alertmanager_config as alertmanager_config
from mfotel.localstack.alerting import shipped_files
from mfotel.localstack.servers import find_binary, free_port
from mfotel.simulation.node_agents import RankEnd, SimNodeAgent
from mfotel.simulation.ranks import SimRank
from mfotel.simulation.run import (
    SIM_RULES,
    SimSettings,
    Simulation,
    add_simulate_arguments,
    new_after,
    pages_missing,
    rank_config,
    settings_from_args,
)
from mfotel.simulation.scenario import (
    STATUS_CANCELLED,
    JobClock,
    RankSpec,
    Timing,
    expected_pages,
    plan_jobs,
    slow_factor,
)
from mfotel.simulation.stack import Notification, PrometheusProbe, route_setting
from tests.support.metrics import samples, scrape, value
from tests.support.paths import ROOT


@pytest.fixture(scope="module")
def shipped_am() -> dict:
    return yaml.safe_load(shipped_files()["alertmanager"])


# ---------------------------------------------------------------- the plan
def test_each_fault_gets_its_own_job_and_the_main_job_takes_the_rest():
    jobs = {job.name: job for job in plan_jobs(1024, 8, prefix="big", seed=3)}
    assert {name: (job.fault, job.world_size) for name, job in jobs.items()} == {
        "big-main": ("input", 968), "big-compute": ("compute", 8), "big-nan": ("nan", 8),
        "big-rank-down": ("rank_down", 8), "big-hang": ("hang", 16),
        "big-complete": ("complete", 8), "big-cancel": ("cancel", 8)}
    nodes = [n for job in jobs.values() for n in range(job.first_node, job.first_node + job.nodes)]
    assert sorted(nodes) == list(range(128)), "every node belongs to exactly one job"
    assert jobs["big-hang"].fault_ranks == tuple(range(8, 16)), "its whole second node"
    assert jobs["big-complete"].fault_ranks == tuple(range(8))
    [straggler] = jobs["big-main"].fault_ranks
    assert 0 <= straggler < 968
    assert plan_jobs(1024, 8, prefix="big", seed=3) == list(jobs.values()), "seeded"


@pytest.mark.parametrize("ranks, per_node, message", [
    (48, 8, "use at least 64 ranks"),
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
    jobs = {job.fault: job for job in plan_jobs(64, 8)}
    # an input wait adds to every rank's period, a slow device multiplies it
    assert slow_factor(jobs["input"], timing) == pytest.approx(1.5)
    assert slow_factor(jobs["compute"], timing) == pytest.approx(8.0)
    assert slow_factor(jobs["nan"], timing) == 1.0
    clock = JobClock(start=100.0, timing=timing, slow_from=110.0, slow_factor=1.5)
    assert [clock.step_end(k) for k in (1, 10)] == [101.0, 110.0]
    assert clock.step_end(11) - clock.step_end(10) == pytest.approx(1.5)
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


def test_node_agents_add_one_target_per_node_and_the_command_line_asks_for_them(tmp_path):
    for host, folder in ((None, "a"), ("0.0.0.0", "b")):
        sim = Simulation(SimSettings(ranks=64, port=20000, host=host, node_agents=True),
                         tmp_path / folder, lambda labels: 0.0)
        sim.workdir.mkdir(parents=True, exist_ok=True)
        sim.write_targets()
        groups = [g for path in sim.file_sd_dir.glob("*.json")
                  for g in json.loads(path.read_text())]
        nodes = [g["targets"] for g in groups if g["labels"] == {"mfotel_target": "node"}]
        assert len(nodes) == 8 and all(len(targets) == 1 for targets in nodes)
        assert sum(len(g["targets"]) for g in groups) == 64 + 8
        addresses = {sim.node_address(node) for node in range(8)}
        assert len(addresses) == 8  # one agent endpoint per node, none shared
        if host is None:
            assert {port for _, port in addresses} == {sim.node_port}

    args = add_simulate_arguments(argparse.ArgumentParser()).parse_args
    assert settings_from_args(args(["--node-agents"])).node_agents
    assert not settings_from_args(args([])).node_agents


def test_stopping_reaches_every_worker_at_once(tmp_path):
    """A job's nodes are spread over the workers: stopping them in turn would leave a job with
    ranks gone while its others run (a false MindFormersRanksMissing). Each stand-in worker
    (a real process reading its stdin as the worker does) says when its stdin closed, then
    takes 2 s to end: every stdin closed before the first of them ended."""
    sim = Simulation(SimSettings(ranks=64), tmp_path, lambda labels: 0.0)
    script = ("import json, sys, time; sys.stdin.read(); closed = time.time(); time.sleep(2); "
              "print(json.dumps({'done': 1, 'closed': closed}))")
    sim.workers = [subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True) for _ in range(3)]
    sim.stop(timeout=60)
    closed = [done["closed"] for done in sim.done]
    assert len(closed) == 3 and max(closed) < min(closed) + 2
    assert sim.workers == []


def test_after_stopping_only_an_alert_that_never_paged_counts_as_a_page():
    """Alertmanager updates an incident as its ranks resolve one by one (the rest still
    firing): the same incident ending. A rank or an alert not paged before stopping pages."""
    def call(at: float, *alerts: tuple[str, str, str], status: str = "firing") -> Notification:
        return Notification(at, 100, [ReceivedAlert(status, {"job_name": job, "alertname": name,
                                                             "rank": rank}, {})
                                      for job, name, rank in alerts])
    stall = [("sim-hang", "MindFormersTrainingStalled", str(r)) for r in range(8, 16)]
    before = call(10.0, *stall)
    update = call(50.0, *stall[:1], *stall[5:])                        # 9..12 resolved
    resolved = call(60.0, *stall, status="resolved")
    down = call(70.0, ("sim-main", "MindFormersRankDown", "3"))
    other = call(80.0, ("t-main", "MindFormersRankDown", "3"))          # not a simulated job
    assert new_after([before, update, resolved, down, other], 40.0, "sim") == [down]
    assert new_after([update], 40.0, "sim") == [update], "never paged before stopping"


def test_the_run_waits_past_its_window_only_while_an_expected_page_is_missing(tmp_path):
    """`late_seconds` (a loaded machine) extends the run only while an incident has had no
    notification: with one for each, the run ends at its window."""
    sim = Simulation(SimSettings(ranks=64, prefix="p"), tmp_path, lambda labels: 0.0)
    start = 1000.0
    fault = start + sim.settings.timing.fault_at

    def page(item) -> Notification:
        labels = {"job_name": item.job_name, "alertname": item.alertname}
        return Notification(fault + 10, 100, [ReceivedAlert("firing", labels, {})])
    pages = [page(item) for item in sim.expected]
    assert len(pages) >= 5
    assert pages_missing(sim, SimpleNamespace(notifications_seen=[]), start)
    assert pages_missing(sim, SimpleNamespace(notifications_seen=pages[:-1]), start)
    assert not pages_missing(sim, SimpleNamespace(notifications_seen=pages), start)
    assert not pages_missing(sim, None, start), "nothing to wait for without a webhook"


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

    def wait(**labels: str) -> float:
        return route_setting(config, {"team": "ml", **labels}, "group_wait", "30s")

    assert wait(alertname="MindFormersLossNotFinite") == 0
    assert wait(alertname="MindFormersLossSpike", severity="critical", rank="0") == 30  # inherited
    assert route_setting(config, {}, "group_wait", "30s") == 60   # team != "ml"


def test_each_fault_expects_one_notification_naming_its_ranks_with_its_documented_delay(
        shipped_am):
    jobs = plan_jobs(64, 8, prefix="p")
    rules = RulesConfig(**SIM_RULES)
    group_wait = lambda labels: route_setting(shipped_am, labels, "group_wait", "30s")  # noqa: E731
    expected = {e.job_name: e for e in expected_pages(jobs, Timing(), rules, 5.0, group_wait,
                                                      slack=0)}
    by_job = {job.fault: job for job in jobs}
    nan = expected["p-nan"]
    assert (nan.alertname, nan.ranks) == ("MindFormersLossNotFinite",
                                          (str(by_job["nan"].fault_ranks[0]),))
    gw_critical = group_wait({"severity": "critical", "alertname": "MindFormersLossNotFinite",
                              "job_name": "p-nan"})
    # scrape + evaluation + every rank scraped past the first NaN step (a step, a scrape)
    assert nan.deadline == 5 + 5 + (5 + 1) + gw_critical
    hang = expected["p-hang"]
    assert (hang.alertname, hang.ranks) == ("MindFormersTrainingStalled",
                                            tuple(str(r) for r in range(8, 16)))
    assert hang.deadline == 30 + 5 + 5 + 5 + 10 + group_wait(
        {"severity": "critical", "alertname": "MindFormersTrainingStalled", "job_name": "p-hang"})
    compute = expected["p-compute"]
    assert (compute.alertname, compute.ranks) == ("MindFormersThroughputDrop", ()), "no rank"
    assert expected["p-main"].ranks == (str(by_job["input"].fault_ranks[0]),)
    names = {e.alertname for e in expected.values()}
    assert "MindFormersRanksMissing" not in names, "inhibited by RankDown of the same job"
    # with node agents, the dead rank's agent pages it: no `for`, a scrape and an evaluation
    agents = {(e.alertname, e.job_name): e for e in expected_pages(
        jobs, Timing(), rules, 5.0, group_wait, slack=0, node_agents=True)}
    exited = agents["MindFormersRankExited", "p-rank-down"]
    assert ("MindFormersRankDown", "p-rank-down") not in agents
    assert exited.deadline == 5 + 5 + group_wait({"severity": "critical", "alertname":
                                                  "MindFormersRankExited",
                                                  "job_name": "p-rank-down"})
    assert ("MindFormersTrainingFailed" in names) == (STATUS_CANCELLED == STATUS_FAILED)
    assert "p-complete" not in expected


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
    (tests/e2e/test_multirank_callback.py)."""
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
    assert math.isnan(got["mindformers_train_loss", None])     # as it is, not the last finite
    assert math.isnan(got["mindformers_train_grad_norm", None])
    assert got["mindformers_train_nonfinite_total", "loss"] == 1
    assert got["mindformers_train_nonfinite_total", "grad_norm"] == 1
    assert got["mindformers_train_first_nonfinite_step", None] == 2


@dataclass
class _Followed:
    served: bool


def test_a_simulated_node_agent_serves_how_each_of_its_ranks_ended():
    """The real node exposition: a live rank, one the rank_down fault killed (what
    MindFormersRankExited pages on, naming the signal), a completed and a cancelled one (what
    pages nobody)."""
    ends = {("j", 1): RankEnd(1001.0, signal.SIGKILL), ("j", 2): RankEnd(1002.0, 0),
            ("j", 3): RankEnd(1003.0, 0, cancelled=True)}
    agent = SimNodeAgent([("j", r, r, _Followed(True)) for r in range(4)], "127.0.0.1",
                         free_port(), ends)
    try:
        assert agent.served
        got = samples(scrape(f"http://127.0.0.1:{agent.endpoint.port}/metrics"))
    finally:
        agent.close()
    states = {dict(labels)["rank"]: dict(labels)["state"] for (name, labels), v in got.items()
              if name == "mfotel_node_rank_state" and v == 1}
    assert states == {"0": "running", "1": "exited", "2": "exited", "3": "exited"}
    exits = {dict(labels)["rank"]: (dict(labels)["cause"], dict(labels)["signal"],
                                    dict(labels)["signal_name"], dict(labels)["exit_code"])
             for (name, labels), _ in got.items() if name == "mfotel_node_rank_exit_info"}
    assert exits == {"1": ("signal", "9", "SIGKILL", ""), "2": ("completed", "", "", "0"),
                     "3": ("cancelled", "", "", "0")}
    assert value(got, "mfotel_node_rank_endpoint_up", rank="0") == 1
    assert value(got, "mfotel_node_rank_endpoint_up", rank="1") is None, "nothing listens"
    assert value(got, "mfotel_node_rank_exit_timestamp_seconds", rank="1") == 1001.0
    assert value(got, "mfotel_node_rank_resident_memory_bytes", rank="0") == 24 << 30


def test_a_prometheus_that_does_not_answer_costs_a_sample_not_the_run():
    """A Prometheus too busy to answer its self-measurement (a 1024-rank run on a loaded
    machine): the sample is counted as missed and the run goes on."""
    silent = SimpleNamespace(url=f"http://127.0.0.1:{free_port()}", process=None)  # nothing there
    probe = PrometheusProbe(silent)  # type: ignore[arg-type]
    assert probe.try_sample() is None and probe.try_sample() is None
    assert probe.missed == 2 and probe.samples == [] and probe.summary() == {}


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
