"""The tiny-Llama mindformers example run by the tests: its YAML with the issue's OTelMonitor
entry, and a run through `mfotel-instrument` scraped until it reports completed."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import yaml

from tests.support.metrics import samples, scrape, value
from tests.support.paths import ROOT
from tests.support.waiting import settle, wait_for

EXAMPLE = ROOT / "examples" / "mindformers"
STEPS = 20
JOB = "tiny-llama-e2e"
#: Measured here: importing mindformers 4-8 s, then ~10 s for 20 steps in graph mode.
RUN_SECONDS = 20.0


def issue_config(port: int) -> dict:
    """The example YAML with the issue's OTelMonitor entry, plus a loopback port and a linger."""
    config = yaml.safe_load((EXAMPLE / "tiny_llama_cpu.yaml").read_text())
    config["callbacks"] = [
        {"type": "MFLossMonitor"},
        {"type": "OTelMonitor", "step_interval": 10,
         "metrics": ["loss", "learning_rate", "grad_norm", "throughput", "step_time"],
         "output": {"console": True, "file": True,
                    "file_path": "./monitor_logs/train_monitor_{rank}.log"},
         "log_rank": 0, "job_name": JOB,
         "prometheus": {"host": "127.0.0.1", "port": port, "linger_seconds": 60}},
    ]
    dataset = config["train_dataset"]
    dataset["data_loader"]["num_samples"] = STEPS * dataset["batch_size"]
    return config


def issue_yaml(tmp_path: Path, port: int) -> Path:
    return write_yaml(tmp_path / "tiny_llama_issue.yaml", issue_config(port))


def write_yaml(path: Path, config: dict) -> Path:
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


class Trained(NamedTuple):
    snapshots: list[dict]   # every scrape while it ran, the last one with status completed
    info_log: str           # output/log/rank_0/info.log (MFLossMonitor's lines)
    console: str
    seconds: float


def train(tmp_path: Path, config: Path, port: int, every: float = 0.05) -> Trained:
    """Run the example with `config` in `tmp_path` through `mfotel-instrument`; scrape /metrics
    every `every` seconds until the run reports completed, then stop it (it lingers)."""
    # not imported here (it writes ./output); a test dependency: fail, never skip
    assert importlib.util.find_spec("mindformers"), 'pip install -e ".[mindformers]"'
    env = {k: v for k, v in os.environ.items() if k not in ("LOG_MF_PATH", "LOCAL_DEFAULT_PATH")}
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    env["MFOTEL_INSTRUMENT_DIR"] = str(tmp_path / "boot")
    env.setdefault("GLOG_v", "3")
    command = [str(Path(bin_dir, "mfotel-instrument")), sys.executable,
               str(EXAMPLE / "run_tiny_llama.py"), "--config", str(config)]
    url = f"http://127.0.0.1:{port}/metrics"
    snapshots: list[dict] = []
    started = time.monotonic()
    with open(tmp_path / "console.log", "w") as console:
        process = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=console,
                                   stderr=subprocess.STDOUT)
        def completed() -> bool:
            body = samples(scrape(url))  # OSError until it serves: not yet
            # until the run binds its port, another test's process may hold it (ports are
            # picked free, then bound ~100 s later: a scrape once read another job's step 1)
            status = value(body, "mindformers_train_status", job_name=JOB)
            if status is None:
                return False
            snapshots.append(body)
            return status == 2
        try:
            wait_for(completed, settle(RUN_SECONDS), every, "the run reporting completed",
                     alive=[process], ignore=(OSError,),
                     details=lambda: (tmp_path / "console.log").read_text(errors="replace")[-5000:])
        finally:
            seconds = time.monotonic() - started
            process.terminate()  # it lingers 60 s for scrapers; we have what we need
            process.wait(timeout=30)
    console_text = (tmp_path / "console.log").read_text(errors="replace")
    info_log = tmp_path / "output" / "log" / "rank_0" / "info.log"
    assert snapshots and info_log.exists(), console_text[-5000:]
    return Trained(snapshots, info_log.read_text(errors="replace"), console_text, seconds)
