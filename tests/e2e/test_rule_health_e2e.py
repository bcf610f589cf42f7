"""A real Prometheus whose mfotel rules fail for real: `--query.max-samples` below what some
recording rules load ("query processing would load too many samples"), as a Prometheus that
outgrew its jobs fails. It scrapes itself as the shipped prometheus.yml does; the ranks are
the simulator's (8 ranks, the real rank exporter each: tests/support/restart_sim.py), scraped
and evaluated every second.

MindFormersRuleFailures (mfotel.alerting.rule_health) must become pending for exactly the
groups the rules API shows failing, named by group and by the Prometheus' own address, and
not for another team's failing group beside them. Its `for: 10m` is tested by promtool
(prometheus/tests/rule-health.yml); here the expression meets the real metric.
"""
from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from mfotel.alerting import rule_health
from mfotel.alerting.rules import write_rules
from mfotel.localstack.alerting import SELF_JOB, shipped_files
from mfotel.localstack.servers import Prometheus, free_port, http_get_json
from mfotel.simulation.stack import prometheus_config
from tests.support.restart_sim import TIMING, restart_run
from tests.support.waiting import settle, wait_for

pytestmark = pytest.mark.slow

#: Below what the step-time and exporter records load for 8 ranks, above the health alerts'
#: (Prometheus counts the points of one series in a range, plus the result so far).
MAX_SAMPLES = 150
SELF_SCRAPE_SECONDS = 5
#: Another team's group in the same Prometheus, failing as well: theirs to alert on.
THEIRS = """groups:
- name: team.rules
  rules:
  - record: team:samples:count
    expr: sum(count_over_time({__name__=~"mindformers_.+"}[1m]))
"""


def _failing(prom: Prometheus) -> set[str]:
    """The groups (file;name, as Prometheus labels them) with a rule whose last evaluation
    failed, from the rules API."""
    groups = http_get_json(f"{prom.url}/api/v1/rules", timeout=10)["data"]["groups"]
    return {f"{g['file']};{g['name']}" for g in groups
            if any(rule.get("lastError") for rule in g["rules"])}


def _counted(prom: Prometheus) -> set[str]:
    """The groups whose failures Prometheus counted, from its own /metrics."""
    with urllib.request.urlopen(f"{prom.url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {s.labels["rule_group"] for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == "prometheus_rule_evaluation_failures_total" and s.value > 0}


def _ours(groups: set[str]) -> set[str]:
    return {g for g in groups if g.split(";")[1].startswith(("mindformers-", "mfotel-"))}


def test_rule_failures_pend_for_the_failing_groups_named_by_their_prometheus(tmp_path: Path):
    planned = restart_run(tmp_path, "rh")
    rules = write_rules(tmp_path / "rules")
    (tmp_path / "rules" / "team.yml").write_text(THEIRS)
    files = [*rules, tmp_path / "rules" / "team.yml"]
    port = free_port()
    config = yaml.safe_load(prometheus_config(
        shipped_files()["prometheus"], tmp_path / "targets" / "*.json", None, 1.0,
        [p.name for p in files], itself=f"127.0.0.1:{port}"))
    # itself every 5 s: its counters' 5m windows stay below MAX_SAMPLES however long the test
    # takes (a series' points in one window count; at 1 s they pass 150 after 2.5 minutes)
    [own] = [job for job in config["scrape_configs"] if job["job_name"] == SELF_JOB]
    own["scrape_interval"] = own["scrape_timeout"] = f"{SELF_SCRAPE_SECONDS}s"
    prom = Prometheus(yaml.safe_dump(config), rule_files=files, workdir=tmp_path / "prometheus",
                      port=port,
                      extra_args=[f"--query.max-samples={MAX_SAMPLES}"]).start()
    try:
        planned.go()
        seen: set[str] = set()

        def pending() -> set[str]:
            seen.update(_failing(prom))
            alerts = prom.query(f'ALERTS{{alertname="{rule_health.FAILURES}"}}')
            return {a["metric"]["rule_group"] for a in alerts}

        # the sim's ranks start, are scraped, and a few evaluations fail (before the restart)
        wait_for(pending, settle(TIMING.startup_seconds + 10 + SELF_SCRAPE_SECONDS), 0.5,
                 "a failing mfotel group's alert")
        time.sleep(3)   # more evaluations: every group that fails has failed by now
        ours = _ours(_counted(prom))
        assert ours and seen <= _counted(prom), (seen, ours)
        assert f"{tmp_path / 'prometheus'}/team.yml;team.rules" in seen, seen
        # each failing group of mfotel pends (once Prometheus scraped its own count), named by
        # group and by this Prometheus; no other
        wait_for(lambda: pending() >= ours, settle(2 * SELF_SCRAPE_SECONDS), 0.5,
                 f"{rule_health.FAILURES} of every failing mfotel group")
        alerted = pending()
        assert ours <= alerted <= _ours(_counted(prom)), (alerted, ours)
        assert not any(g.endswith(";" + rule_health.GROUP) for g in _counted(prom)), \
            f"the health alerts' own group fails at {MAX_SAMPLES} samples: raise MAX_SAMPLES"
        alerts = prom.query(f'ALERTS{{alertname="{rule_health.FAILURES}"}}')
        assert {(a["metric"]["instance"], a["metric"]["alertstate"], a["metric"]["severity"])
                for a in alerts} == {(f"127.0.0.1:{port}", "pending", "critical")}
    finally:
        try:
            planned.sim.stop()
        finally:
            prom.stop()
