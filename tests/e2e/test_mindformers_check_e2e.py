"""`mfotel check` on mindformers YAMLs with the real mindformers imported: its own validation of
the native monitor_config, and a quiet command that leaves no ./output behind. The checks without
mindformers: tests/unit/test_mindformers_check.py."""
from __future__ import annotations

import os

import pytest

from mfotel.integrations.mindformers_check import check_mindformers_yaml
from tests.support.cli import mfotel
from tests.support.paths import ROOT

EXAMPLE = ROOT / "examples" / "mindformers" / "tiny_llama_cpu.yaml"


@pytest.mark.slow
def test_native_validation_through_mindformers(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # before mindformers is imported: it logs to ./output otherwise
    monkeypatch.setenv("LOG_MF_PATH", str(tmp_path / "mf-log"))
    import mindformers  # noqa: F401 - a test dependency: fail, never skip
    from mindformers.tools.register.template import MonitorConfig

    from mfotel.config.settings import NATIVE_MONITOR_KEYS
    assert tuple(MonitorConfig.keys()) == NATIVE_MONITOR_KEYS  # the kept copy is mindformers' own
    path = tmp_path / "run.yaml"
    path.write_text("monitor_config: {monitor_on: True, dump_path: '', "
                    "optimizer_state_format: logg, target: layers}\n"
                    "callbacks: [{type: MFLossMonitor}, {type: OTelMonitor, step_interval: 10}]\n")
    problem, = check_mindformers_yaml(path)
    assert "(mindformers' TrainingStateMonitor)" in problem
    assert check_mindformers_yaml(EXAMPLE) == []
    assert not (tmp_path / "output").exists()


@pytest.mark.slow
def test_mindformers_check_is_quiet(tmp_path):
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "LOG_MF_PATH"}
    done = mfotel("check", str(EXAMPLE), cwd=tmp_path, env={**env, "TMPDIR": str(temporary)})
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""                 # no mindformers / MindSpore warnings
    assert not (tmp_path / "output").exists()  # mindformers' log went elsewhere
    # ... to a temporary directory that the check removed at its exit
    assert not list(temporary.glob("mfotel-check-mindformers-log-*"))
    assert "callbacks[1] (type: OTelMonitor)" in done.stdout
