"""`mfotel demo` trains a real MindSpore network and shows its metrics. `mfotel check` with
mindformers imported: tests/e2e/test_mindformers_check_e2e.py."""
from __future__ import annotations

import pytest

from tests.support.cli import mfotel


@pytest.mark.slow
def test_demo_trains_and_shows_metrics(tmp_path, port):
    done = mfotel("demo", "--steps", "20", "--step-interval", "10", "--step-sleep", "0",
                  "--port", str(port), "--nan-at-step", "15", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [x for x in done.stdout.splitlines() if x.startswith("[Monitor]")]
    assert [x.split(",")[0] for x in lines] == ["[Monitor] step: 10", "[Monitor] step: 20"]
    assert "loss: nan" in lines[1]
    assert 'mindformers_train_loss_finite{job_name="mfotel-demo",rank="0"} 0.0' in done.stdout
    assert ('mindformers_train_first_nonfinite_step{job_name="mfotel-demo",rank="0"} 15.0'
            in done.stdout)
