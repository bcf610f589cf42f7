"""The shipped prometheus.yml and alertmanager.yml as an operator wires them: promtool and
amtool accept them, the NaN page routes without group_wait while other alerts keep theirs, and
the fast path posts that page with the rule's labels.

The running stack with these files is tested in tests/e2e/test_alerting_e2e.py.
"""
from __future__ import annotations

import subprocess
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import yaml

from mfotel.alerting import rule_health, rules
from mfotel.alerting.fastpage import loss_alert
from mfotel.assets import alertmanager_files, write_files
from mfotel.localstack.alerting import (
    SELF_JOB,
    operator_alertmanager_config,
    operator_prometheus_config,
    shipped_files,
)
from mfotel.localstack.servers import Alertmanager, find_binary
from tests.support import http
from tests.support.paths import ROOT
from tests.support.waiting import settle, wait_for


def test_shipped_prometheus_yml_loads_with_only_the_intervals_lowered(tmp_path: Path) -> None:
    """An operator lowering both intervals to 1s changes nothing else (no scrape_timeout)."""
    promtool = find_binary(("promtool",))
    assert promtool, "promtool not found on PATH; install it: apt-get install prometheus"
    files = shipped_files()
    config = yaml.safe_load(files["prometheus"])
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    (tmp_path / "rules").mkdir()
    for key, name in (("recording", rules.RECORDING_FILE), ("alerts", rules.ALERTS_FILE)):
        (tmp_path / "rules" / name).write_text(files[key])
    result = subprocess.run([promtool, "check", "config", str(tmp_path / "prometheus.yml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    # and what the demo and the benchmark run differs from it in targets and addresses only
    ours = yaml.safe_load(operator_prometheus_config(files["prometheus"], ["127.0.0.1:1"],
                                                     "127.0.0.1:2"))
    assert ours["global"] == config["global"] and ours["rule_files"] == config["rule_files"]
    wired = yaml.safe_load(operator_prometheus_config(files["prometheus"], ["127.0.0.1:1"],
                                                      "127.0.0.1:2", itself="127.0.0.1:3"))
    assert _self_targets(wired) == ["127.0.0.1:3"]


def _self_targets(config: dict[str, Any]) -> list[str]:
    return [target for job in config["scrape_configs"] if job["job_name"] == SELF_JOB
            for static in job.get("static_configs", []) for target in static["targets"]]


@pytest.mark.parametrize("path", [
    "prometheus/prometheus.yml", "docker/prometheus.yml",
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "examples").rglob("*.yml")
            if {"rule_files", "scrape_configs"} <= set(yaml.safe_load(p.read_text()) or {}))])
def test_every_prometheus_evaluating_the_rules_scrapes_itself(path: str) -> None:
    """MindFormersRuleFailures and MindFormersMissingRuleEvaluations (rule_health) read the
    evaluator's own counters: without its own scrape, a rule failing to evaluate is silent."""
    config = yaml.safe_load((ROOT / path).read_text())
    assert config["rule_files"], path
    [target] = _self_targets(config)
    assert target.endswith(":9090"), (path, target)


def _route(config: dict[str, Any], labels: dict[str, str]) -> dict[str, Any]:
    """The first child route of the root whose `name = "value"` matchers all match `labels`
    (the shipped routes use only those), with the root's settings inherited."""
    root = config["route"]
    for child in root.get("routes", []):
        pairs = [m.split("=", 1) for m in child.get("matchers", [])]
        if all(labels.get(k.strip()) == v.strip().strip('"') for k, v in pairs):
            return {**{k: v for k, v in root.items() if k != "routes"}, **child}
    return root


@pytest.mark.parametrize("path", ["alertmanager/alertmanager.yml", "docker/alertmanager.yml"])
def test_nan_alert_routes_without_group_wait_and_other_alerts_keep_theirs(path: str) -> None:
    config = yaml.safe_load((ROOT / path).read_text())
    posted = loss_alert("llama", 0, 1, float("nan"))["labels"]   # what the fast path posts
    nan_route = _route(config, posted)
    assert nan_route["group_wait"] == "0s" and nan_route["receiver"] == "mfotel-pager"
    assert nan_route["group_by"] == ["job_name", "alertname"]
    stall = _route(config, {"alertname": "MindFormersTrainingStalled", "severity": "critical"})
    assert stall["group_wait"] == "10s" and stall["receiver"] == "mfotel-pager"
    spike = _route(config, {"alertname": "MindFormersLossSpike", "severity": "warning"})
    assert spike["group_wait"] == "30s" and spike["receiver"] == "mfotel-tickets"
    amtool = find_binary(("amtool",))
    assert amtool, "amtool not found on PATH; install it: apt-get install prometheus-alertmanager"
    labels = [f"{k}={v}" for k, v in posted.items()]
    routed = subprocess.run([amtool, "config", "routes", "test", f"--config.file={ROOT / path}",
                             *labels], capture_output=True, text=True, timeout=60)
    assert routed.stdout.strip() == "mfotel-pager", routed.stdout + routed.stderr


def test_the_fast_path_alert_has_the_rules_labels():
    alert = loss_alert("llama", 3, 17, float("nan"))
    assert alert["labels"] == {"alertname": "MindFormersLossNotFinite", "severity": "critical",
                               "job_name": "llama", "rank": "3"}
    assert alert["annotations"]["runbook_url"].endswith("#mindformerslossnotfinite")


def test_a_store_outage_mutes_the_global_rulers_rule_failures_not_a_prometheus(tmp_path):
    """A real Alertmanager with the shipped config: MindFormersStoreDown (the sharded
    topology's store) mutes MindFormersRuleFailures of the global ruler's groups (vmalert
    names a group alone: every query of it fails with the store) but not of a Prometheus'
    own groups (named "<file>;<group>"), which fail on their own."""
    write_files(alertmanager_files(), tmp_path)  # the templates beside the config
    config = operator_alertmanager_config(shipped_files()["alertmanager"],
                                          "http://127.0.0.1:9/alerts")
    now = datetime.now(timezone.utc).isoformat()
    failing = {"alertname": rule_health.FAILURES, "severity": "critical"}
    alerts = [{"labels": labels, "startsAt": now} for labels in (
        {"alertname": "MindFormersStoreDown", "severity": "critical",
         "mfotel_component": "store", "instance": "vm:8428"},
        {**failing, "instance": "vmalert:8880", "rule_group": "mindformers-cascade.rules"},
        {**failing, "instance": "prom-0:9090",
         "rule_group": "/etc/prometheus/rules/mindformers-scraper.yml;mindformers-loss.rules"})]
    with Alertmanager(config, workdir=tmp_path) as alertmanager:
        assert http.post(f"{alertmanager.url}/api/v2/alerts", alerts).status == 200
        muted = wait_for(lambda: {a["labels"].get("rule_group", a["labels"]["alertname"]):
                                  bool(a["status"]["inhibitedBy"])
                                  for a in alertmanager.alerts()} or None,
                         settle(1), 0.2, "the alerts in Alertmanager")
    assert muted == {"MindFormersStoreDown": False, "mindformers-cascade.rules": True,
                     "/etc/prometheus/rules/mindformers-scraper.yml;mindformers-loss.rules":
                         False}
