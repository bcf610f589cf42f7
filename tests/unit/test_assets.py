"""The assets mfotel ships (rules, dashboards, Alertmanager and Grafana files): the repository's
copies are what the package writes, the commands that write them, and what the compose image
and the wheel need. A wheel built and installed into a fresh venv: tests/e2e/test_packaging.py.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import tomllib

from mfotel import __version__, assets
from mfotel.alerting import rule_tests, rules
from mfotel.cli import main
from tests.support.assets import DASHBOARD_FILES, RULE_FILES, listing
from tests.support.paths import ROOT


def test_repository_copies_are_what_the_package_writes(capsys):
    assert main(["assets", "--out", str(ROOT), "--check"]) == 0, capsys.readouterr().err
    for folder in ("prometheus/rules", "prometheus/tests", "alertmanager", "grafana"):
        copies = {f"{folder}/{name}" for name in listing(ROOT / folder)}
        assert copies <= set(assets.all_files()), f"{folder}/ holds files mfotel does not ship"


def test_shipped_dashboards_are_what_the_panel_modules_render():
    from mfotel.dashboards.build import PACKAGE_DATA, stale_files
    assert stale_files(ROOT / PACKAGE_DATA) == [], \
        "the dashboards JSON in the package is stale: run `make assets`"


def test_check_names_the_stale_copy_and_the_command_that_fixes_it(tmp_path, capsys):
    assert main(["assets", "--out", str(tmp_path)]) == 0
    stale = tmp_path / "alertmanager" / "alertmanager.yml"
    stale.write_text(stale.read_text() + "# edited by hand\n")
    assert main(["assets", "--out", str(tmp_path), "--check"]) == 1
    err = capsys.readouterr().err
    assert str(stale) in err and f"mfotel assets --out {tmp_path}" in err
    (tmp_path / "grafana" / "dashboards" / DASHBOARD_FILES[0]).unlink()
    assert main(["dashboards", "--out", str(tmp_path / "grafana" / "dashboards"), "--check"]) == 1


@pytest.mark.parametrize("command, expected", [
    ("rules", RULE_FILES),
    ("dashboards", DASHBOARD_FILES),
    ("alertmanager-config", ["alertmanager.yml", "templates/mfotel.tmpl"]),
    ("assets", sorted(["prometheus/prometheus.yml", "prometheus/runbook.md",
                       *(f"prometheus/rules/{n}" for n in RULE_FILES),
                       *(f"prometheus/tests/{n}" for n in rule_tests.templates()),
                       "alertmanager/alertmanager.yml", "alertmanager/templates/mfotel.tmpl",
                       *(f"grafana/dashboards/{n}" for n in DASHBOARD_FILES),
                       "grafana/provisioning/dashboards/mfotel.yml",
                       "grafana/provisioning/datasources/prometheus.yml"])),
])
def test_each_asset_command_writes_its_files_into_the_current_directory(
        command, expected, in_tmp, capsys):
    assert main([command]) == 0
    assert listing(in_tmp) == expected
    assert capsys.readouterr().out.count("wrote ") == len(expected)
    assert main([command, "--check"]) == 0


def test_rules_overrides_reach_the_written_files_and_the_check(tmp_path, capsys):
    assert main(["assets", "--out", str(tmp_path), "--set", "stall_seconds=1800"]) == 0
    alerts = (tmp_path / "prometheus" / "rules" / rules.ALERTS_FILE).read_text()
    recorded = (tmp_path / "prometheus" / "rules" / rules.RECORDING_FILE).read_text()
    # stall_for (2m) inside the stall threshold's expression (the stalled ranks' record)
    assert "> 1920" in recorded and "stall_seconds=1800" in alerts
    assert main(["rules", "--out", str(tmp_path / "prometheus" / "rules"), "--check"]) == 1
    assert main(["rules", "--out", str(tmp_path / "prometheus" / "rules"), "--check",
                 "--set", "stall_seconds=1800"]) == 0
    assert main(["rules", "--out", str(tmp_path), "--set", "stall_seconds=0"]) == 2
    assert "stall_seconds" in capsys.readouterr().err


def test_asset_commands_refuse_to_write_into_the_installed_package(capsys):
    package = Path(assets.__file__).parent / "alerting"
    before = listing(package)
    assert main(["rules", "--out", str(package)]) == 2
    assert "refusing to write into the installed package" in capsys.readouterr().err
    assert listing(package) == before


def test_version_flag_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"mfotel {__version__}"


def test_the_compose_image_gets_every_file_the_build_needs():
    """docker/trainer.Dockerfile runs `pip install .` on a copied subset of the checkout."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    needed = {"pyproject.toml", project["readme"], *project["license-files"]}
    dockerfile = (ROOT / "docker" / "trainer.Dockerfile").read_text()
    copied = {name for line in dockerfile.splitlines() if line.startswith("COPY ")
              for name in line.split()[1:-1]}
    allowed = {line[1:].rstrip("/") for line in
               (ROOT / "docker" / "trainer.Dockerfile.dockerignore").read_text().splitlines()
               if line.startswith("!")}
    assert needed <= copied and needed <= allowed, (needed, copied, allowed)
    assert "mfotel" in copied and "mfotel" in allowed


def test_the_wheel_declares_the_version_of_the_package():
    text = (ROOT / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in text and 'version = {attr = "mfotel.__version__"}' in text
