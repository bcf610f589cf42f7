"""The `mfotel` command: check and demo, run as a user runs them (a subprocess)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.cli import mfotel
from tests.support.paths import ROOT


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


def test_check_catches_mindformers_cpu_pitfall(tmp_path):
    text = (ROOT / "examples/mindformers/tiny_llama_cpu.yaml").read_text()
    assert "dump_path: ''" in text
    path = tmp_path / "bad_llama.yaml"
    path.write_text(text.replace("dump_path: ''", "dump_path: './dump'"))
    done = mfotel("check", "--no-mindformers", str(path))
    assert done.returncode == 2
    assert "dump_path" in done.stderr and str(path) in done.stderr
    ok = mfotel("check", "--no-mindformers",
                str(ROOT / "examples/mindformers/tiny_llama_cpu.yaml"))
    assert ok.returncode == 0, ok.stderr


# ---------------------------------------------------------------- mfotel check
def write_yaml(tmp_path, text: str, name: str = "train.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_check_reports_every_error_at_once(tmp_path):
    path = write_yaml(tmp_path, "monitor_config:\n  step_interval: 0\n  metrics: [loss, lr]\n"
                                "  output: {consol: true}\n  job_name: ../esc\n")
    done = mfotel("check", str(path))
    assert done.returncode == 2 and done.stdout == ""
    errors = [x for x in done.stderr.splitlines() if x.startswith("error: ")]
    assert [e.split(": ")[2] for e in errors] == [
        "monitor_config.step_interval", "monitor_config.metrics[1]",
        "monitor_config.output.consol", "monitor_config.job_name"]
    assert all(f"error: {path}: " in e and ". Fix: " in e for e in errors)
    assert "Traceback" not in done.stderr


def test_plain_check_is_quiet_and_imports_neither_mindspore_nor_mindformers(tmp_path):
    path = write_yaml(tmp_path, "monitor_config:\n  step_interval: 5\n")
    code = ("import sys\nfrom mfotel.cli import main\n"
            f"status = main(['check', {str(path)!r}])\n"
            "heavy = sorted(m for m in sys.modules\n"
            "               if m.split('.')[0] in ('mindspore', 'mindformers'))\n"
            "print('heavy:', heavy, 'status:', status)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.splitlines()[-1] == "heavy: [] status: 0", done.stderr
    assert done.stderr == ""


def test_check_redacts_secrets_in_the_resolved_settings(tmp_path):
    path = write_yaml(tmp_path, "monitor_config:\n  otlp:\n"
                                "    endpoint: http://trainer:hunter2@collector:4318\n"
                                "    headers: {authorization: Bearer tok-123}\n"
                                "  alertmanager_url: https://am:pw-456@am:9093\n")
    done = mfotel("check", str(path))
    assert done.returncode == 0, done.stderr
    for secret in ("hunter2", "tok-123", "pw-456"):
        assert secret not in done.stdout + done.stderr
    resolved = yaml.safe_load(done.stdout)["monitor_config"]
    assert resolved["otlp"]["endpoint"] == "http://trainer:***@collector:4318/v1/metrics"
    assert resolved["otlp"]["headers"] == {"authorization": "***"}


def test_check_shows_settings_taken_from_the_environment(tmp_path):
    path = write_yaml(tmp_path, "monitor_config:\n  step_interval: 5\n")
    env = {**os.environ, "OTEL_SERVICE_NAME": "svc-x", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
           "OTEL_METRIC_EXPORT_INTERVAL": "soon"}
    done = subprocess.run([sys.executable, "-m", "mfotel", "check", str(path)], capture_output=True,
                          text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert "# job_name: from OTEL_SERVICE_NAME" in done.stdout
    assert "# otlp.endpoint: from OTEL_EXPORTER_OTLP_ENDPOINT" in done.stdout
    resolved = yaml.safe_load(done.stdout)["monitor_config"]
    assert resolved["job_name"] == "svc-x" and resolved["otlp"]["endpoint"] == "http://c:4318/v1/metrics"
    assert "warning: environment: OTEL_METRIC_EXPORT_INTERVAL: 'soon'" in done.stderr


def test_check_fails_on_an_output_directory_that_cannot_be_created(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where a directory should be")
    path = write_yaml(tmp_path, "monitor_config:\n  output:\n    file: true\n"
                                f"    file_path: {blocker}/logs/m_{{rank}}.log\n")
    done = mfotel("check", str(path))
    assert done.returncode == 2
    assert f"monitor_config.output.file_path: {blocker} is not a directory" in done.stderr
    assert not (blocker.parent / "logs").exists()  # check creates nothing


@pytest.mark.parametrize("block, ranks, words", [
    ("prometheus: {port: 65530}", "8", "8 ranks per node serve ports 65530..65537"),
    ("prometheus: {port: 9464}\n  alertmanager_url: http://127.0.0.1:9466", "4",
     "local rank 2 would serve port 9466, which monitor_config.alertmanager_url uses"),
    ("file_sd: {path: ./sd.json, hosts: [n1]}", "8",
     "file_sd.hosts: 1 hosts x 8 ranks per node is fewer than the 16 ranks of the job"),
])
def test_check_refuses_a_port_plan_that_cannot_work(tmp_path, block, ranks, words):
    path = write_yaml(tmp_path, f"monitor_config:\n  {block}\n")
    done = mfotel("check", "--ranks-per-node", ranks, "--world-size", "16", str(path),
                  cwd=tmp_path)
    assert done.returncode == 2 and words in done.stderr, done.stderr


def test_check_warns_about_an_otlp_path_collectors_do_not_serve(tmp_path):
    path = write_yaml(tmp_path, "monitor_config:\n  otlp: {endpoint: 'http://c:4318/v1/metric'}\n")
    done = mfotel("check", str(path))
    assert done.returncode == 0
    assert "otlp.endpoint: pushes to the path '/v1/metric' as written" in done.stderr


def test_check_reports_the_port_plan(tmp_path):
    path = write_yaml(tmp_path, "monitor_config:\n  prometheus: {port: 9088}\n")
    done = mfotel("check", "--ranks-per-node", "8", str(path))
    assert done.returncode == 0
    assert "# ports: the 8 ranks of a node serve 9088..9095 (--ranks-per-node)" in done.stdout
    assert "include 9090, Prometheus's default port" in done.stderr


def test_check_diagnoses_a_mindformers_yaml_without_the_callback_entry(tmp_path):
    text = (ROOT / "examples/mindformers/tiny_llama_cpu.yaml").read_text()
    path = write_yaml(tmp_path, text.replace("  - type: OTelMonitor\n", "  - type: OTelMonitr\n"),
                      "llama.yaml")
    done = mfotel("check", "--no-mindformers", str(path))
    assert done.returncode == 2
    assert "callbacks[1].type: 'OTelMonitr' is not a callback mfotel registers" in done.stderr
    assert "did you mean 'OTelMonitor'" in done.stderr
    assert "dump_path" not in done.stderr


def test_check_refuses_a_config_bomb_quickly(tmp_path):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)]
    path = write_yaml(tmp_path, "\n".join(lines) + "\nmonitor_config: {job_name: *a8}\n")
    done = mfotel("check", str(path), timeout=60)
    assert done.returncode == 2 and "expands to more than" in done.stderr


def test_check_warns_about_a_planned_port_another_process_listens_on(tmp_path):
    import socket
    with socket.create_server(("127.0.0.1", 0)) as held:
        taken = held.getsockname()[1]
        path = write_yaml(tmp_path, f"monitor_config:\n  prometheus: {{host: 127.0.0.1, "
                                    f"port: {taken}}}\n")
        done = mfotel("check", "--ranks-per-node", "1", str(path))
    assert done.returncode == 0, done.stderr          # a warning: the port may free up
    assert (f"warning: {path}: monitor_config.prometheus.port: local rank 0 would serve port "
            f"{taken} on 127.0.0.1, which is in use now (pid {os.getpid()}, ") in done.stderr


def test_check_refuses_a_file_path_root_cannot_create(tmp_path):
    path = write_yaml(tmp_path, "monitor_config:\n  output: {file: true, "
                                "file_path: '/proc/nope/m_{rank}.log'}\n")
    done = mfotel("check", str(path))
    assert done.returncode == 2
    assert "monitor_config.output.file_path: cannot create the directory /proc/nope" in done.stderr


@pytest.mark.parametrize("ranks", ["70000", "0", "-3", "eight"])
def test_check_bounds_ranks_per_node(tmp_path, ranks):
    path = write_yaml(tmp_path, "monitor_config:\n  step_interval: 5\n")
    done = mfotel("check", "--ranks-per-node", ranks, str(path))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert (f"argument --ranks-per-node: {ranks!r} is not a number of ranks on one node between "
            "1 and 64512") in done.stderr
    assert "at most -" not in done.stderr


def test_check_says_which_key_beat_which_variable(tmp_path):
    path = write_yaml(tmp_path, "monitor_config:\n  otlp: {endpoint: null}\n"
                                "  prometheus: {port: 0}\n")
    env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": "http://u:s3cret@c:4318",
           "OTEL_METRICS_EXPORTER": "prometheus,otlp"}
    done = subprocess.run([sys.executable, "-m", "mfotel", "check", str(path)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    lines = [x for x in done.stderr.splitlines() if " is set but " in x]
    assert lines == [
        f"warning: OTEL_EXPORTER_OTLP_ENDPOINT=http://u:***@c:4318 is set but "
        f"monitor_config.otlp.endpoint: null ({path}) wins: the push is off. Fix: remove "
        f"otlp.endpoint from monitor_config to let the variable through, or unset "
        f"OTEL_EXPORTER_OTLP_ENDPOINT",
        f"warning: OTEL_METRICS_EXPORTER=otlp,prometheus is set but "
        f"monitor_config.prometheus.port: 0 ({path}) wins: the /metrics endpoint is off. Fix: "
        f"remove prometheus.port from monitor_config to let the variable through, or unset "
        f"OTEL_METRICS_EXPORTER",
        f"warning: OTEL_METRICS_EXPORTER=otlp,prometheus is set but "
        f"monitor_config.otlp.endpoint: null ({path}) wins: the push is off. Fix: remove "
        f"otlp.endpoint from monitor_config to let the variable through, or unset "
        f"OTEL_METRICS_EXPORTER"]
    assert "s3cret" not in done.stdout + done.stderr
