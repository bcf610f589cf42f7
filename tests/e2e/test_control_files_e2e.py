"""A FIFO at the control path of a real MindSpore run: training keeps going, the problem is counted
and warned about once, and a later request still applies."""
from __future__ import annotations

import logging
import os

import pytest

from mfotel.actions.control import (
    CONTROL_FILE,
    main,
)
from tests.support.hangs import release_fifo
from tests.support.metrics import step_scraper, value
from tests.support.training import at_step


@pytest.mark.slow
def test_a_fifo_at_the_control_path_does_not_freeze_training(port, in_tmp, caplog):
    """Real MindSpore training with a FIFO at control.json from the start: it keeps training,
    counts the problem once in mfotel_export_errors_total{stage="control"}, warns once, and a
    later `mfotel control --stop` (a regular file) still stops it after the next step."""
    import threading

    from mfotel.demo.training import run_demo
    job_dir = in_tmp / "ctl" / "fifo-job"
    job_dir.mkdir(parents=True)
    fifo = job_dir / CONTROL_FILE
    os.mkfifo(fifo)
    blocked = threading.Event()

    def unblock() -> None:        # on main, rank 0's open() of the FIFO never returns
        blocked.set()
        release_fifo(fifo)()
    watchdog = threading.Timer(120, unblock)
    watchdog.start()
    scraper = step_scraper(f"http://127.0.0.1:{port}/metrics", steps={5, 11})
    try:
        with caplog.at_level(logging.WARNING, logger="mfotel"):
            result = run_demo(steps=60, port=port, job_name="fifo-job", output={"console": False},
                              actions={"control_dir": str(in_tmp / "ctl" / "{job_name}")},
                              extra_callbacks=(scraper, at_step(10, lambda: main(
                                  [str(job_dir), "--stop", "--reason", "after the fifo"]))))
    finally:
        watchdog.cancel()
    assert not blocked.is_set(), "training blocked on the FIFO until the watchdog released it"
    assert max(result.losses) == 11, "the request written at step 10 applies after step 11"
    assert result.monitor.actions.counts[("stop", "control")] == 1
    for step in (5, 11):
        assert value(scraper.bodies[step], "mfotel_export_errors_total", stage="control") == 1
    assert len([r for r in caplog.records if "FIFO" in r.getMessage()]) == 1
