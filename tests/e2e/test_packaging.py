"""Packaging: the sdist and the wheel carry what they must, and the wheel installed into a fresh
venv outside the checkout gives a working product. The assets themselves and the commands
that write them: tests/unit/test_assets.py.

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
import venv
import zipfile
from pathlib import Path

import pytest
import yaml

from mfotel import __version__, assets
from mfotel.alerting import rule_tests
from mfotel.localstack.servers import Alertmanager, find_binary
from tests.support.assets import DASHBOARD_FILES, RULE_FILES, listing
from tests.support.http import get_json
from tests.support.paths import ROOT

PLAIN_EXAMPLE = ROOT / "examples" / "monitor_config.yaml"


def binary(name: str, package: str) -> str:
    path = find_binary((name,))
    if path is None:
        pytest.fail(f"{name} not found on PATH; install it: apt-get install {package}")
    return path


# ---------------------------------------------------------------- the commands


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
    for path in ("LICENSE", "pyproject.toml", "MANIFEST.in", "tests/e2e/test_packaging.py",
                 "tests/e2e/conftest.py", "tests/support/paths.py",
                 "prometheus/tests/recording.yml",
                 "examples/kubernetes/training-job.yaml", "examples/monitor_config.yaml",
                 *(f"mfotel/{p}" for p in _package_data())):
        assert path in names, path
    assert not [n for n in names if n.endswith(".pyc")]


def _package_data() -> list[str]:
    return ["alerting/prometheus/prometheus.yml", "alerting/prometheus/runbook.md",
            *(f"alerting/promtool_tests/{n}" for n in rule_tests.templates()),
            *(f"alerting/promtool_tests/{n}" for n in rule_tests.templates()),
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
    effective = yaml.safe_load(checked.split("\n", 1)[1])["monitor_config"]
    assert effective["job_name"] == "monitor_config"     # the file's stem: no job_name written

    promtool = binary("promtool", "prometheus")
    prometheus_yml = work / "all" / "prometheus" / "prometheus.yml"
    for argv in ([promtool, "check", "rules", *map(str, sorted((work / "rules").iterdir()))],
                 [promtool, "check", "config", str(prometheus_yml)]):
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
        status = get_json(f"{server.url}/api/v2/status")
    loaded = yaml.safe_load(status["config"]["original"])
    assert loaded["route"]["group_by"] == ["job_name", "alertname"]
    assert loaded["templates"] == [str(am_dir / "templates" / "*.tmpl")]  # resolved, loaded
    receivers = {r["name"]: r for r in loaded["receivers"]}
    assert set(receivers) == {"mfotel-none", "mfotel-pager", "mfotel-tickets"}
    # info alerts (they only mute others) are routed to a receiver that sends nothing
    assert set(receivers["mfotel-none"]) == {"name"}
    info_routes = [r for r in loaded["route"]["routes"]
                   if any("severity" in m and "info" in m for m in r.get("matchers", []))]
    assert [r["receiver"] for r in info_routes] == ["mfotel-none"]
