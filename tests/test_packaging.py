"""Packaging: the assets shipped in the package, the commands that write them, and a wheel
installed into a fresh venv outside the checkout.

The wheel test builds the wheel and the sdist with `python -m build` (pip fetches the build
backend and mfotel's few core dependencies from the package index; MindSpore is not
installed), then runs the installed `mfotel` in a temporary directory and validates what it
wrote with the real `promtool` and `prometheus-alertmanager`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tomllib
import urllib.request
import venv
import zipfile
from pathlib import Path

import pytest
import yaml

from mfotel import __version__, assets
from mfotel.alerting import rules
from mfotel.cli import main
from mfotel.demo.stack import Alertmanager, find_binary

ROOT = Path(__file__).resolve().parents[1]
RULE_FILES = sorted([rules.RECORDING_FILE, rules.ALERTS_FILE])
DASHBOARD_FILES = ["mfotel-cluster-health.json", "mfotel-parameter-health.json",
                   "mfotel-training-overview.json"]
PLAIN_EXAMPLE = ROOT / "examples" / "monitor_config.yaml"


def listing(directory: Path) -> list[str]:
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())


def binary(name: str, package: str) -> str:
    path = find_binary((name,))
    if path is None:
        pytest.fail(f"{name} not found on PATH; install it: apt-get install {package}")
    return path


# ---------------------------------------------------------------- the repository's copies
def test_repository_copies_are_what_the_package_writes(capsys):
    assert main(["assets", "--out", str(ROOT), "--check"]) == 0, capsys.readouterr().err
    for folder in ("prometheus/rules", "alertmanager", "grafana"):  # and nothing else
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


# ---------------------------------------------------------------- the commands
@pytest.mark.parametrize("command, expected", [
    ("rules", RULE_FILES),
    ("dashboards", DASHBOARD_FILES),
    ("alertmanager-config", ["alertmanager.yml", "templates/mfotel.tmpl"]),
    ("assets", sorted(["prometheus/prometheus.yml", "prometheus/runbook.md",
                       *(f"prometheus/rules/{n}" for n in RULE_FILES),
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
    assert "> 1800" in alerts and "stall_seconds=1800" in alerts
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


# ---------------------------------------------------------------- the wheel, installed
@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    built = subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)],
                           capture_output=True, text=True, timeout=900, cwd=out)
    if built.returncode != 0 and "No module named build" in built.stderr:
        pytest.fail("`build` is not installed: pip install 'mfotel[dev]'")
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def installed(dist, tmp_path_factory) -> Path:
    """A fresh venv outside the checkout with only the wheel (and its core dependencies)."""
    env_dir = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
    [wheel] = dist.glob("mfotel-*.whl")
    done = subprocess.run([str(env_dir / "bin" / "pip"), "install", "--quiet", str(wheel)],
                          capture_output=True, text=True, timeout=900, env=_clean_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return env_dir


def _clean_env() -> dict[str, str]:
    """The environment without the checkout on PYTHONPATH: the venv must use its own mfotel."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def _mfotel(installed: Path, workdir: Path, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([str(installed / "bin" / "mfotel"), *args], capture_output=True,
                          text=True, timeout=120, cwd=workdir, env=_clean_env())
    assert done.returncode == 0, f"mfotel {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
    return done


@pytest.mark.slow
def test_the_sdist_carries_the_assets_the_tests_and_the_examples(dist):
    [sdist] = dist.glob("mfotel-*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    for path in ("LICENSE", "pyproject.toml", "MANIFEST.in", "tests/test_packaging.py",
                 "tests/conftest.py", "prometheus/tests/recording.yml",
                 "examples/kubernetes/training-job.yaml", "examples/monitor_config.yaml",
                 *(f"mfotel/{p}" for p in _package_data())):
        assert path in names, path
    assert not [n for n in names if n.endswith(".pyc")]


def _package_data() -> list[str]:
    return ["alerting/prometheus/prometheus.yml", "alerting/prometheus/runbook.md",
            "alerting/alertmanager/alertmanager.yml",
            "alerting/alertmanager/templates/mfotel.tmpl",
            *(f"dashboards/grafana/dashboards/{n}" for n in DASHBOARD_FILES),
            "dashboards/grafana/provisioning/dashboards/mfotel.yml",
            "dashboards/grafana/provisioning/datasources/prometheus.yml",
            *(f"ui/static/{n}" for n in ("index.html", "app.js", "app.css", "vendor/README.md",
                                         "vendor/uPlot.iife.min.js", "vendor/uPlot.min.css",
                                         "vendor/LICENSE.uPlot.txt"))]


@pytest.mark.slow
def test_the_wheel_holds_the_package_data_and_an_spdx_license(dist):
    [wheel] = dist.glob("mfotel-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata = archive.read(f"mfotel-{__version__}.dist-info/METADATA").decode()
    assert {f"mfotel/{p}" for p in _package_data()} <= names
    assert not [n for n in names if n.startswith(("tests/", "prometheus/", "grafana/"))]
    assert "License-Expression: Apache-2.0" in metadata
    assert f"mfotel-{__version__}.dist-info/licenses/LICENSE" in names


@pytest.mark.slow
def test_a_fresh_venv_gets_a_working_product_from_the_wheel(installed, tmp_path):
    work = tmp_path / "work"   # outside the checkout
    work.mkdir()
    assert _mfotel(installed, work, "--version").stdout.strip() == f"mfotel {__version__}"
    # no MindSpore in this venv, and the installed mfotel is the one that runs
    probe = subprocess.run([str(installed / "bin" / "python"), "-c",
                            "import importlib.util, mfotel; "
                            "print(mfotel.__file__, importlib.util.find_spec('mindspore'))"],
                           capture_output=True, text=True, timeout=60, env=_clean_env(), cwd=work)
    where, mindspore = probe.stdout.split()
    assert Path(where).is_relative_to(installed) and mindspore == "None", probe.stderr

    _mfotel(installed, work, "rules", "--out", "rules")
    _mfotel(installed, work, "dashboards", "--out", "dashboards")
    _mfotel(installed, work, "alertmanager-config", "--out", "alertmanager")
    _mfotel(installed, work, "assets", "--out", "all")
    assert listing(work / "rules") == RULE_FILES
    assert listing(work / "dashboards") == DASHBOARD_FILES
    assert listing(work / "alertmanager") == ["alertmanager.yml", "templates/mfotel.tmpl"]
    assert listing(work / "all") == sorted(assets.all_files())
    for name in DASHBOARD_FILES:
        assert json.loads((work / "dashboards" / name).read_text())["uid"] == name[:-5]

    checked = _mfotel(installed, work, "check", str(PLAIN_EXAMPLE)).stdout
    assert f"# {PLAIN_EXAMPLE}: OK" in checked
    assert yaml.safe_load(checked.split("\n", 1)[1])["monitor_config"]["job_name"] == "llama7b-sft"

    promtool = binary("promtool", "prometheus")
    for argv in ([promtool, "check", "rules", *map(str, sorted((work / "rules").iterdir()))],
                 [promtool, "check", "config", str(work / "all" / "prometheus" / "prometheus.yml")]):
        result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "SUCCESS" in result.stdout

    am_dir = work / "alertmanager"
    amtool = binary("amtool", "prometheus-alertmanager")
    result = subprocess.run([amtool, "check-config", str(am_dir / "alertmanager.yml")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and " - 1 templates" in result.stdout.splitlines(), \
        result.stdout + result.stderr
    # and the real Alertmanager starts with it, the template loaded from beside the config
    with Alertmanager((am_dir / "alertmanager.yml").read_text(), workdir=am_dir) as server:
        with urllib.request.urlopen(f"{server.url}/api/v2/status", timeout=5) as response:
            status = json.loads(response.read())
    loaded = yaml.safe_load(status["config"]["original"])
    assert loaded["route"]["group_by"] == ["job_name", "alertname"]
    assert loaded["templates"] == [str(am_dir / "templates" / "*.tmpl")]  # resolved, loaded
    assert {r["name"] for r in loaded["receivers"]} == {"mfotel-pager", "mfotel-tickets"}
