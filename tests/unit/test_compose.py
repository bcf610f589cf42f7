"""The docker compose stack and Grafana's provisioning, checked without Docker or Grafana.

No Grafana server and no Docker engine run here, so the compose stack itself is never started:
docker-compose.yml is validated against the Compose specification's JSON schema
(check-jsonschema), its Prometheus and Alertmanager configs with promtool and amtool, and its
commands with mfotel's own command-line parser.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.paths import ROOT

PROVISIONING = ROOT / "grafana" / "provisioning"
COMPOSE = ROOT / "docker-compose.yml"


COMPOSE_DATASOURCES = ROOT / "docker" / "grafana" / "datasources" / "prometheus.yml"


def test_datasource_provisioning_points_at_the_compose_prometheus():
    for path in (PROVISIONING / "datasources" / "prometheus.yml", COMPOSE_DATASOURCES):
        config = yaml.safe_load(path.read_text())
        assert config["apiVersion"] == 1
        sources = {s["type"]: s for s in config["datasources"]}
        prom = sources["prometheus"]
        assert prom["url"] == "http://prometheus:9090" and prom["access"] == "proxy"
        assert prom["isDefault"] is True
        assert sources["alertmanager"]["url"] == "http://alertmanager:9093"
        assert sum(1 for s in config["datasources"] if s.get("isDefault")) == 1


def _time_interval(path: Path) -> str:
    sources = yaml.safe_load(path.read_text())["datasources"]
    return next(s for s in sources if s["type"] == "prometheus")["jsonData"]["timeInterval"]


def _scrape_interval(path: Path) -> str:
    return yaml.safe_load(path.read_text())["global"]["scrape_interval"]


def test_grafana_time_interval_is_the_scrape_interval_of_the_prometheus_it_reads():
    """$__rate_interval is sized from the data source's timeInterval: it must be the scrape
    interval of the Prometheus shipped beside it (15s), and the compose stack's (5s)."""
    from mfotel import assets
    shipped = {name: content.decode() for name, content in assets.all_files().items()}
    scrape = yaml.safe_load(shipped["prometheus/prometheus.yml"])["global"]["scrape_interval"]
    interval = next(s for s in yaml.safe_load(
        shipped["grafana/provisioning/datasources/prometheus.yml"])["datasources"]
        if s["type"] == "prometheus")["jsonData"]["timeInterval"]
    assert interval == scrape == "15s"
    assert _time_interval(PROVISIONING / "datasources" / "prometheus.yml") == \
        _scrape_interval(ROOT / "prometheus" / "prometheus.yml") == "15s"
    assert _time_interval(COMPOSE_DATASOURCES) == \
        _scrape_interval(ROOT / "docker" / "prometheus.yml") == "5s"
    # the compose copy is the shipped file but for its interval (and comments)
    compose = yaml.safe_load(COMPOSE_DATASOURCES.read_text())
    original = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())
    next(s for s in compose["datasources"] if s["type"] == "prometheus")["jsonData"][
        "timeInterval"] = "15s"
    assert compose == original
    mounts = _compose()["services"]["grafana"]["volumes"]
    assert "./docker/grafana/datasources:/etc/grafana/provisioning/datasources:ro" in mounts
    docs = (ROOT / "docs" / "docker-compose.md").read_text()
    assert "`timeInterval: 15s`" in docs and "`timeInterval: 5s`" in docs


def test_dashboard_provider_reads_the_mounted_dashboards():
    config = yaml.safe_load((PROVISIONING / "dashboards" / "mfotel.yml").read_text())
    assert config["apiVersion"] == 1
    (provider,) = config["providers"]
    assert provider["type"] == "file" and provider["folder"]
    mounts = _compose()["services"]["grafana"]["volumes"]
    assert f"./grafana/dashboards:{provider['options']['path']}:ro" in mounts
    assert "./grafana/provisioning/dashboards:/etc/grafana/provisioning/dashboards:ro" in mounts


def _compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_file_is_valid_against_the_compose_spec():
    """check-jsonschema's vendored Compose specification schema. No Docker engine runs here,
    so the stack itself is not started (`docker compose config` is not available either)."""
    exe = Path(sys.executable).with_name("check-jsonschema")
    command = [str(exe) if exe.exists() else shutil.which("check-jsonschema") or "",
               "--builtin-schema", "vendor.compose-spec", str(COMPOSE)]
    if not command[0]:
        pytest.fail("check-jsonschema is not installed (pip install 'mfotel[dev]')")
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_has_the_whole_stack():
    services = _compose()["services"]
    assert set(services) == {"trainer", "alerts-receiver", "prometheus", "alertmanager",
                             "grafana"}
    assert services["trainer"]["build"]["dockerfile"] == "docker/trainer.Dockerfile"
    assert "mfotel demo" in " ".join(services["trainer"]["command"])
    receiver = services["alerts-receiver"]["command"]
    assert receiver[:2] == ["mfotel", "alerts-receiver"] and "9095" in receiver
    assert any("prometheus/rules" in v for v in services["prometheus"]["volumes"])


def test_compose_pins_every_image_version():
    for name, service in _compose()["services"].items():
        image = service["image"]
        repo, _, tag = image.rpartition(":")
        assert repo and tag and tag != "latest" and any(c.isdigit() for c in tag), (name, image)
    dockerfile = (ROOT / "docker" / "trainer.Dockerfile").read_text()
    base = next(line.split()[1] for line in dockerfile.splitlines() if line.startswith("FROM "))
    assert base.startswith("python:3.11") and base != "python:3.11-slim", base


def test_compose_publishes_ports_on_loopback_only():
    compose = _compose()
    for name, service in compose["services"].items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), (name, port)
        if service.get("ports"):
            continue
        # services without published ports live on the internal network only
        assert set(service["networks"]) == {"backend"}, name
    assert compose["networks"]["backend"]["internal"] is True


def test_compose_mounts_files_that_exist():
    for name, service in _compose()["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), (name, source)


def test_compose_prometheus_config_is_valid_and_scrapes_the_trainer():
    config = yaml.safe_load((ROOT / "docker" / "prometheus.yml").read_text())
    targets = [t for job in config["scrape_configs"] for sc in job["static_configs"]
               for t in sc["targets"]]
    assert "trainer:9464" in targets
    assert config["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == \
        ["alertmanager:9093"]
    promtool = shutil.which("promtool") or shutil.which("promtool", path="/usr/bin")
    assert promtool, "promtool not installed: apt-get install prometheus"
    result = subprocess.run([promtool, "check", "config", str(ROOT / "docker" / "prometheus.yml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_alertmanager_config_is_the_example_with_the_receiver_service():
    example_path = ROOT / "alertmanager" / "alertmanager.yml"
    assert example_path.exists(), "alertmanager/alertmanager.yml is missing"
    example = yaml.safe_load(example_path.read_text())
    compose = yaml.safe_load((ROOT / "docker" / "alertmanager.yml").read_text())
    urls = [w["url"] for r in compose["receivers"] for w in r.get("webhook_configs", [])]
    assert urls and all(u.startswith("http://alerts-receiver:9095/") for u in urls)
    for receiver in example["receivers"]:
        for hook in receiver.get("webhook_configs", []):
            hook["url"] = hook["url"].replace("http://127.0.0.1:9095",
                                              "http://alerts-receiver:9095")
    assert compose == example, "docker/alertmanager.yml drifted from alertmanager/alertmanager.yml"
    amtool = shutil.which("amtool") or shutil.which("amtool", path="/usr/bin")
    if amtool:
        result = subprocess.run([amtool, "check-config", str(ROOT / "docker" / "alertmanager.yml")],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr


def test_trainer_image_installs_the_package_with_the_mindspore_extra():
    dockerfile = (ROOT / "docker" / "trainer.Dockerfile").read_text()
    assert 'pip install ".[mindspore]"' in dockerfile
    assert "USER mfotel" in dockerfile
    ignore = [line for line in (ROOT / "docker" / "trainer.Dockerfile.dockerignore")
              .read_text().splitlines() if line and not line.startswith("#")]
    assert ignore[0] == "*" and "!mfotel/" in ignore


def test_trainer_image_copies_files_that_exist():
    for line in (ROOT / "docker" / "trainer.Dockerfile").read_text().splitlines():
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), f"docker/trainer.Dockerfile copies {source}"


def _cli_parse(argv: list[str]):
    """Parse `mfotel ARGV` with the real command-line parser (alerts-receiver may be wired into
    the CLI or not yet: then its own parser)."""
    from mfotel import cli
    try:
        return cli.build_parser().parse_args(argv)
    except SystemExit:
        if argv[0] != "alerts-receiver":
            raise
    import argparse

    from mfotel.alerting.receiver import add_arguments
    return add_arguments(argparse.ArgumentParser()).parse_args(argv[1:])


def test_compose_commands_are_accepted_by_the_cli():
    import shlex
    services = _compose()["services"]
    script = services["trainer"]["command"][-1]
    assert script.startswith("exec mfotel demo ")
    base, _, nan_part = script.removeprefix("exec mfotel ").partition("$${")
    args = _cli_parse(shlex.split(base))
    assert (args.host, args.port, args.job_name) == ("0.0.0.0", 9464, "compose-demo")
    assert args.steps * args.step_sleep >= 1800, "the demo should run long enough to watch"
    assert "--nan-at-step" in nan_part
    assert _cli_parse(shlex.split(base) + ["--nan-at-step", "300"]).nan_at_step == 300
    receiver = services["alerts-receiver"]["command"]
    args = _cli_parse(receiver[1:])
    assert (args.host, args.port) == ("0.0.0.0", 9095)
    dockerfile = (ROOT / "docker" / "trainer.Dockerfile").read_text()
    cmd = json.loads(dockerfile[dockerfile.index("CMD [") + 4:].replace("\\\n", ""))
    assert cmd[0] == "mfotel" and _cli_parse(cmd[1:]).host == "0.0.0.0"
