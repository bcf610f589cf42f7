"""A rank-like process for the stack capture's tests (tests/unit/test_stacks.py): no MindSpore.

    python tests/support/scripts/stacks_rank.py MODE DIR [--rank R] [--step-seconds S]

It joins the node agent's rendezvous in DIR (mfotel.node_link, as OTelMonitor does at train
begin), unless MODE is `bare`, then writes DIR/ready-<pid> and:

- loader: steps 3 times, then (ready) blocks in its dataset's `__getitem__` (a data loader
  that never returns);
- gil: holds the GIL in one C call (gil.py: signals do not end it) in `hold_the_gil`; a
  ticker thread writes DIR/tick-<pid> every 20 ms while it can run;
- steps: steps every S seconds (heartbeat), and obeys DIR/<what>-<pid>: `block` (blocks in
  `__getitem__` while the file exists; `--start-blocked` makes it before the first step),
  `end` (its run ends: final status, it lingers);
- bare: no rendezvous, no handler; a SIGTERM handler writes DIR/sigterm-<pid>.
"""
from __future__ import annotations

import argparse
import os
import signal
import threading
import time
from pathlib import Path

from gil import hold_gil

from mfotel.node_link import Announcement, NodeLink


class Dataset:
    """A data loader's dataset whose item never comes while `blocked()` holds."""

    def __init__(self, blocked) -> None:
        self.blocked = blocked

    def __getitem__(self, index: int) -> int:
        while self.blocked():
            time.sleep(0.05)
        return index


def hold_the_gil(seconds: int) -> None:
    hold_gil(seconds)   # in one C call, the capture's signal notwithstanding


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("loader", "gil", "steps", "bare"))
    parser.add_argument("dir")
    parser.add_argument("--rank", type=int, default=1)
    parser.add_argument("--step-seconds", type=float, default=0.05)
    parser.add_argument("--start-blocked", action="store_true",
                        help="steps: blocked before the first step (DIR/block-<pid> made)")
    args = parser.parse_args()
    directory, pid = Path(args.dir), os.getpid()
    link = None
    if args.mode == "bare":
        signal.signal(signal.SIGTERM, lambda *_: (directory / f"sigterm-{pid}").write_text("1"))
    else:
        link = NodeLink.join(Announcement(pid, "jt", args.rank, address="127.0.0.1"),
                             directory)
        assert link is not None
    step = 0

    def ready() -> None:
        (directory / f"ready-{pid}").write_text("1")

    def one_step() -> None:
        nonlocal step
        link.step_begin(time.time())
        time.sleep(args.step_seconds)
        step += 1
        link.step_end(step, time.time())
    if args.mode == "loader":
        for _ in range(3):
            one_step()
        ready()
        Dataset(lambda: True)[step]
    elif args.mode == "gil":
        def tick() -> None:
            while True:
                (directory / f"tick-{pid}").write_text(str(time.time()))
                time.sleep(0.02)
        threading.Thread(target=tick, daemon=True).start()
        time.sleep(0.2)
        ready()
        hold_the_gil(600)
    elif args.mode == "steps":
        data = Dataset(lambda: (directory / f"block-{pid}").exists())
        if args.start_blocked:
            (directory / f"block-{pid}").write_text("1")
        ready()
        while True:
            data[step]
            if (directory / f"end-{pid}").exists():
                link.run_ended(time.time())
                time.sleep(600)
            one_step()
    else:
        ready()
        time.sleep(600)


if __name__ == "__main__":
    main()
