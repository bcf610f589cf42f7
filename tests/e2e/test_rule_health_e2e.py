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
from prometheus_client.parser import text_string_to_metric_families

from mfotel.alerting import rule_health
from mfotel.alerting.rules import write_rules
from mfotel.localstack.alerting import shipped_files
from mfotel.localstack.servers import Prometheus, free_port, http_get_json
from mfotel.simulation.stack import prometheus_config
from tests.support.restart_sim import TIMING, restart_run
from tests.support.waiting import settle, wait_for

pytestmark = pytest.mark.slow

#: Below what the step-time and exporter records load for 8 ranks, above the health alerts'.
MAX_SAMPLES = 150
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


def test_rule_failures_pend_for_the_failing_groups_named_by_their_prometheus(tmp_path: Path):
    planned = restart_run(tmp_path, "rh")
    rules = write_rules(tmp_path / "rules")
    (tmp_path / "rules" / "team.yml").write_text(THEIRS)
    files = [*rules, tmp_path / "rules" / "team.yml"]
    port = free_port()
    config = prometheus_config(shipped_files()["prometheus"], tmp_path / "targets" / "*.json",
                               None, 1.0, [p.name for p in files], itself=f"127.0.0.1:{port}")
    prom = Prometheus(config, rule_files=files, workdir=tmp_path / "prometheus", port=port,
                      extra_args=[f"--query.max-samples={MAX_SAMPLES}"]).start()
    try:
        planned.go()
        seen: set[str] = set()

        def pending() -> set[str]:
            seen.update(_failing(prom))
            alerts = prom.query(f'ALERTS{{alertname="{rule_health.FAILURES}"}}')
            return {a["metric"]["rule_group"] for a in alerts}

        # the sim's ranks start, are scraped, and a few evaluations fail (before the restart)
        wait_for(pending, settle(TIMING.startup_seconds + 10), 0.5,
                 "a failing mfotel group's alert")
        time.sleep(3)   # more evaluations: every group that fails has failed by now
        counted = _counted(prom)
        alerted = pending()
        ours = {g for g in counted if g.split(";")[1].startswith(("mindformers-", "mfotel-"))}
        assert ours and seen <= counted, (seen, counted)
        assert f"{tmp_path / 'prometheus'}/team.yml;team.rules" in seen, seen
        assert not any(g.endswith(";" + rule_health.GROUP) for g in counted), \
            f"the health alerts' own group fails at {MAX_SAMPLES} samples: raise MAX_SAMPLES"
        # each failing group of mfotel pends, named by group and by this Prometheus; no other
        # (a group failing since the last read may pend at the next evaluation: read again)
        assert alerted <= ours and (alerted == ours or pending() >= ours), (alerted, ours)
        alerts = prom.query(f'ALERTS{{alertname="{rule_health.FAILURES}"}}')
        assert {(a["metric"]["instance"], a["metric"]["alertstate"], a["metric"]["severity"])
                for a in alerts} == {(f"127.0.0.1:{port}", "pending", "critical")}
    finally:
        try:
            planned.sim.stop()
        finally:
            prom.stop()
