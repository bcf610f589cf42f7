"""Backfill real runs' logs with the real promtool, serve the blocks with a real Prometheus and
read the logged values back with PromQL."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mfotel.localstack.servers import PROMETHEUS_BINARIES, Prometheus, find_binary
from mfotel.logs.backfill import find_promtool
from mfotel.logs.cli import main as logs_main
from tests.support.paths import FIXTURES

pytestmark = pytest.mark.slow


def test_prometheus_and_promtool_are_installed():
    """Missing binaries fail here with the fix instead of skipping the tests below."""
    assert find_promtool() and find_binary(PROMETHEUS_BINARIES), "apt-get install prometheus"

FIXTURES = FIXTURES / "logs"
CONFIG = "global:\n  scrape_interval: 15s\n"   # no targets: the data is all backfilled


def instant(prom: Prometheus, expr: str, at: float) -> float | None:
    result = prom.query(expr, time_=at)
    assert len(result) <= 1, result
    return float(result[0]["value"][1]) if result else None


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory) -> Path:
    """A real run: the mfotel demo trains a tiny MindSpore network, writing JSON lines."""
    workdir = tmp_path_factory.mktemp("demo")
    log = workdir / "e2e-run" / "train_monitor.jsonl"
    subprocess.run([sys.executable, "-m", "mfotel", "demo", "--steps", "30", "--step-interval",
                    "1", "--port", "0", "--step-sleep", "0.02", "--format", "json",
                    "--file-path", str(log), "--nan-at-step", "20", "--job-name", "e2e"],
                   cwd=workdir, check=True, capture_output=True, timeout=300)
    return log.parent


def test_backfilled_demo_run_reads_back_from_prometheus(demo_run: Path, tmp_path: Path) -> None:
    records = [json.loads(line) for line in
               (demo_run / "train_monitor.jsonl").read_text().splitlines()]
    assert len(records) == 30
    out = tmp_path / "backfill"
    assert logs_main(["backfill", str(demo_run), "--out", str(out), "--create-blocks",
                      "--job-name", "e2e-past", "-q"]) == 0
    assert any((out / "data").iterdir())
    at = {r["step"]: round(r["time"] * 1000) / 1000 for r in records}
    by_step = {r["step"]: r for r in records}
    selector = '{job_name="e2e-past",rank="0"}'
    with Prometheus(CONFIG, workdir=out) as prom:       # --storage.tsdb.path = out/data
        for step in (1, 10, 19):
            assert instant(prom, f"mindformers_train_loss{selector}", at[step]) == \
                by_step[step]["loss"]
            assert instant(prom, f"mindformers_train_learning_rate{selector}", at[step]) == \
                by_step[step]["learning_rate"]
            assert instant(prom, f"mindformers_train_step{selector}", at[step]) == step
        assert by_step[20]["loss"] == "nan"
        # as live: the loss as it is (NaN), loss_finite tells
        assert math.isnan(instant(prom, f"mindformers_train_loss{selector}", at[25]))
        assert instant(prom, f"mindformers_train_loss{selector} != "
                             f"mindformers_train_loss{selector}", at[25]) is not None
        assert instant(prom, f"mindformers_train_loss_finite{selector}", at[19]) == 1
        assert instant(prom, f"mindformers_train_loss_finite{selector}", at[20]) == 0
        nonfinite = 'mindformers_train_nonfinite_total{job_name="e2e-past",rank="0",metric="loss"}'
        assert instant(prom, nonfinite, at[30]) == 11
        assert instant(prom, f"mindformers_train_first_nonfinite_step{selector}", at[30]) == 20
        assert instant(prom, f"mindformers_train_step_duration_seconds_count{selector}",
                       at[30]) == 30
        total = sum(r["step_time"] for r in records)
        assert instant(prom, f"mindformers_train_step_duration_seconds_sum{selector}",
                       at[30]) == pytest.approx(total)


def test_backfill_names_the_job_as_its_json_lines_do(demo_run: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Without --job-name the label is the job_name the lines carry (the live series' label,
    `e2e`), not the folder's name (`e2e-run`): backfilled history joins the live series."""
    records = [json.loads(line) for line in
               (demo_run / "train_monitor.jsonl").read_text().splitlines()]
    assert {r["job_name"] for r in records} == {"e2e"} and demo_run.name == "e2e-run"
    out = tmp_path / "backfill"
    assert logs_main(["backfill", str(demo_run), "--out", str(out), "--create-blocks",
                      "-q"]) == 0
    assert "run e2e-run: job_name e2e (the job_name its JSON lines carry)" in \
        capsys.readouterr().err
    last = round(records[-1]["time"] * 1000) / 1000
    with Prometheus(CONFIG, workdir=out) as prom:
        jobs = prom.query("count by (job_name) (mindformers_train_step)", time_=last)
        assert [(r["metric"]["job_name"], float(r["value"][1])) for r in jobs] == [("e2e", 1.0)]
        assert instant(prom, 'mindformers_train_step{job_name="e2e",rank="0"}', last) == 30


def test_backfilled_text_log_is_placed_by_start_and_step_seconds(tmp_path: Path) -> None:
    """The checked-in real text log (no timestamps): --start + step * --step-seconds."""
    log = FIXTURES / "demo-text"
    logged = {}
    for line in (log / "train_monitor.log").read_text().splitlines():
        fields = dict(p.split(": ") for p in line.removeprefix("[Monitor] ").split(", "))
        logged[int(fields["step"])] = float(fields["loss"])
    start = math.floor(time.time()) - 3600
    out = tmp_path / "backfill"
    assert logs_main(["backfill", str(log), "--out", str(out), "--create-blocks",
                      "--start", str(start), "--step-seconds", "10", "-q"]) == 0
    selector = '{job_name="demo-text",rank="0"}'
    with Prometheus(CONFIG, workdir=out) as prom:
        for step in (1, 9, 21):
            assert instant(prom, f"mindformers_train_loss{selector}", start + 10 * step) == \
                logged[step]
        assert math.isnan(logged[22])
        assert instant(prom, f"mindformers_train_loss_finite{selector}", start + 220) == 0
        # over the whole run: the minimum finite loss, as PromQL sees it
        window = f"{30 * 10}s"
        assert instant(prom, f"min_over_time(mindformers_train_loss{selector}[{window}])",
                       start + 300) == min(v for v in logged.values() if not math.isnan(v))


def test_text_log_of_a_real_run_is_placed_by_its_own_timestamps(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A demo run's `[Monitor]` text lines carry their time: no --start needed, and each
    sample lands at the time its line says."""
    from datetime import datetime
    workdir = tmp_path / "text-run"
    workdir.mkdir()
    subprocess.run([sys.executable, "-m", "mfotel", "demo", "--steps", "20", "--step-interval",
                    "2", "--port", "0", "--step-sleep", "0.02", "--file-path",
                    str(workdir / "monitor_logs" / "m.log"), "--job-name", "text"],
                   cwd=tmp_path, check=True, capture_output=True, timeout=300)
    logged = {}
    for line in (workdir / "monitor_logs" / "m.log").read_text().splitlines():
        fields = dict(p.split(": ", 1) for p in line.removeprefix("[Monitor] ").split(", "))
        at = round(datetime.fromisoformat(fields["time"]).timestamp() * 1000) / 1000
        logged[int(fields["step"])] = (at, float(fields["loss"]))
    assert sorted(logged) == list(range(2, 21, 2))
    out = tmp_path / "backfill"
    assert logs_main(["backfill", str(workdir), "--out", str(out), "--create-blocks", "-q"]) == 0
    # text lines carry no job_name: the run's name, and the output says so
    assert "run text-run: job_name text-run (the run's name: its lines carry no job_name" in \
        capsys.readouterr().err
    selector = '{job_name="text-run",rank="0"}'
    with Prometheus(CONFIG, workdir=out) as prom:
        for step, (at, loss) in logged.items():
            assert instant(prom, f"mindformers_train_step{selector}", at) == step
            assert instant(prom, f"mindformers_train_loss{selector}", at) == loss
        first = min(at for at, _ in logged.values())
        assert instant(prom, f"mindformers_train_step{selector}", first - 0.5) is None
