"""One attempt of a checkpointed, evaluated data-parallel run (run by msrun; the goodput e2e,
tests/e2e/test_goodput_restart_msrun.py), keeping its own ground truth.

    msrun --worker_num=2 ... tests/support/scripts/goodput_train.py --port 9464 --job-name gp \
        --run-id run-1 --file-sd targets/job.json --workdir DIR [--resume] [--block-after 12]

Every rank trains the demo regression (gradient all-reduce inside the graph) for `--epochs`
epochs of `--epoch-steps` steps with OTelMonitor (run id `--run-id`, a monitor line at every
step into DIR/monitor_{rank}.log), MindSpore's ModelCheckpoint saving every epoch into
DIR/ckpt/rank_<r>, and an evaluation after the epochs of `--eval-epochs` (Model.fit). The
phases take known host time (callbacks after the monitor): `--step-sleep` inside each step,
`--input-sleep` after each step (host work between steps), `--save-sleep` inside each save,
`--eval-sleep` inside each evaluation, `--stall-sleep` after step `--stall-after`.

`--resume` loads the rank's latest checkpoint and resumes after its epoch (`initial_epoch`).
`--block-after S`: after step S's end the rank waits forever (for its SIGKILL).

The ground truth: each rank appends, one JSON object a line, to DIR/truth/rank_<r>.jsonl: its
pid and process start (psutil), then each step's global number, begin and end, each save's and
each evaluation's begin and end, "blocked" and "end" (unix times, the script's own clock reads).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import time
from pathlib import Path
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--job-name", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--file-sd", required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--epoch-steps", type=int, default=8)
    parser.add_argument("--eval-epochs", default="1,2", help="evaluate after these epochs")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--step-sleep", type=float, default=0.2)
    parser.add_argument("--input-sleep", type=float, default=0.1)
    parser.add_argument("--save-sleep", type=float, default=1.0)
    parser.add_argument("--eval-sleep", type=float, default=1.5)
    parser.add_argument("--stall-after", type=int, default=0, help="0: no stall")
    parser.add_argument("--stall-sleep", type=float, default=0.0)
    parser.add_argument("--stall-seconds", type=float, default=4.0,
                        help="the time account's stall threshold (as the rules')")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--block-after", type=int, default=0)
    parser.add_argument("--linger-seconds", type=float, default=60.0)
    return parser.parse_args(argv)


class Truth:
    """The rank's ground-truth file (appended one whole line per write)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path

    def write(self, **record: Any) -> None:
        with self.path.open("a") as out:
            out.write(json.dumps(record) + "\n")


def callbacks(args: argparse.Namespace, truth: Truth, first_step: int) -> list[Any]:
    """The truth callback and the phases' host time (both after OTelMonitor)."""
    from mindspore.train import Callback

    class Timeline(Callback):
        """Each step's and evaluation's begin and end, as the script sees them."""

        def __init__(self) -> None:
            self.step, self.begun, self.eval_begun = first_step - 1, 0.0, 0.0

        def on_train_step_begin(self, run_context: Any) -> None:
            self.begun = time.time()

        def on_train_step_end(self, run_context: Any) -> None:
            self.step += 1
            truth.write(step=self.step, begin=self.begun, end=time.time())

        def on_eval_begin(self, run_context: Any) -> None:
            self.eval_begun = time.time()

        def on_eval_end(self, run_context: Any) -> None:
            truth.write(eval=[self.eval_begun, time.time()])

    timeline = Timeline()

    class HostTime(Callback):
        """Sleeps where each phase's host time goes (after the monitor's and the truth's
        hooks: inside the step at its begin, between steps at its end)."""

        def on_train_step_begin(self, run_context: Any) -> None:
            time.sleep(args.step_sleep)

        def on_train_step_end(self, run_context: Any) -> None:
            step = timeline.step
            if step == args.block_after:
                truth.write(blocked=time.time())
                while True:   # until the test's SIGKILL
                    time.sleep(60)
            time.sleep(args.stall_sleep if step == args.stall_after else args.input_sleep)

        def on_eval_begin(self, run_context: Any) -> None:
            time.sleep(args.eval_sleep)

    return [timeline, HostTime()]


def end_mark(truth: Truth) -> Any:
    """The end of training, as the first callback's on_train_end sees it."""
    from mindspore.train import Callback

    class EndMark(Callback):
        def on_train_end(self, run_context: Any) -> None:
            truth.write(end=time.time())
    return EndMark()


def checkpointing(args: argparse.Namespace, directory: Path, truth: Truth) -> Any:
    """ModelCheckpoint every epoch, each save timed into the truth (and `--save-sleep` longer:
    a large model's write)."""
    from mfotel.demo.training import checkpoint_callback
    saving = checkpoint_callback(args.epoch_steps, str(directory), keep=5)
    save = saving._save_ckpt   # the instance's own: the class stays ModelCheckpoint

    def timed(cb_params: Any, force_to_save: bool = False) -> None:
        before = saving._last_triggered_step
        begun = time.time()
        save(cb_params, force_to_save)
        if saving._last_triggered_step != before:
            time.sleep(args.save_sleep)
            truth.write(save=[begun, time.time()])
    saving._save_ckpt = timed
    return saving


def resume(model: Any, directory: Path) -> int:
    """Load the latest checkpoint of `directory` into the network; the epoch it ended."""
    import mindspore as ms
    found = sorted((int(m.group(1)), path) for path in directory.glob("demo-*_*.ckpt")
                   if (m := re.match(r"demo-(\d+)_\d+\.ckpt$", path.name)))
    epoch, path = found[-1]
    ms.load_param_into_net(model.train_network, ms.load_checkpoint(str(path)))
    return epoch


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import psutil
    started = psutil.Process().create_time()
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
    from mfotel.demo.training import SyntheticRegression, build_model
    from mfotel.time_account import process_account

    workdir = Path(args.workdir)
    truth = Truth(workdir / "truth" / f"rank_{rank}.jsonl")
    truth.write(pid=os.getpid(), start=started)
    # the account's stall threshold as the test's rules' (monitor_config has no key for it)
    process_account().stall_seconds = args.stall_seconds
    steps = args.epochs * args.epoch_steps
    source = SyntheticRegression(args.epoch_steps, args.batch_size, seed=rank)
    dataset = ds.GeneratorDataset(source, ["x", "y"], shuffle=False).batch(args.batch_size)
    held_out = SyntheticRegression(2, args.batch_size, seed=100, weights=source.w)
    valid = ds.GeneratorDataset(held_out, ["x", "y"], shuffle=False).batch(args.batch_size)
    model = build_model(steps, args.batch_size, "constant")
    ckpt = workdir / "ckpt" / f"rank_{rank}"
    initial_epoch = resume(model, ckpt) if args.resume else 0
    monitor = OTelMonitor(
        job_name=args.job_name, run={"id": args.run_id}, log_rank=-1,
        metrics=["loss", "step_time"], file_sd={"path": args.file_sd},
        output={"console": False, "file": True,
                "file_path": str(workdir / "monitor_{rank}.log")},
        prometheus={"host": "127.0.0.1", "port": args.port, "linger_seconds": args.linger_seconds,
                    "linger_until_scraped": True})
    # the monitor first: the truth's, the save's and the host time's hooks run after its own
    # (the end mark before it: training ended when the first on_train_end runs)
    timeline, host_time = callbacks(args, truth, initial_epoch * args.epoch_steps + 1)
    model.fit(args.epochs, dataset, valid_dataset=valid,
              valid_frequency=[int(e) for e in args.eval_epochs.split(",") if e],
              callbacks=[end_mark(truth), monitor, timeline, checkpointing(args, ckpt, truth),
                         host_time],
              dataset_sink_mode=False, valid_dataset_sink_mode=False, initial_epoch=initial_epoch)


if __name__ == "__main__":
    main()
