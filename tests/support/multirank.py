"""Helpers of the multi-rank tests: launch ranks, poll their endpoints, wait on Prometheus."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from mfotel.localstack.servers import free_port, free_port_block  # noqa: F401 (tests import them from here)
from tests.support.metrics import samples, scrape
from tests.support.paths import ROOT
from tests.support.processes import TAG, kill_tagged

EXAMPLE = ROOT / "examples" / "multirank" / "train_dp.py"
VENV_BIN = Path(sys.executable).parent
RANK_VARS = ("RANK_ID", "RANK", "RANK_SIZE", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
             "DEVICE_ID", "MS_ROLE", "MS_NODE_ID", "MS_WORKER_NUM", "MS_SCHED_HOST",
             "MS_SCHED_PORT")


def child_env(**extra: str) -> dict[str, str]:
    """The test's environment with the venv first on PATH (msrun starts plain `python`)."""
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARS}
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env.setdefault("GLOG_v", "3")
    env.update(extra)
    return env


def msrun_command(args: list[str], master_port: int, log_dir: Path, workers: int = 2) -> list[str]:
    return [str(VENV_BIN / "msrun"), f"--worker_num={workers}", f"--local_worker_num={workers}",
            "--master_addr=127.0.0.1", f"--master_port={master_port}", "--join=True",
            f"--log_dir={log_dir}", str(EXAMPLE), *args]


#: pid -> the tag that start() gave the process (its log's path, unique per start)
_TAGS: dict[int, str] = {}


def start(command: list[str], env: dict[str, str], log: Path, cwd: Path) -> subprocess.Popen:
    """A child in its own process group (so that stop() reaches its workers too), tagged
    (TAG=its log's path) so that stop() also finds what left that group (msrun's ranks run in
    sessions of their own)."""
    with open(log, "wb") as handle:
        process = subprocess.Popen(command, env={**env, TAG: str(log)}, cwd=cwd, stdout=handle,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    _TAGS[process.pid] = str(log)
    return process


def stop(process: subprocess.Popen, timeout: float = 20.0) -> None:
    """Terminate the child's process group; kill it if it does not exit in time; then kill
    whatever else carries the tag start() gave it."""
    _stop_group(process, timeout)
    if process.pid in _TAGS:
        kill_tagged(_TAGS.pop(process.pid))


def stop_launcher(process: subprocess.Popen, timeout: float = 10.0) -> None:
    """End an `mfotel-instrument` as its user does: SIGTERM (the job's cancel), again each
    second until it exits (a second one ends its node endpoint's linger), so that it removes
    what it made (its node directory) instead of being killed; then stop() what is left."""
    deadline = time.monotonic() + timeout
    while process.poll() is None and time.monotonic() < deadline:
        try:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass
    stop(process, timeout=2)


def _stop_group(process: subprocess.Popen, timeout: float) -> None:
    if process.poll() is not None:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=timeout)
            return
        except subprocess.TimeoutExpired:
            continue


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class EndpointPoller:
    """Scrapes every URL and reads every file in a background thread; keeps what it saw."""

    def __init__(self, urls: dict[Any, str], files: tuple[Path, ...] = (),
                 interval: float = 0.1) -> None:
        self.urls, self.files, self.interval = urls, files, interval
        self.bodies: dict[Any, list[dict]] = {name: [] for name in urls}
        self.file_texts: dict[Path, list[str]] = {path: [] for path in files}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for name, url in self.urls.items():
                try:
                    self.bodies[name].append(samples(scrape(url)))
                except (OSError, ValueError):
                    pass
            for path in self.files:
                try:
                    text = path.read_text()
                except OSError:
                    continue
                seen = self.file_texts[path]
                if text and (not seen or seen[-1] != text):
                    seen.append(text)
            self._stop.wait(self.interval)

    def __enter__(self) -> EndpointPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
