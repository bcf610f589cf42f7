"""Files mfotel reads or writes at start that a FIFO (or a directory) could replace: the monitor
log, the run-state file, the endpoint's web-config. Each is refused or skipped before it can
block training, and `mfotel check` reports it as the start would."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from mfotel.cluster.discovery import FileSdWriter
from mfotel.config import ConfigError, RunConfig, parse_config
from mfotel.config.preflight import check_writable
from mfotel.identity import RankIdentity, start_run
from tests.support.endpoint import make_pki


def check(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mfotel", "check", str(path)],
                          capture_output=True, text=True, timeout=120)


def test_a_fifo_at_the_monitor_file_path_is_a_config_error(tmp_path):
    fifo = tmp_path / "m.log"
    os.mkfifo(fifo)
    cfg = parse_config({"output": {"file": True, "file_path": str(fifo)}}, source="t.yaml")
    with pytest.raises(ConfigError, match=r"output.file_path.*not a regular file"):
        check_writable(cfg, 0, "job")
    yaml_file = tmp_path / "t.yaml"
    yaml_file.write_text(f"monitor_config:\n  output: {{file: true, file_path: '{fifo}'}}\n")
    done = check(yaml_file)
    assert done.returncode == 2
    assert "monitor_config.output.file_path" in done.stderr and "not a regular file" in done.stderr


def test_a_fifo_at_the_run_state_file_does_not_block_the_start(tmp_path):
    fifo = tmp_path / "state.json"
    os.mkfifo(fifo)
    result: dict = {}
    thread = threading.Thread(target=lambda: result.setdefault(
        "run", start_run(RunConfig(state_file=str(fifo)), 0, "job", env={})), daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), "start_run blocked on a FIFO"
    assert result["run"].attempt == 1                  # nothing usable was read
    state = json.loads(fifo.read_text())               # replaced by a regular state file
    assert state["status"] == "running" and state["run_id"] == result["run"].run_id


def test_check_loads_the_web_config_file_as_the_start_does(tmp_path):
    web = tmp_path / "web.yml"
    web.write_text("tls_server_config:\n  cert_file: missing.crt\n  key_file: missing.key\n")
    config = tmp_path / "t.yaml"
    config.write_text(f"monitor_config:\n  prometheus: {{web_config_file: '{web}'}}\n")
    done = check(config)
    assert done.returncode == 2, done.stdout
    assert "monitor_config.prometheus.web_config_file" in done.stderr
    assert "tls_server_config" in done.stderr  # the certificate cannot be loaded


def test_file_sd_targets_are_https_when_tls_comes_from_a_web_config_file(tmp_path):
    pki = make_pki(tmp_path)
    web = tmp_path / "web.yml"
    web.write_text(f"tls_server_config:\n  cert_file: {pki.cert('server')}\n"
                   f"  key_file: {pki.key('server')}\n")
    cfg = parse_config({"prometheus": {"port": 9464, "web_config_file": str(web)},
                        "file_sd": {"path": str(tmp_path / "{job_name}.json")}}, source="t")
    path = FileSdWriter(cfg, RankIdentity(node="n1"), "j").write()
    assert json.loads(path.read_text())[0]["labels"]["__scheme__"] == "https"
