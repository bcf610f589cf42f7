"""Data-parallel training of a tiny regression on N CPU ranks, every rank serving /metrics.

    PATH="$VIRTUAL_ENV/bin:$PATH" msrun --worker_num=2 --local_worker_num=2 \
        --master_addr=127.0.0.1 --master_port=8118 --join=True --log_dir=./msrun_logs \
        examples/multirank/train_dp.py --steps 200 --port 9464 --file-sd ./targets/dp.json

Rank r serves http://HOST:9464+r/metrics (port + local rank); rank 0 writes a Prometheus
file_sd target file listing every rank; only the `--log-rank` ranks print `[Monitor]` lines.
With `--truth-dir`, every rank also writes what it computed (loss per step, lr, pid) to
`rank_<r>.json`, which tests compare with what was scraped.

msrun runs this script in its scheduler process too, up to `init()`: keep work before it cheap.
Started without msrun (no MS_ROLE), each process trains an independent replica on its RANK_ID
shard: a rank can then die without msrun tearing down the others (tests of the rank-down alert).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="global batches per rank")
    parser.add_argument("--batch-size", type=int, default=8, help="samples per rank per step")
    parser.add_argument("--port", type=int, default=9464,
                        help="base port (rank serves + local rank)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address of /metrics")
    parser.add_argument("--job-name", default="mfotel-dp")
    parser.add_argument("--step-interval", type=int, default=1)
    parser.add_argument("--log-rank", type=int, nargs="+", default=[0])
    parser.add_argument("--file-sd", default=None, help="file_sd target file rank 0 writes")
    parser.add_argument("--linger-seconds", type=float, default=0.0)
    parser.add_argument("--linger-fixed", action="store_true",
                        help="linger all of --linger-seconds (default: until the first scrape "
                             "of the final status)")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step")
    parser.add_argument("--slow-until", default=None,
                        help="sleep --step-sleep per step only until this file exists")
    parser.add_argument("--otlp-endpoint", default=None, help="also push OTLP/HTTP here")
    parser.add_argument("--cardinality", choices=("full", "health"), default="full")
    parser.add_argument("--truth-dir", default=None, help="write rank_<r>.json ground truth here")
    return parser.parse_args(argv)


def truth_callback(path: Path | None, step_sleep: float, slow_until: str | None) -> Any:
    """Records loss and grad norm as this rank computed them, rewriting `path` every step;
    sleeps `step_sleep` per step (until `slow_until` exists) so a run lasts long enough to watch."""
    from mindspore.train import Callback

    class Truth(Callback):
        def __init__(self) -> None:
            super().__init__()
            self.data: dict[str, Any] = {"pid": os.getpid(), "losses": {}, "grad_norms": {}}

        def on_train_begin(self, run_context: Any) -> None:
            self._write()  # the pid, early: a test may kill this rank

        def on_train_step_end(self, run_context: Any) -> None:
            cb = run_context.original_args()
            loss, norm = cb.net_outputs
            step = str(int(cb.cur_step_num))
            self.data["losses"][step] = float(loss.asnumpy())
            self.data["grad_norms"][step] = float(norm.asnumpy())
            self._write()
            if step_sleep and (slow_until is None or not os.path.exists(slow_until)):
                time.sleep(step_sleep)

        def _write(self) -> None:
            if path is None:
                return
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.data))
            os.replace(tmp, path)
    return Truth()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import mindspore as ms
    import mindspore.dataset as ds
    from mindspore.communication import get_group_size, get_rank, init

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    from mfotel import OTelMonitor
    from mfotel.demo.training import SyntheticRegression, build_model
    from mfotel.identity import identity_from_env

    if "MS_ROLE" in os.environ:  # launched by msrun
        init()  # msrun's scheduler process never returns from here
        ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL,
                                     gradients_mean=True)
        rank, world = get_rank(), get_group_size()
    else:  # independent replicas, identity from RANK_ID / RANK_SIZE / LOCAL_RANK
        ident = identity_from_env()
        rank, world = ident.rank, ident.world_size

    # one shared source, sharded: rank r trains on its own slice of every global batch
    source = SyntheticRegression(args.steps * world, args.batch_size)
    dataset = ds.GeneratorDataset(source, ["x", "y"], shuffle=False, num_shards=world,
                                  shard_id=rank).batch(args.batch_size)
    settings: dict[str, Any] = {
        "job_name": args.job_name, "step_interval": args.step_interval,
        "metrics": ["loss", "learning_rate", "grad_norm", "throughput", "step_time"],
        "log_rank": args.log_rank, "cardinality": args.cardinality,
        "prometheus": {"host": args.host, "port": args.port,
                       "linger_seconds": args.linger_seconds,
                       "linger_until_scraped": not args.linger_fixed},
    }
    if args.file_sd:
        settings["file_sd"] = {"path": args.file_sd}
    if args.otlp_endpoint:
        settings["otlp"] = {"endpoint": args.otlp_endpoint, "interval_seconds": 1.0}
    truth = None
    if args.truth_dir:
        Path(args.truth_dir).mkdir(parents=True, exist_ok=True)
        truth = Path(args.truth_dir) / f"rank_{rank}.json"
    callbacks = [truth_callback(truth, args.step_sleep, args.slow_until), OTelMonitor(**settings)]
    model = build_model(args.steps, args.batch_size, "cosine")
    model.train(1, dataset, callbacks=callbacks, dataset_sink_mode=False)


if __name__ == "__main__":
    main()
