"""A real MindSpore run with OTelMonitor in its own process, for tests/e2e/test_lifecycle.py.

    python tests/support/scripts/lifecycle_train.py '{"port": 9464, "linger_seconds": 10}'

Options (JSON): port, steps, step_seconds (sleep per step), linger_seconds, job_name,
log_file (a file sink), layers (deeper network: longer graph compilation), previous_handler
(a path: install a SIGTERM handler before training that writes this file and, with
previous_exits, exits 99), raise_at (a later callback raises RuntimeError at this step),
stuck_at (at this step a later callback runs native code that keeps the GIL released and never
returns to Python), setup_seconds (a later callback's on_train_begin prints "setting up" and
takes this long, like loading a checkpoint), dataset_workers (forked dataset worker processes),
fork_at (at this step a later callback forks a child process that sleeps; prints "child PID").
Prints "step N" for each step and "returned" when train() returns; mfotel logs at INFO.
"""
from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import signal
import sys
import time
from pathlib import Path
from typing import Any


def later_callback(opts: dict[str, Any]) -> Any:
    from mindspore.train import Callback

    class Later(Callback):
        def on_train_begin(self, run_context: Any) -> None:
            if opts.get("setup_seconds"):
                print("setting up", flush=True)
                time.sleep(opts["setup_seconds"])

        def on_train_step_end(self, run_context: Any) -> None:
            step = int(run_context.original_args().cur_step_num)
            print(f"step {step}", flush=True)
            if step == opts.get("raise_at"):
                raise RuntimeError(f"data loader broke at step {step}")
            if step == opts.get("fork_at"):
                self.child = multiprocessing.get_context("fork").Process(
                    target=time.sleep, args=(300,), daemon=True)
                self.child.start()
                print(f"child {self.child.pid}", flush=True)
            if step == opts.get("stuck_at"):  # like a collective whose peer is gone
                hashlib.pbkdf2_hmac("sha256", b"x", b"y", 2 * 10 ** 9)  # hours; below INT_MAX
            time.sleep(opts.get("step_seconds", 0.02))
    return Later()


def build_model(layers: int) -> Any:
    """The demo's regression with `layers` hidden Dense layers (TrainOneStepWithGradNorm)."""
    import mindspore as ms
    from mindspore import nn
    from mindspore.train import Model

    from mfotel.cells import TrainOneStepWithGradNorm
    ms.set_seed(0)
    net = nn.SequentialCell([nn.Dense(16, 16) for _ in range(layers)] + [nn.Dense(16, 1)])
    optimizer = nn.Momentum(net.trainable_params(), 0.01, momentum=0.9)
    return Model(TrainOneStepWithGradNorm(nn.WithLossCell(net, nn.MSELoss()), optimizer))


def main(opts: dict[str, Any]) -> None:
    logging.basicConfig(level=logging.INFO)  # mfotel's "keeping /metrics up" line on stderr
    import mindspore as ms
    import mindspore.dataset as ds

    from mfotel import OTelMonitor
    from mfotel.demo.training import SyntheticRegression
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    if opts.get("previous_handler"):
        marker = Path(opts["previous_handler"])

        def previous(signum: int, frame: Any) -> None:
            marker.write_text(str(signum))
            if opts.get("previous_exits"):
                sys.exit(99)
        signal.signal(signal.SIGTERM, previous)
    output = {"console": False}
    if opts.get("log_file"):
        output.update(file=True, file_path=opts["log_file"])
    monitor = OTelMonitor(job_name=opts.get("job_name", "lifecycle"), metrics=["loss"],
                          output=output,
                          prometheus={"host": "127.0.0.1", "port": opts["port"],
                                      "linger_seconds": opts.get("linger_seconds", 10.0)})
    steps = opts.get("steps", 20000)
    workers = opts.get("dataset_workers", 1)  # > 1: forked worker processes
    dataset = ds.GeneratorDataset(SyntheticRegression(steps, 8), ["x", "y"], shuffle=False,
                                  num_parallel_workers=workers,
                                  python_multiprocessing=workers > 1).batch(8)
    build_model(opts.get("layers", 1)).train(1, dataset, callbacks=[monitor, later_callback(opts)],
                                             dataset_sink_mode=False)
    print("returned", flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
