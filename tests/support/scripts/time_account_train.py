"""The demo training in its own process, for tests/e2e/test_time_account_e2e.py: 30 steps
recorded every 5 into a text monitor log, a checkpoint every 10 steps, an evaluation after the
epoch (Model.fit), /metrics kept up until a scrape has seen the final status.

    python tests/support/scripts/time_account_train.py '{"port": 9464, "log_file": "m.log"}'

Prints "returned" when training returned.
"""
from __future__ import annotations

import json
import sys


def main() -> None:
    opts = json.loads(sys.argv[1])
    from mfotel.demo.training import run_demo
    run_demo(steps=30, step_interval=5, port=opts["port"], job_name="account",
             lr_schedule="constant", checkpoint_steps=10, checkpoint_dir=opts["checkpoint_dir"],
             evaluate=True, output={"console": False, "file": True,
                                    "file_path": opts["log_file"]},
             prometheus={"linger_seconds": 120, "linger_until_scraped": True})
    print("returned", flush=True)


if __name__ == "__main__":
    main()
