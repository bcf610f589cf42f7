"""Every file under examples/ parses and is validated; the Kubernetes manifests hang together.

No Kubernetes API server runs here, so the manifests are checked the way it would reject them
or silently mis-wire them: known apiVersion/kind pairs with their required fields, selectors
that match the pod template's labels, ports and ConfigMaps that the pod actually declares, and a
launch command that registers OTelMonitor (mfotel-instrument) for the training YAML mounted
from the ConfigMap, which mfotel's own checker accepts. The Prometheus configs among the
examples go through promtool in tests/unit/test_multirank_examples.py.
"""
from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from mfotel.config import load_config, parse_config
from mfotel.integrations.mindformers_check import check_mindformers_yaml
from mfotel.localstack.servers import find_binary
from mfotel.node.instrument import parse_args as parse_instrument_args
from mfotel.node.service import node_port
from tests.support.paths import ROOT

EXAMPLES = ROOT / "examples"
K8S = EXAMPLES / "kubernetes"

#: (apiVersion, kind) -> keys the API server requires under `spec` (None: no spec, e.g. ConfigMap).
KNOWN_KINDS: dict[tuple[str, str], tuple[str, ...] | None] = {
    ("batch/v1", "Job"): ("template",),
    ("v1", "Service"): ("ports",),
    ("v1", "ConfigMap"): None,
    ("monitoring.coreos.com/v1", "PodMonitor"): ("selector", "podMetricsEndpoints"),
}


def documents(path: Path) -> list[Any]:
    if path.suffix == ".json":
        return [json.loads(path.read_text())]
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def example_files() -> list[Path]:
    return sorted(p for p in EXAMPLES.rglob("*") if p.suffix in (".yaml", ".yml", ".json"))


def kind_of(document: Any) -> str:
    """Which validation covers a document of the examples (see the tests below)."""
    if isinstance(document, list) and all("targets" in group for group in document):
        return "file_sd targets (test_multirank_examples)"
    if not isinstance(document, dict):
        return "unknown"
    if {"apiVersion", "kind"} <= document.keys():
        return "kubernetes manifest"
    if "scrape_configs" in document:
        return "prometheus config (promtool, test_multirank_examples)"
    if {"receivers", "exporters", "service"} <= document.keys():
        return "collector config (test_multirank_examples)"
    if "monitor_config" in document and len(document) == 1:
        return "monitor_config (mfotel check)"
    if set(document) == {"groups"}:
        return "rule file (test_sharded_rules: the rendered rules, promtool and vmalert)"
    if "callbacks" in document or "runner_wrapper" in document:
        return "mindformers YAML (test_mindformers_check)"
    return "unknown"


def manifests() -> list[dict[str, Any]]:
    return [d for path in sorted(K8S.glob("*.yaml")) for d in documents(path)
            if kind_of(d) == "kubernetes manifest"]


def the(kind: str) -> list[dict[str, Any]]:
    return [m for m in manifests() if m["kind"] == kind]


def pod_templates() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, pod template) of every workload manifest."""
    return [(m, m["spec"]["template"]) for m in manifests() if m["kind"] == "Job"]


def container_ports(template: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for c in template["spec"]["containers"]
            for p in c.get("ports", [])}


@pytest.mark.parametrize("path", example_files(), ids=lambda p: str(p.relative_to(EXAMPLES)))
def test_every_example_parses_and_has_a_validation(path):
    docs = documents(path)
    assert docs, f"{path} is empty"
    for document in docs:
        assert kind_of(document) != "unknown", \
            f"{path}: no test validates this kind of file; add one to tests/unit/test_examples.py"


def test_kubernetes_manifests_use_known_kinds_with_their_required_fields():
    found = manifests()
    assert {m["kind"] for m in found} == {kind for _, kind in KNOWN_KINDS}
    for manifest in found:
        key = (manifest["apiVersion"], manifest["kind"])
        assert key in KNOWN_KINDS, f"unknown apiVersion/kind {key}"
        metadata = manifest["metadata"]
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", metadata["name"]), metadata["name"]
        assert metadata["namespace"] == "train", metadata["name"]  # one namespace, one job
        required = KNOWN_KINDS[key]
        if required is None:
            assert "spec" not in manifest and manifest.get("data"), metadata["name"]
        else:
            assert set(required) <= manifest["spec"].keys(), (metadata["name"], required)


def test_selectors_match_the_pod_template_labels():
    [(job, template)] = pod_templates()
    labels = template["metadata"]["labels"]
    assert "selector" not in job["spec"]  # the Job controller generates it
    selectors: list[tuple[str, dict[str, str]]] = [
        *((f"Service {s['metadata']['name']}", s["spec"]["selector"]) for s in the("Service")),
        *((f"PodMonitor {m['metadata']['name']}", m["spec"]["selector"]["matchLabels"])
          for m in the("PodMonitor"))]
    assert selectors
    for who, selector in selectors:
        assert selector and set(selector.items()) <= set(labels.items()), (who, selector, labels)
    for monitor in the("PodMonitor"):
        assert set(monitor["spec"].get("podTargetLabels", [])) <= labels.keys()


def rank_ports(template: dict[str, Any]) -> dict[str, int]:
    """The ranks' named ports (mfotel-0 ..), without the node agent's (mfotel-node)."""
    return {n: p for n, p in container_ports(template).items() if n != "mfotel-node"}


def test_referenced_ports_are_declared_by_the_pod():
    [(_, template)] = pod_templates()
    ports = container_ports(template)
    ranks = rank_ports(template)
    assert ranks == {f"mfotel-{i}": 9464 + i for i in range(len(ranks))}  # port + local rank
    assert ports["mfotel-node"] == 9463  # the node agent: prometheus.node_port, port - 1
    for service in the("Service"):
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports, port
            assert port["port"] == ports[port["targetPort"]], port
    for monitor in the("PodMonitor"):
        endpoints = [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]]
        assert sorted(endpoints) == sorted(ports)


def _launch(template: dict[str, Any]) -> list[str]:
    [container] = template["spec"]["containers"]
    return [*container.get("command", []), *container.get("args", [])]


def _flag(argv: list[str], name: str) -> str:
    for i, arg in enumerate(argv):
        if arg.startswith(f"{name}="):
            return arg.split("=", 1)[1]
        if arg == name:
            return argv[i + 1]
    raise AssertionError(f"{name} missing from {shlex.join(argv)}")


def _mounted_config(template: dict[str, Any], path: str) -> tuple[dict[str, Any], str]:
    """(ConfigMap, key) that provides the file `path` inside the container."""
    [container] = template["spec"]["containers"]
    volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        directory = mount["mountPath"].rstrip("/") + "/"
        if path.startswith(directory):
            volume = volumes[mount["name"]]  # a mount names a declared volume
            [config_map] = [c for c in the("ConfigMap")
                            if c["metadata"]["name"] == volume["configMap"]["name"]]
            return config_map, path[len(directory):]
    raise AssertionError(f"nothing is mounted at {path}")


def test_training_job_registers_otelmonitor_and_mounts_its_training_yaml(tmp_path):
    [(job, template)] = pod_templates()
    argv = _launch(template)
    # mfotel-instrument first: without it the OTelMonitor callback entry cannot be resolved
    assert argv[0] == "mfotel-instrument", argv
    launch = parse_instrument_args(argv[1:])
    assert launch.command[0] == "msrun" and not launch.exec_, argv
    argv = launch.command
    workers = int(_flag(argv, "--local_worker_num"))
    assert workers == int(_flag(argv, "--worker_num")) == len(rank_ports(template))

    config_map, key = _mounted_config(template, _flag(argv, "--config"))
    assert key in config_map["data"]
    training_yaml = tmp_path / key
    training_yaml.write_text(config_map["data"][key])
    assert check_mindformers_yaml(training_yaml, use_mindformers=False) == []

    [entry] = [c for c in yaml.safe_load(config_map["data"][key])["callbacks"]
               if c["type"] == "OTelMonitor"]
    cfg = parse_config({k: v for k, v in entry.items() if k != "type"}, str(training_yaml))
    assert cfg.job_name == template["metadata"]["labels"]["mfotel.io/job-name"]
    ports = sorted(rank_ports(template).values())
    assert ports == [cfg.prometheus.port + local_rank for local_rank in range(workers)]
    assert container_ports(template)["mfotel-node"] == node_port(cfg)
    assert cfg.prometheus.host == "0.0.0.0"
    # a deleted pod: every rank lingers for its final scrape, then mfotel-instrument kills
    # what is left, then the kubelet: in that order
    assert cfg.prometheus.linger_seconds < launch.stop_timeout < \
        template["spec"]["terminationGracePeriodSeconds"]
    env = {e["name"] for e in template["spec"]["containers"][0]["env"]}
    assert {"POD_NAME", "POD_NAMESPACE", "MFOTEL_RUN_ID"} <= env


def test_plain_monitor_config_example_loads():
    cfg = load_config(EXAMPLES / "monitor_config.yaml")
    # job_name, host and port are left to OTEL_SERVICE_NAME / OTEL_EXPORTER_PROMETHEUS_*
    assert cfg.enable and cfg.job_name == "monitor_config" and cfg.step_interval == 50
    assert cfg.metrics == ("loss", "learning_rate", "grad_norm", "throughput", "step_time")
    assert (cfg.prometheus.host, cfg.prometheus.port) == ("0.0.0.0", 9464)


@pytest.mark.parametrize("path", sorted((EXAMPLES / "prometheus").glob("*.yml")),
                         ids=lambda p: p.name)
def test_every_example_prometheus_config_passes_promtool(path):
    """promtool check config on each of examples/prometheus/ (the remote_write ones too)."""
    promtool = find_binary(("promtool",))
    assert promtool, "promtool not found on PATH; install it: apt-get install prometheus"
    done = subprocess.run([promtool, "check", "config", str(path)], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {path} is valid prometheus config file syntax" in done.stdout
