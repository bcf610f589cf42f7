"""The file sink in a real MindSpore run whose disk fills up (RLIMIT_FSIZE in a child process)
and is freed later: the file holds whole lines only. The line formats and the sink's writes
without training: tests/unit/test_sinks.py.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap

import pytest

from mfotel import sinks
from mfotel.logs.parse import ParseReport, parse_file
from tests.support.lines import split_time

DISK_FULL_RUN = textwrap.dedent("""
    import json, resource, signal, sys
    from mindspore.train import Callback
    from mfotel.demo.training import run_demo
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.RLIM_INFINITY))

    class FreeTheDisk(Callback):
        def on_train_step_end(self, run_context):
            cb = run_context.original_args()
            if cb.cur_step_num == int(sys.argv[2]):
                for callback in cb.list_callback:   # lines are written by their own thread:
                    if hasattr(callback, "flush_lines"):   # those of the full disk first
                        assert callback.flush_lines(30)
                resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)

    result = run_demo(steps=int(sys.argv[1]), port=0, metrics=["loss", "learning_rate"],
                      linger_seconds=0, lr_schedule="constant",
                      output={"console": False, "file": True, "file_path": "full/m.log"},
                      extra_callbacks=(FreeTheDisk(),))
    print(json.dumps({"losses": {str(k): v for k, v in result.losses.items()},
                      "errors": result.monitor.instruments.state.export_errors}))
""")


@pytest.mark.slow
def test_training_through_a_full_disk_writes_whole_lines_only(tmp_path):
    """A real run fills its 1 KiB "disk", which is freed at step 30: the file holds whole lines
    of the steps before and after, each with the step's real loss, and nothing else."""
    done = subprocess.run([sys.executable, "-c", DISK_FULL_RUN, "40", "30"], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    losses = {int(step): loss for step, loss in result["losses"].items()}
    data = (tmp_path / "full" / "m.log").read_bytes()
    text = data.decode()
    assert text.endswith("\n") and "\n\n" not in text
    lines = text.splitlines()
    steps = []
    for line in lines:
        head, at = split_time(line)
        step = int(head.split(",")[0].removeprefix("[Monitor] step: "))
        seed, _, account = head.partition(", account_steps: ")   # the time account: files'
        assert seed == (f"[Monitor] step: {step}, loss: {sinks.format_value('loss', losses[step])}"
                        f", learning_rate: 1.000000e-02")
        assert account.startswith(f"{step}, account_startup: ") and account.endswith(" s")
        assert math.isfinite(at)
        steps.append(step)
    before = [s for s in steps if s <= 30]
    assert before == list(range(1, len(before) + 1)) and 0 < len(before) < 30
    assert steps[len(before):] == list(range(31, 41))
    assert len(text[:sum(len(x) + 1 for x in lines[:len(before)])]) <= 1024
    assert result["errors"]["sink"] == 30 - len(before)
    report = ParseReport()
    assert [r.step for r in parse_file(tmp_path / "full" / "m.log", report=report)] == steps
    assert report.problem_count == 0
