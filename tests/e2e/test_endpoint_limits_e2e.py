"""Availability of /metrics under a flood of idle connections while a real MindSpore network
trains in a subprocess limited to 1024 file descriptors.

The other network clients (idle, slow, oversized, failing): tests/unit/test_endpoint_limits.py.
"""
from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys

import pytest

from mfotel.localstack.servers import free_port
from tests.support.endpoint import (
    SCRAPER,
    open_fds,
    proc_status,
    request,
)
from tests.support.idle_flood import idle_connections
from tests.support.metrics import samples, value
from tests.support.paths import ROOT
from tests.support.waiting import settle, startup, wait_for

TRAINER = """
import sys
from pathlib import Path
from mindspore.train import Callback
from mfotel.demo.training import run_demo

port, folder = int(sys.argv[1]), Path(sys.argv[2])

class Work(Callback):
    '''Opens files every step, as data loading and checkpointing do; stops when told.'''
    def on_train_step_end(self, run_context):
        step = run_context.original_args().cur_step_num
        (folder / "progress").write_text(str(step))
        if (folder / "stop").exists():
            run_context.request_stop()

result = run_demo(steps=50000, port=port, extra_callbacks=(Work(),), lr_schedule="constant",
                  output={"console": False})
print("trained", len(result.losses), "steps", flush=True)
"""


def _limit_files() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))


@pytest.mark.slow
def test_training_survives_1000_idle_connections_with_1024_file_descriptors(tmp_path):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "GLOG_v": "3"}
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(port), str(tmp_path)],
                               cwd=tmp_path, env=env, preexec_fn=_limit_files,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    flood: list[socket.socket] = []
    progress = tmp_path / "progress"

    def step() -> int:
        try:
            return int(progress.read_text() or 0)
        except (OSError, ValueError):
            return 0
    try:
        wait_for(lambda: step() > 0 and request(port, timeout=2).status == 200, startup(), 0.05,
                 "the trainer to serve", alive=[trainer])
        threads, fds = proc_status(trainer.pid, "Threads"), open_fds(trainer.pid)
        flood = idle_connections(port, 1100)
        at_flood, seen = step(), {"threads": threads, "fds": fds}

        def trained_on() -> bool:  # and note the most threads and descriptors seen meanwhile
            seen["threads"] = max(seen["threads"], proc_status(trainer.pid, "Threads"))
            seen["fds"] = max(seen["fds"], open_fds(trainer.pid))
            return step() >= at_flood + 500
        # a demo step takes well under 20 ms here: 500 of them in 10 s
        wait_for(trained_on, settle(500 * 0.02), 0.05, "500 more steps under the flood",
                 alive=[trainer])
        reply = request(port, source=SCRAPER, timeout=10)  # within Prometheus' default timeout
        assert reply.status == 200
        assert value(samples(reply.body.decode()), "mindformers_train_step") >= at_flood
        assert seen["threads"] <= threads + 5, seen  # not one per connection
        assert seen["fds"] <= fds + 100 + 5, seen   # max_connections (100) and a few
        (tmp_path / "stop").write_text("")
        output, _ = trainer.communicate(timeout=120)
        assert trainer.returncode == 0, output[-3000:]
        assert "trained" in output
    finally:
        for sock in flood:
            sock.close()
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait(30)
