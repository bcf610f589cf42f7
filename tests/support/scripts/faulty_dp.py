"""A data-parallel job with one fault injected into one rank (run by msrun; the job-level tests).

    msrun --worker_num=2 ... tests/support/scripts/faulty_dp.py --fault input --fault-rank 1 \
        --port 9464 --file-sd targets/job.json --job-name jt --steps 5000

Every rank trains the demo regression (Dense-ReLU-Dense, gradient all-reduce inside the graph)
on its own random-access data, with OTelMonitor serving /metrics on port + local rank. The
fault hits `--fault-rank` from global step `--fault-at` on (or once `--trigger` exists):

- input: sleeps `--seconds` in its dataset's `__getitem__` for the first sample of every batch
  (outside its timed step; the others wait inside theirs);
- compute: waits `--seconds` inside its timed step (a step-begin hook after OTelMonitor's), as
  the host waits for a slow device; the test adds a busy process on its core;
- nan: a label of one batch is NaN: its loss goes NaN (the others follow a step later);
- silent: an input row of one batch is NaN: the loss stays finite behind the ReLU, the
  gradient norm is NaN for a step (weights turning NaN);
- hang: blocks in `__getitem__` for `--seconds` (outside the step; the others wait inside);
- raise: raises in `__getitem__` (an exception in its data loader ends its training);
- die: SIGKILLs itself at the end of that step.

`--end-work SECONDS`: rank `--end-work-rank` spends that long in its end work (a callback's
`on_train_end` before OTelMonitor's, as a final checkpoint save): it still runs meanwhile.

`--pin` pins rank r to CPU r modulo the CPU count (as `taskset` would, before any thread
starts). `--truth-dir DIR`: each rank appends its pid, then its loss and gradient norm at
every step, one JSON object a line, to `DIR/rank_<r>.jsonl` (appending: a step costs the same
at step 10 and at step 10,000; tests/support/jobtruth.py `read_truth` reads it back).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

FAULTS = ("none", "input", "compute", "nan", "silent", "hang", "raise", "die")


class InjectedFault(RuntimeError):
    """The data loader's error of the `raise` fault."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fault", choices=FAULTS, default="none")
    parser.add_argument("--fault-rank", type=int, default=1)
    parser.add_argument("--fault-at", type=int, default=1, help="global step the fault starts")
    parser.add_argument("--trigger", default=None, help="the fault starts once this file exists")
    parser.add_argument("--seconds", type=float, default=0.3, help="input wait / compute / hang")
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--step-sleep", type=float, default=0.0,
                        help="every rank sleeps this long inside each step (a slower model)")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--job-name", required=True)
    parser.add_argument("--file-sd", default=None, help="file_sd target file rank 0 writes")
    parser.add_argument("--alertmanager-url", default=None, help="the fast path")
    parser.add_argument("--linger-seconds", type=float, default=30.0)
    parser.add_argument("--pin", action="store_true")
    parser.add_argument("--truth-dir", default=None)
    parser.add_argument("--end-work", type=float, default=0.0,
                        help="seconds of end work (on_train_end) of --end-work-rank")
    parser.add_argument("--end-work-rank", type=int, default=0)
    return parser.parse_args(argv)


class FaultyData:
    """Random-access regression samples of one rank, with the input faults."""

    def __init__(self, args: argparse.Namespace, rank: int) -> None:
        from mfotel.demo.training import SyntheticRegression
        source = SyntheticRegression(args.steps, args.batch_size, seed=rank)
        self.x, self.y = source.x, source.y
        self.args, self.faulty = args, rank == args.fault_rank

        self.poisoned: int | None = None   # the step whose batch carries the NaN

    def _active(self, step: int) -> bool:
        args = self.args
        return self.faulty and step >= args.fault_at and (
            args.trigger is None or os.path.exists(args.trigger))

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        step, within = divmod(index, self.args.batch_size)
        step += 1
        x, y = self.x[index], self.y[index]
        fault = self.args.fault
        if within == 0 and fault in ("input", "hang") and self._active(step):
            time.sleep(self.args.seconds)
        if within == 0 and fault == "raise" and self._active(step):
            raise InjectedFault(f"rank {self.args.fault_rank}: a bad sample at step {step}")
        # one batch only: the first one loaded once the fault is active
        if within == 0 and fault in ("nan", "silent") and self.poisoned is None and \
                self._active(step):
            self.poisoned = step
        if step == self.poisoned and within == 0:
            if fault == "nan":
                y = y * float("nan")
            else:
                x = x * float("nan")
        return x, y

    def __len__(self) -> int:
        return len(self.x)


def fault_callback(args: argparse.Namespace, rank: int, truth: Path | None) -> Any:
    """Step hooks of the faulty rank (compute, die) and the ground truth of every rank."""
    from mindspore.train import Callback

    class Fault(Callback):
        def on_train_begin(self, run_context: Any) -> None:
            self._append({"pid": os.getpid()})

        def _active(self, step: int) -> bool:
            return rank == args.fault_rank and step >= args.fault_at and (
                args.trigger is None or os.path.exists(args.trigger))

        def on_train_step_begin(self, run_context: Any) -> None:
            step = int(run_context.original_args().cur_step_num)
            if args.step_sleep:
                time.sleep(args.step_sleep)
            if args.fault == "compute" and self._active(step):
                time.sleep(args.seconds)   # inside the timed step: the others wait for it

        def on_train_step_end(self, run_context: Any) -> None:
            cb = run_context.original_args()
            step = int(cb.cur_step_num)
            loss, norm = cb.net_outputs
            self._append({"step": step, "loss": float(loss.asnumpy()),
                          "grad_norm": float(norm.asnumpy())})
            if args.fault == "die" and self._active(step):
                os.kill(os.getpid(), signal.SIGKILL)

        def _append(self, record: dict[str, Any]) -> None:
            if truth is None:
                return
            with truth.open("a") as out:   # one write of a whole line; NaN as JSON's NaN
                out.write(json.dumps(record) + "\n")
    return Fault()


def end_work(seconds: float) -> Any:
    """A callback whose on_train_end takes `seconds` (a final checkpoint save)."""
    from mindspore.train import Callback

    class EndWork(Callback):
        def on_train_end(self, run_context: Any) -> None:
            time.sleep(seconds)
    return EndWork()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    worker = os.environ.get("MS_ROLE") == "MS_WORKER"
    if args.pin and worker:  # before MindSpore starts its threads: they inherit it
        os.sched_setaffinity(0, {int(os.environ["RANK_ID"]) % (os.cpu_count() or 1)})
    import mindspore as ms
    import mindspore.dataset as ds
    from mindspore.communication import get_rank, init

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    init()  # msrun's scheduler process never returns from here
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL,
                                 gradients_mean=True)
    rank = get_rank()
    from mfotel import OTelMonitor
    from mfotel.demo.training import build_model

    dataset = ds.GeneratorDataset(FaultyData(args, rank), ["x", "y"], shuffle=False,
                                  num_parallel_workers=1).batch(args.batch_size)
    settings: dict[str, Any] = {
        "job_name": args.job_name, "metrics": ["loss", "grad_norm", "step_time"],
        "output": {"console": False}, "prometheus": {"host": "127.0.0.1", "port": args.port,
                                       "linger_seconds": args.linger_seconds,
                                       "linger_until_scraped": False}}
    if args.file_sd:
        settings["file_sd"] = {"path": args.file_sd}
    if args.alertmanager_url:
        settings["alertmanager_url"] = args.alertmanager_url
    truth = None
    if args.truth_dir:
        Path(args.truth_dir).mkdir(parents=True, exist_ok=True)
        truth = Path(args.truth_dir) / f"rank_{rank}.jsonl"
    # OTelMonitor first: the fault's step-begin work falls inside the timed step; end work
    # before it (the run still runs while a final checkpoint saves)
    callbacks = [OTelMonitor(**settings), fault_callback(args, rank, truth)]
    if args.end_work and rank == args.end_work_rank:
        callbacks.insert(0, end_work(args.end_work))
    model = build_model(args.steps, args.batch_size, "constant")
    model.train(1, dataset, callbacks=callbacks, dataset_sink_mode=False)


if __name__ == "__main__":
    main()
