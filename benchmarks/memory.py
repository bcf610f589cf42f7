"""Memory: RSS over 1M recorded steps stays flat; memory per native series.

    .venv/bin/python benchmarks/memory.py [--steps 1000000] [--series 10000]

Drives OTelMonitor's real step hooks with MindSpore's own RunContext and callback parameters
(numpy loss and grad norm, no network: a million real steps would take an hour), with
/metrics served and scraped every 50k steps, every step a record step.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import urllib.request

import numpy as np
import psutil

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mindspore.train.callback import (
    RunContext,
    _InternalCallbackParam,
)

from mfotel.callback import OTelMonitor
from mfotel.localstack.servers import free_port


def rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--series", type=int, default=10_000)
    args = parser.parse_args()
    port = free_port()
    monitor = OTelMonitor(step_interval=1, job_name="mem", native_series_limit=args.series + 10,
                          metrics=["loss", "learning_rate", "grad_norm", "throughput", "step_time"],
                          batch_size=8, output={"console": False},
                          prometheus={"host": "127.0.0.1", "port": port, "linger_seconds": 0})
    cb = _InternalCallbackParam()
    cb.epoch_num, cb.batch_num, cb.cur_epoch_num = 1, args.steps, 1
    cb.optimizer, cb.train_network = None, None  # other keys absent, as a minimal framework sets
    context = RunContext(cb)
    monitor.on_train_begin(context)
    rng = np.random.default_rng(0)
    losses = rng.random(1000).astype(np.float32)
    checkpoints = {int(args.steps * f) for f in (0.01, 0.25, 0.5, 0.75, 1.0)}
    print(f"## RSS over {args.steps} recorded steps (MB)")
    baseline = None
    for step in range(1, args.steps + 1):
        cb.cur_step_num = step
        cb.net_outputs = (losses[step % 1000], losses[(step + 1) % 1000])
        monitor.on_train_step_begin(context)
        monitor.on_train_step_end(context)
        if step % 50_000 == 0:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read()
        if step in checkpoints:
            gc.collect()
            now = rss_mb()
            baseline = baseline or now
            print(f"step {step:>9}: {now:7.1f} MB  ({now - baseline:+.1f} MB since 1%)")
    before = rss_mb()
    for i in range(args.series):
        monitor.instruments.set_native("local_norm", float(i), {"param": f"layers.{i}.weight"})
    urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60).read()
    gc.collect()
    after = rss_mb()
    print(f"\n## {args.series} native series (stored + collected + rendered once): "
          f"{after - before:.1f} MB, {(after - before) * 2**20 / args.series:.0f} bytes/series")
    monitor.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
