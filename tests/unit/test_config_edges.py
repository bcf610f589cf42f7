"""Values `mfotel check` used to accept and the run could not live with.

Paths no file system can hold (`"\\0"`), numbers below what the run survives (4.9e-324 s push
intervals, a 4.9e-324/s auth rate), launcher variables that are not ranks (`-1`, 23 digits,
`٣`, rank 3 of 2): refused by `mfotel check` (a subprocess, as a user runs it) and at the
callback's start, naming the key or variable, the value and the fix.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mfotel.config import ConfigError, json_schema, parse_config

TINY = "4.9e-324"   # the smallest positive float


def check(tmp_path: Path, text: str, **env: str) -> subprocess.CompletedProcess:
    path = tmp_path / "train.yaml"
    path.write_text(text)
    return subprocess.run([sys.executable, "-m", "mfotel", "check", str(path)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, **env})


# ---------------------------------------------------------------- paths
PATH_KEYS = ["output.file_path", "actions.control_dir", "run.state_file", "file_sd.path",
             "prometheus.certfile", "prometheus.keyfile", "prometheus.web_config_file"]


def test_check_refuses_a_nul_in_every_path_key(tmp_path):
    done = check(tmp_path, """monitor_config:
  output: {file: true, file_path: "\\0"}
  actions: {control_dir: "/ctl/\\0/{job_name}"}
  run: {state_file: "./s\\0_{rank}.json"}
  file_sd: {path: "/sd/\\0.json"}
  prometheus: {certfile: "c\\0.pem", keyfile: "k\\0.pem", web_config_file: "w\\0.yml"}
""")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    for key in PATH_KEYS:
        line = next(x for x in done.stderr.splitlines() if f"monitor_config.{key}: " in x)
        assert "contains a NUL character (\\0). Fix: remove it" in line, line
    assert "# " in done.stderr and "7 error(s)" in done.stderr


@pytest.mark.parametrize("value, problem", [
    ("./" + "x" * 256 + ".log", "has a name longer than the 255 bytes a file name may have"),
    ("./" + "é/" * 1400 + "m.log", "is longer than the 4095 bytes a path may have"),
    ("./m_\ud800.log", "cannot be written as a file name on this system"),
])
def test_paths_past_the_file_systems_limits_are_refused(value, problem):
    with pytest.raises(ConfigError) as error:
        parse_config({"output": {"file_path": value}})
    assert problem in str(error.value) and error.value.key == "monitor_config.output.file_path"


def test_a_nul_in_any_text_or_url_is_refused():
    for block, key in (({"prometheus": {"host": "127.0.0.1\0"}}, "prometheus.host"),
                       ({"run": {"id": "r\0"}}, "run.id"),
                       ({"alertmanager_url": "http://am\0:9093"}, "alertmanager_url"),
                       ({"otlp": {"endpoint": "http://c:4318/\x07"}}, "otlp.endpoint")):
        with pytest.raises(ConfigError) as error:
            parse_config(block)
        assert error.value.key == f"monitor_config.{key}"


# ---------------------------------------------------------------- numbers
def test_check_refuses_numbers_below_what_the_run_can_live_with(tmp_path):
    done = check(tmp_path, f"""monitor_config:
  prometheus: {{auth_failures_per_second: {TINY}, request_timeout_seconds: 0.001}}
  otlp: {{endpoint: "http://127.0.0.1:4318", interval_seconds: {TINY}, timeout_seconds: {TINY}}}
  peak_flops: {TINY}
  flops_per_token: 0.5
  actions: {{nonfinite: {{action: scale_lr, factor: {TINY}}}, lead_steps: 100001}}
""")
    assert done.returncode == 2
    lines = done.stderr.splitlines()

    def error(key: str) -> str:
        return next(x for x in lines if f"monitor_config.{key}: " in x)
    assert "is not a positive number >= 0.01 and <= 1000" in error(
        "prometheus.auth_failures_per_second")
    assert "Retry-After is 1/rate" in error("prometheus.auth_failures_per_second")
    assert "is not a positive number of seconds >= 1 and <= 86400" in error("otlp.interval_seconds")
    assert "at least 1 s: a push holds the training process's GIL" in error(
        "otlp.interval_seconds")
    assert ">= 1 and <= 3600" in error("otlp.timeout_seconds")
    assert ">= 1 and <= 3600" in error("prometheus.request_timeout_seconds")
    assert "the MFU overflow" in error("peak_flops") and ">= 1" in error("flops_per_token")
    assert ">= 1e-06 and <= 100" in error("actions.nonfinite.factor")
    assert "between 1 and 100000" in error("actions.lead_steps")


@pytest.mark.parametrize("block, key", [
    ({"otlp": {"interval_seconds": 0.001}}, "otlp.interval_seconds"),   # 1.6x longer, silently
    ({"otlp": {"interval_seconds": 0.999}}, "otlp.interval_seconds"),
    ({"otlp": {"timeout_seconds": 0.5}}, "otlp.timeout_seconds"),
    ({"prometheus": {"auth_failures_per_second": 0.001}}, "prometheus.auth_failures_per_second"),
])
def test_just_below_a_floor_is_refused_and_the_floor_itself_accepted(block, key):
    with pytest.raises(ConfigError) as error:
        parse_config(block)
    assert error.value.key == f"monitor_config.{key}"
    section, leaf = key.split(".")
    floor = {"interval_seconds": 1, "timeout_seconds": 1, "auth_failures_per_second": 0.01}[leaf]
    assert getattr(getattr(parse_config({section: {leaf: floor}}), section), leaf) == floor


def test_the_schema_shows_each_floor_and_why():
    properties = json_schema("block")["properties"]
    otlp, prom = properties["otlp"]["properties"], properties["prometheus"]["properties"]
    assert (otlp["interval_seconds"]["minimum"], otlp["timeout_seconds"]["minimum"]) == (1, 1)
    assert prom["auth_failures_per_second"]["minimum"] == 0.01
    assert "exclusiveMinimum" not in prom["auth_failures_per_second"]
    assert "at least 1 s" in otlp["interval_seconds"]["description"]
    assert "Retry-After" in prom["auth_failures_per_second"]["description"]
    assert properties["actions"]["properties"]["lead_steps"]["maximum"] == 100_000


def test_control_requests_share_the_factor_bounds_of_the_rules(tmp_path, capsys):
    from mfotel.actions.control import main
    assert main([str(tmp_path), "--scale-lr", "1e-300"]) == 2
    assert "positive factor from 1e-06 to 100" in capsys.readouterr().err
    assert main([str(tmp_path), "--scale-lr", "1e-6"]) == 0


# ---------------------------------------------------------------- launcher variables
@pytest.mark.parametrize("env, message", [
    ({"RANK_ID": "-1"}, "RANK_ID='-1' is not a valid rank (ASCII digits, 0 to 999999)"),
    ({"RANK_ID": "1" * 23}, f"RANK_ID='{'1' * 23}' is not a valid rank"),
    ({"RANK_ID": "٣"}, "RANK_ID='٣' is not a valid rank"),
    ({"RANK_ID": "3", "RANK_SIZE": "2"}, "RANK_ID=3 is not below RANK_SIZE=2"),
    ({"LOCAL_RANK": "70000"}, "LOCAL_RANK='70000' is not a valid local rank"),
])
def test_check_refuses_launcher_variables_that_are_not_ranks(tmp_path, monkeypatch, capsys,
                                                            env, message):
    from mfotel.cli import main
    path = tmp_path / "train.yaml"
    path.write_text("monitor_config: {step_interval: 5}\n")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"error: the launcher's environment: {next(iter(env))}: {message}" in err
    assert "Fix: " in err and "base port of at most -" not in err


# ---------------------------------------------------------------- redaction
def test_check_masks_attribute_and_label_values_named_like_secrets(tmp_path):
    done = check(tmp_path, """monitor_config:
  resource_attributes: {db.password: hunter2-attr, api_token: tok-attr, team: nlp}
  file_sd: {labels: {password: hunter2-label, cluster: a}}
""", OTEL_RESOURCE_ATTRIBUTES="vendor.secret=env-secret,region=eu")
    assert done.returncode == 0, done.stderr
    for secret in ("hunter2-attr", "tok-attr", "hunter2-label", "env-secret"):
        assert secret not in done.stdout + done.stderr
    assert "db.password: '***'" in done.stdout and "password: '***'" in done.stdout
    for shown in ("team: nlp", "cluster: a", "region: eu"):
        assert shown in done.stdout


def test_errors_do_not_show_a_value_named_like_a_secret(tmp_path):
    done = check(tmp_path, """monitor_config:
  resource_attributes: {auth_token: [hunter2-in-a-list], team: [nlp-in-a-list]}
""")
    assert done.returncode == 2
    assert "hunter2" not in done.stderr
    assert "monitor_config.resource_attributes.auth_token: the value is not a text" in done.stderr
    assert "nlp-in-a-list" in done.stderr   # not a secret's name: shown, to help fix it
