"""The multi-rank examples: Prometheus configs (promtool), Kubernetes manifests and the
OpenTelemetry Collector config (structure; no cluster or collector binary runs here), and the
multi-rank rules of docs/multirank.md as shipped in prometheus/rules (tests/unit/test_rules.py
checks their conventions, promtool cases and runbook)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mfotel.alerting import rules
from mfotel.cluster.discovery import target_groups
from mfotel.contract import CONTRACT
from tests.support.paths import ROOT
from tests.support.prometheus_translation import prometheus_name
from tests.support.promtool import TIMEOUT
from tests.support.promtool import promtool as find_promtool

PROM = ROOT / "examples" / "prometheus"
K8S = ROOT / "examples" / "kubernetes"
COLLECTOR = ROOT / "examples" / "otel-collector" / "collector.yaml"
DOC = ROOT / "docs" / "multirank.md"
MULTIRANK_TESTS = ROOT / "prometheus" / "tests" / "multirank.yml"
MULTIRANK_ALERTS = ("MindFormersRanksMissing", "MindFormersLossDivergence", "MindFormersStepDrift")
MULTIRANK_RECORDS = (rules.WAITED_FOR, rules.RANKS_REPORTING, rules.STEPS_BEHIND,
                     rules.loss_mean_record(rules.RulesConfig()),
                     rules.loss_median_record(rules.RulesConfig()))
EXAMPLE_CONFIGS = ("examples/prometheus/static.yml", "examples/prometheus/file_sd.yml",
                   "examples/otel-collector/prometheus-scrape-collector.yml")


def promtool(*args: str) -> str:
    result = subprocess.run([find_promtool(), *args], capture_output=True, text=True, cwd=ROOT,
                            timeout=TIMEOUT)
    assert result.returncode == 0, f"promtool {' '.join(args)}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.mark.parametrize("config", EXAMPLE_CONFIGS)
def test_prometheus_example_configs_are_valid(config):
    assert "is valid prometheus config file syntax" in promtool("check", "config", config)


@pytest.mark.parametrize("config", [*EXAMPLE_CONFIGS,
                                    "examples/kubernetes/prometheus-kubernetes-sd.yml"])
def test_example_configs_load_the_shipped_rules_only(config):
    rule_files = yaml.safe_load((ROOT / config).read_text())["rule_files"]
    assert [Path(f).name for f in rule_files] == [rules.RECORDING_FILE, rules.ALERTS_FILE]


def test_multirank_rules_are_shipped_and_documented():
    doc = DOC.read_text()
    recorded = {r["record"] for g in rules.recording_rules(rules.RulesConfig()) for r in g["rules"]}
    assert set(MULTIRANK_ALERTS) <= set(rules.alert_names())
    assert set(MULTIRANK_RECORDS) <= recorded
    for name in (*MULTIRANK_ALERTS, *MULTIRANK_RECORDS):
        assert f"`{name}`" in doc, name
    for name in MULTIRANK_ALERTS:  # the runbook lives in one place
        assert f"prometheus/runbook.md#{name.lower()}" in doc, name
        assert f"### {name}" not in doc, name


def test_example_target_file_is_what_mfotel_targets_writes():
    checked_in = yaml.safe_load((PROM / "targets" / "llama7b-sft.json").read_text())
    assert checked_in == target_groups(["node-1", "node-2"], 8, 9464, {"cluster": "a"})
    cli = subprocess.run([sys.executable, "-m", "mfotel.cluster.discovery",
                          "--hosts", "node-1,node-2", "--ranks-per-node", "8", "--port", "9464",
                          "--label", "cluster=a"],
                         capture_output=True, text=True, timeout=60)
    assert yaml.safe_load(cli.stdout) == checked_in


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_kubernetes_manifests_give_one_target_per_rank_and_one_per_node_agent():
    [job] = _docs(K8S / "training-job.yaml")
    [service] = _docs(K8S / "service.yaml")
    [monitor] = _docs(K8S / "podmonitor.yaml")
    pod = job["spec"]["template"]
    [container] = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    # port + local rank; the node agent (mfotel-instrument) on port - 1
    assert ports == {**{f"mfotel-{i}": 9464 + i for i in range(8)}, "mfotel-node": 9463}
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == list(ports)
    assert set(monitor["spec"]["selector"]["matchLabels"].items()) <= \
        set(pod["metadata"]["labels"].items())
    assert {p["targetPort"] for p in service["spec"]["ports"]} == set(ports)
    assert set(service["spec"]["selector"].items()) <= set(pod["metadata"]["labels"].items())


def test_pod_annotation_scrape_config_keeps_the_rank_ports():
    # Debian's Prometheus is built without Kubernetes discovery, so promtool cannot check
    # this file here: check the relabeling against the manifest instead.
    config = yaml.safe_load((K8S / "prometheus-kubernetes-sd.yml").read_text())
    [job] = [j for j in config["scrape_configs"] if "kubernetes_sd_configs" in j]
    assert job["kubernetes_sd_configs"] == [{"role": "pod"}]
    keep = {tuple(r["source_labels"]): r["regex"] for r in job["relabel_configs"]
            if r.get("action") == "keep"}
    port_regex = keep[("__meta_kubernetes_pod_container_port_name",)]
    [manifest] = _docs(K8S / "training-job.yaml")
    annotations = manifest["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == keep[
        ("__meta_kubernetes_pod_annotation_prometheus_io_scrape",)]
    names = [p["name"] for p in manifest["spec"]["template"]["spec"]["containers"][0]["ports"]]
    assert all(re.fullmatch(port_regex, n) for n in names)
    assert not any(t in ("job_name", "rank") for r in job["relabel_configs"]
                   for t in [r.get("target_label")])


def test_collector_translates_to_the_contract_names_without_renames():
    config = yaml.safe_load(COLLECTOR.read_text())
    for name in ("prometheus", "prometheusremotewrite"):
        exporter = config["exporters"][name]
        # the current setting; add_metric_suffixes is deprecated (and ignored beside it)
        assert exporter["translation_strategy"] == "UnderscoreEscapingWithSuffixes", name
        assert "add_metric_suffixes" not in exporter, name
        assert exporter.get("resource_to_telemetry_conversion", {}).get("enabled") is not True
    assert not [p for p in config["processors"] if p.startswith("metricstransform")]
    for spec in CONTRACT:  # the translation rules (tests/support/prometheus_translation.py)
        exposed = spec.sample_name if spec.kind == "counter" else spec.prometheus_name
        assert prometheus_name(spec.otel_name, spec.unit, spec.kind) == exposed, spec.otel_name
    pipeline = config["service"]["pipelines"]["metrics"]
    assert pipeline["receivers"] == ["otlp"]
    assert set(pipeline["processors"]) <= set(config["processors"])
    assert set(pipeline["exporters"]) <= set(config["exporters"])
    assert config["receivers"]["otlp"]["protocols"]["http"]["endpoint"].endswith(":4318")


def test_docs_quote_the_tested_join_queries():
    tests = yaml.safe_load(MULTIRANK_TESTS.read_text())["tests"]
    joins = [case["expr"] for test in tests for case in test.get("promql_expr_test", [])
             if "mindformers_train_rank_info" in case["expr"]]
    doc = (ROOT / "docs" / "multirank.md").read_text()
    assert len(joins) == 3
    for expr in joins:
        assert expr in doc, expr
