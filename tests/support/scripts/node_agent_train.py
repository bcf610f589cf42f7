"""examples/multirank/train_dp.py with faults a test triggers by file (node agent tests).

    msrun ... tests/support/scripts/node_agent_train.py --fault-dir DIR [train_dp.py options]

At the end of each step rank r looks in DIR for
- hold-<r> (seconds): hold the GIL that long in one C call, as graph compilation does
  (gil.py: `ctypes.PyDLL` never releases it, and the node agent's stack capture, a signal,
  does not end it early), then train on; held-<r> / released-<r> get the times;
- raise-<r>: raise, so training fails (the rank reports status 3) and the process exits
  with status 3.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples" / "multirank"))
import train_dp
from gil import hold_gil
from handover import write_atomically

EXIT_STATUS = 3


class InjectedFault(RuntimeError):
    pass


def with_faults(inner: Any, folder: Path) -> Any:
    """`inner` (train_dp's per-step callback), then the faults DIR asks for."""
    from mindspore.train import Callback

    rank = os.environ.get("RANK_ID", "0")

    class Faults(Callback):
        def on_train_begin(self, run_context: Any) -> None:
            inner.on_train_begin(run_context)

        def on_train_step_end(self, run_context: Any) -> None:
            inner.on_train_step_end(run_context)
            trigger = folder / f"hold-{rank}"
            if trigger.exists():
                seconds = int(trigger.read_text())
                trigger.unlink()
                write_atomically(folder / f"held-{rank}", str(time.time()))
                hold_gil(seconds)
                write_atomically(folder / f"released-{rank}", str(time.time()))
            if (folder / f"raise-{rank}").exists():
                raise InjectedFault(f"rank {rank}: fault injected by the test")
    return Faults()


def main() -> None:
    argv = sys.argv[1:]
    where = argv.index("--fault-dir")
    folder = Path(argv[where + 1])
    del argv[where:where + 2]
    truth = train_dp.truth_callback
    train_dp.truth_callback = lambda *args: with_faults(truth(*args), folder)
    try:
        train_dp.main(argv)
    except InjectedFault:
        sys.exit(EXIT_STATUS)


if __name__ == "__main__":
    main()
