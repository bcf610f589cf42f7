"""The `mfotel` command: check and demo, run as a user runs them (a subprocess)."""
from __future__ import annotations

import subprocess
from pathlib import Path
import sys

import pytest
import yaml


def mfotel(*args: str, cwd=None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mfotel", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout)


def test_check_prints_resolved_settings(tmp_path):
    path = tmp_path / "llama.yaml"
    path.write_text("monitor_config:\n  interval: 50\n  log_rank: -1\n")
    done = mfotel("check", str(path))
    assert done.returncode == 0, done.stderr
    resolved = yaml.safe_load(done.stdout)["monitor_config"]
    assert resolved["step_interval"] == 50 and resolved["log_rank"] == -1
    assert resolved["job_name"] == "llama" and resolved["prometheus"]["port"] == 9464


def test_check_fails_with_the_message(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("monitor_config:\n  metrics: [loss, gradnorm]\n")
    done = mfotel("check", str(path))
    assert done.returncode == 2
    assert f"{path}: monitor_config.metrics[1]: unknown metric 'gradnorm'" in done.stderr
    assert "did you mean 'grad_norm'" in done.stderr


@pytest.mark.slow
def test_demo_trains_and_shows_metrics(tmp_path, port):
    done = mfotel("demo", "--steps", "20", "--step-interval", "10", "--step-sleep", "0",
                  "--port", str(port), "--nan-at-step", "15", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [x for x in done.stdout.splitlines() if x.startswith("[Monitor]")]
    assert [x.split(",")[0] for x in lines] == ["[Monitor] step: 10", "[Monitor] step: 20"]
    assert "loss: nan" in lines[1]
    assert 'mindformers_train_loss_finite{job_name="mfotel-demo",rank="0"} 0.0' in done.stdout
    assert 'mindformers_train_first_nonfinite_step{job_name="mfotel-demo",rank="0"} 15.0' in done.stdout


def test_check_catches_mindformers_cpu_pitfall(tmp_path):
    text = (Path(__file__).parents[1] / "examples/mindformers/tiny_llama_cpu.yaml").read_text()
    assert "dump_path: ''" in text
    path = tmp_path / "bad_llama.yaml"
    path.write_text(text.replace("dump_path: ''", "dump_path: './dump'"))
    done = mfotel("check", "--no-mindformers", str(path))
    assert done.returncode == 2
    assert "dump_path" in done.stderr and str(path) in done.stderr
    ok = mfotel("check", "--no-mindformers",
                str(Path(__file__).parents[1] / "examples/mindformers/tiny_llama_cpu.yaml"))
    assert ok.returncode == 0, ok.stderr
