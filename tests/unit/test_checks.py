"""mfotel.checks: the settings check (config/) composed with what config/ may not import: the
endpoint's web-config file, the launcher's ranks per node and an integration's document check."""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from mfotel.checks import check_file, check_start, ranks_per_node, web_config_problems
from mfotel.config import ConfigError, parse_config
from mfotel.integrations.mindformers_check import document_check
from tests.support.paths import ROOT

EXAMPLE = ROOT / "examples/mindformers/tiny_llama_cpu.yaml"
BAD_WEB_CONFIG = "tls_server_config:\n  cert_file: missing.crt\n  key_file: missing.key\n"


def _mindformers_yaml(tmp_path: Path, entry_line: str) -> Path:
    text = EXAMPLE.read_text()
    assert "  - type: OTelMonitor\n" in text
    path = tmp_path / "llama.yaml"
    path.write_text(text.replace("  - type: OTelMonitor\n", entry_line))
    return path


def test_a_bad_callback_entry_is_reported_without_an_integration_check(tmp_path):
    path = _mindformers_yaml(tmp_path, "  - type: OTelMonitor\n    step_intervl: 5\n")
    report = check_file(path, ranks=1, env={})
    assert report.where.startswith("callbacks[") and report.config is None
    assert len(report.errors) == 1
    assert f"{report.where}.step_intervl" in report.errors[0]
    assert "did you mean 'step_interval'" in report.errors[0]


def test_a_missing_callback_entry_is_reported_without_an_integration_check(tmp_path):
    path = _mindformers_yaml(tmp_path, "  - type: OTelMonitr\n")
    report = check_file(path, ranks=1, env={})
    assert report.config is None
    assert any("'OTelMonitr' is not a callback mfotel registers" in e for e in report.errors)


def test_the_integration_check_reports_the_entry_once_and_its_own_problems(tmp_path):
    path = _mindformers_yaml(tmp_path, "  - type: OTelMonitor\n    step_intervl: 5\n")
    seen: list[tuple[str, Mapping[str, Any]]] = []

    def check(source: str, document: Mapping[str, Any]) -> list[str]:
        seen.append((source, document))
        return document_check(use_mindformers=False)(source, document) + ["extra problem"]

    report = check_file(path, ranks=1, env={}, document_check=check)
    assert [source for source, _ in seen] == [str(path)]
    assert "callbacks" in seen[0][1]
    assert report.errors[-1] == "extra problem"
    assert sum("step_intervl" in e for e in report.errors) == 1  # not twice


def test_a_plain_yaml_never_runs_the_integration_check(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text("monitor_config:\n  step_interval: 5\n")

    def check(source: str, document: Mapping[str, Any]) -> list[str]:
        raise AssertionError("not a mindformers YAML")

    report = check_file(path, ranks=2, env={}, document_check=check)
    assert report.errors == [] and report.config is not None
    assert report.config.step_interval == 5
    assert "ports: the 2 ranks of a node serve 9464..9465 (--ranks-per-node)" in report.notes


def test_a_bad_web_config_file_is_an_error_of_the_check(tmp_path):
    web = tmp_path / "web.yml"
    web.write_text(BAD_WEB_CONFIG)
    path = tmp_path / "train.yaml"
    path.write_text(f"monitor_config:\n  prometheus: {{web_config_file: '{web}'}}\n")
    report = check_file(path, ranks=1, env={})
    assert len(report.errors) == 1
    assert str(web) in report.errors[0] and "tls_server_config" in report.errors[0]


@pytest.mark.parametrize("settings", [{"enable": False}, {"prometheus": {"port": 0}}],
                         ids=["monitor-off", "endpoint-off"])
def test_the_web_config_file_is_not_loaded_when_nothing_serves(tmp_path, settings):
    web = tmp_path / "web.yml"
    web.write_text(BAD_WEB_CONFIG)
    prometheus = {"web_config_file": str(web), **settings.get("prometheus", {})}
    cfg = parse_config({**settings, "prometheus": prometheus})
    assert web_config_problems(cfg) == []


@pytest.mark.parametrize("given, world, env, expected", [
    (4, None, {"LOCAL_WORLD_SIZE": "2"}, (4, "--ranks-per-node")),
    (None, None, {"LOCAL_WORLD_SIZE": "2"}, (2, "the launcher's environment")),
    (None, 3, {}, (3, "assumed; set --ranks-per-node")),
    (None, 64, {}, (8, "assumed; set --ranks-per-node")),
    (None, None, {}, (8, "assumed; set --ranks-per-node")),
])
def test_ranks_per_node_comes_from_the_command_the_launcher_or_an_assumption(
        given, world, env, expected):
    assert ranks_per_node(given, world, env) == expected


def test_the_start_creates_the_log_directory_and_loads_the_web_config(tmp_path):
    log = tmp_path / "logs" / "run.log"
    cfg = parse_config({"output": {"file": True, "file_path": str(log)}})
    assert check_start(cfg, 0, "job") == log and log.parent.is_dir()
    web = tmp_path / "web.yml"
    web.write_text(BAD_WEB_CONFIG)
    with pytest.raises(ConfigError, match="tls_server_config"):
        check_start(parse_config({"prometheus": {"web_config_file": str(web)}}), 0, "job")


# ---------------------------------------------------------------- the machine, by trying
def _plain_yaml(tmp_path: Path, block: str) -> Path:
    path = tmp_path / "train.yaml"
    path.write_text(f"monitor_config:\n  {block}\n")
    return path


def test_a_directory_no_one_can_create_is_an_error_even_for_root(tmp_path):
    """As root, access() says /proc is writable; creating /proc/nope fails at start."""
    path = _plain_yaml(tmp_path, "output: {file: true, file_path: '/proc/nope/m_{rank}.log'}")
    report = check_file(path, ranks=1, env={})
    [error] = report.errors
    assert error.startswith(f"{path}: monitor_config.output.file_path: cannot create the "
                            "directory /proc/nope under /proc (No such file or directory)")
    assert "Fix: choose a writable path" in error
    with pytest.raises(ConfigError, match="cannot create directory /proc/nope"):
        check_start(parse_config({"output": {"file": True,
                                             "file_path": "/proc/nope/m_{rank}.log"}}), 0, "j")


def test_the_writable_check_creates_and_leaves_nothing(tmp_path):
    parent = tmp_path / "out"
    parent.mkdir()
    deep = _plain_yaml(tmp_path, f"output: {{file: true, file_path: '{parent}/a/b/m.log'}}")
    assert check_file(deep, ranks=1, env={}).errors == []
    flat = _plain_yaml(tmp_path, f"output: {{file: true, file_path: '{parent}/m.log'}}")
    assert check_file(flat, ranks=1, env={}).errors == []
    assert list(parent.iterdir()) == []     # no probe file, no probe directory, no log


def test_an_existing_log_that_cannot_be_opened_is_an_error(tmp_path):
    log = tmp_path / "m.log"
    log.write_text("earlier lines\n")
    path = _plain_yaml(tmp_path, f"output: {{file: true, file_path: '{log}'}}")
    assert check_file(path, ranks=1, env={}).errors == []
    assert log.read_text() == "earlier lines\n"   # opened for appending, nothing written
    path = _plain_yaml(tmp_path, "output: {file: true, file_path: /proc/self/status}")
    [error] = check_file(path, ranks=1, env={}).errors
    assert "/proc/self/status cannot be opened for writing" in error


def test_a_planned_port_in_use_is_a_warning_naming_rank_port_and_process(tmp_path):
    import socket
    with socket.create_server(("127.0.0.1", 0)) as held:
        taken = held.getsockname()[1]
        path = _plain_yaml(tmp_path, f"prometheus: {{host: 127.0.0.1, port: {taken - 1}}}")
        report = check_file(path, ranks=2, env={})
    assert report.errors == []
    # (only the held port: its neighbour may be anyone's on a shared machine)
    [warning] = [w for w in report.warnings if f"port {taken} on" in w]
    comm = Path("/proc/self/comm").read_text().strip()
    assert warning.startswith(f"{path}: monitor_config.prometheus.port: local rank 1 would serve "
                              f"port {taken} on 127.0.0.1, which is in use now "
                              f"(pid {os.getpid()}, {comm})")
    assert f"Fix: stop that process or move the ranks' range {taken - 1}..{taken}" in warning
    free = check_file(path, ranks=2, env={})   # the port freed up: nothing to say
    assert not [w for w in free.warnings if f"port {taken} on" in w]


def test_ports_of_another_machines_address_are_not_reported_in_use(tmp_path):
    path = _plain_yaml(tmp_path, "prometheus: {host: 192.0.2.1, port: 9464}")  # TEST-NET-1
    report = check_file(path, ranks=2, env={})
    assert report.errors == [] and not [w for w in report.warnings if "in use now" in w]


@pytest.mark.parametrize("ranks, fix", [
    (8, "use a base port of at most 65528"),
    (65000, "65000 ranks cannot each have a port on one node: check the ranks per node"),
])
def test_a_port_plan_past_the_last_port_gets_a_fix_that_can_be_followed(tmp_path, ranks, fix):
    path = _plain_yaml(tmp_path, "prometheus: {port: 65530}")
    [error] = check_file(path, ranks=ranks, env={}).errors
    assert fix in error and "at most -" not in error
