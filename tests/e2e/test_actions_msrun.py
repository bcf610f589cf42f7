"""Two data-parallel CPU ranks under msrun stop at the same step when `mfotel control` is run.

The gradients are all-reduced every step, so a rank that stopped alone would hang its peer:
finishing at all proves the ranks agreed. The test waits for rank 0's monitor file to pass a
step, runs the real CLI in a subprocess, and reads each rank's last step afterwards.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mfotel.actions.control import SCHEDULE_FILE
from mfotel.localstack.servers import free_port
from tests.support.waiting import msrun_startup, settle, wait_for

pytestmark = pytest.mark.slow
STEPS, TRIGGER_AFTER = 400, 8
STEP_SECONDS = 0.1  # each step sleeps this long (the worker's Slow callback)
VENV_BIN = Path(sys.executable).parent

WORKER = textwrap.dedent('''
    import json, os, sys, time
    import mindspore as ms
    import mindspore.dataset as ds
    from mindspore.communication import get_group_size, get_rank, init
    from mindspore.train import Callback
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    init()  # the msrun scheduler process runs everything above this line too
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
    from mfotel import OTelMonitor
    from mfotel.demo.training import SyntheticRegression, build_model

    class Slow(Callback):
        def on_train_step_end(self, run_context):
            time.sleep(float(sys.argv[3]))

    out, steps = sys.argv[1], int(sys.argv[2])
    rank, world = get_rank(), get_group_size()
    dataset = ds.GeneratorDataset(SyntheticRegression(steps * world, 8), ["x", "y"],
                                  shuffle=False, num_shards=world, shard_id=rank).batch(8)
    monitor = OTelMonitor(job_name="msrun-actions", metrics=["loss"], log_rank=-1,
                          prometheus={"port": 0},
                          output={"console": False, "file": True,
                                  "file_path": os.path.join(out, "monitor_{rank}.log")},
                          actions={"control_dir": os.path.join(out, "ctl", "{job_name}"),
                                   "lead_steps": 3})
    build_model(steps, 8, "list").train(1, dataset, callbacks=[Slow(), monitor],
                                        dataset_sink_mode=False)
    with open(os.path.join(out, f"result_{rank}.json"), "w") as f:
        json.dump({"rank": monitor.identity.rank, "world": monitor.identity.world_size,
                   "last_step": monitor.instruments.state.step,
                   "status": monitor.instruments.state.status,
                   "applied": [[r.id, r.action, r.step] for r in monitor.actions.applied],
                   "counts": {f"{a}/{s}": n for (a, s), n in monitor.actions.counts.items()}}, f)
''')


def last_step(path: Path) -> int:
    if not path.exists():
        return 0
    lines = [x for x in path.read_text().splitlines() if x.startswith("[Monitor] step: ")]
    return int(lines[-1].split(",")[0].split(": ")[1]) if lines else 0


def test_two_ranks_stop_at_the_same_step(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    # MS_NODE_TIMEOUT: MindSpore's scheduler once timed out a rank that was exiting after the
    # stop (msrun exit 1 at a load of 20; its default is 30 s); this test is of the stop, not
    # of MindSpore's time-outs (tests/e2e/test_cascades_msrun.py runs those at their defaults)
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}", "GLOG_v": "3",
           "MS_NODE_TIMEOUT": "120"}
    for name in ("RANK_ID", "RANK", "RANK_SIZE", "WORLD_SIZE", "LOCAL_RANK", "DEVICE_ID"):
        env.pop(name, None)
    command = [str(VENV_BIN / "msrun"), "--worker_num=2", "--local_worker_num=2",
               "--master_addr=127.0.0.1", f"--master_port={free_port()}", "--join=True",
               f"--log_dir={tmp_path / 'msrun_logs'}", str(script), str(tmp_path), str(STEPS),
               str(STEP_SECONDS)]
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: last_step(tmp_path / "monitor_0.log") >= TRIGGER_AFTER,
                 msrun_startup() + settle(TRIGGER_AFTER * STEP_SECONDS), 0.2,
                 f"rank 0 at step {TRIGGER_AFTER}", alive=[proc], details=lambda: logs(tmp_path))
        job_dir = tmp_path / "ctl" / "msrun-actions"
        done = subprocess.run([sys.executable, "-m", "mfotel.actions.control", str(job_dir),
                               "--stop", "--reason", "msrun test"], capture_output=True, text=True,
                              timeout=60, env=env)
        assert done.returncode == 0, done.stderr
        assert proc.wait(timeout=120) == 0, logs(tmp_path)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    results = [json.loads((tmp_path / f"result_{r}.json").read_text()) for r in (0, 1)]
    (scheduled,) = json.loads((job_dir / SCHEDULE_FILE).read_text())["actions"]
    print(f"\ncontrol file written after rank 0 logged step >= {TRIGGER_AFTER}; rank 0 scheduled "
          f"the stop for step {scheduled['step']}; ranks stopped at "
          f"{[r['last_step'] for r in results]}")
    assert [r["rank"] for r in results] == [0, 1] and {r["world"] for r in results} == {2}
    assert TRIGGER_AFTER < scheduled["step"] < STEPS
    for r in results:
        assert r["last_step"] == scheduled["step"]
        assert r["applied"] == [[scheduled["id"], "stop", scheduled["step"]]]
        assert r["counts"]["stop/control"] == 1 and r["status"] == 3
    monitor_steps = [last_step(tmp_path / f"monitor_{r}.log") for r in (0, 1)]
    assert monitor_steps == [scheduled["step"]] * 2


def logs(tmp_path: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}"
                     for p in sorted((tmp_path / "msrun_logs").glob("*.log")))
