"""Faults never crash or stall training: each is counted in mfotel_export_errors_total and
warned about once (real MindSpore runs, real files, real HTTP)."""
from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

from mfotel.config import parse_config
from mfotel.demo.training import run_demo
from mfotel.logs.parse import ParseReport, parse_file
from tests.support.metrics import samples, scrape, value
from tests.support.ranks import rank_exporter
from tests.support.training import at_step
from tests.support.waiting import settle, startup, wait_for

pytestmark = pytest.mark.slow




def monitor_steps(path) -> list[int]:
    return [int(line.split(",")[0].split(": ")[1]) for line in path.read_text().splitlines()]


def test_output_directory_removed_mid_run_is_recreated(port, in_tmp):
    logs = in_tmp / "logs"
    result = run_demo(steps=10, port=port, metrics=["loss"], linger_seconds=0,
                      output={"console": False, "file": True, "file_path": "logs/m.log"},
                      extra_callbacks=(at_step(4, lambda: shutil.rmtree(logs)),))
    assert monitor_steps(logs / "m.log") == [5, 6, 7, 8, 9, 10]  # nothing after the removal lost
    assert result.monitor.instruments.state.export_errors["sink"] == 0


def test_unwritable_output_mid_run_is_counted_and_warned_once(port, in_tmp, caplog):
    logs = in_tmp / "logs"

    def block() -> None:  # the directory becomes a file: nothing can be created there
        shutil.rmtree(logs)
        logs.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="mfotel"):
        result = run_demo(steps=10, port=port, metrics=["loss"], linger_seconds=0,
                          output={"console": False, "file": True, "file_path": "logs/m.log"},
                          extra_callbacks=(at_step(4, block),))
    assert len(result.losses) == 10
    assert result.monitor.instruments.state.export_errors["sink"] == 6
    assert sum("sink failed" in r.getMessage() for r in caplog.records) == 1


DISK_FULL = textwrap.dedent("""
    import json, resource, signal, sys
    from mfotel.demo.training import run_demo
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)       # EFBIG instead of being killed
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))  # files of at most 1 KiB: "disk full"
    result = run_demo(steps=int(sys.argv[1]), port=0, metrics=["loss", "learning_rate"],
                      linger_seconds=0, step_interval=1,
                      output={"console": False, "file": True, "file_path": "full/m.log"})
    print(json.dumps({"steps": len(result.losses),
                      "errors": result.monitor.instruments.state.export_errors}))
""")


def test_disk_full_on_the_file_sink(in_tmp):
    done = subprocess.run([sys.executable, "-c", DISK_FULL, "60"], capture_output=True,
                          text=True, timeout=300, cwd=in_tmp)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["steps"] == 60
    assert report["errors"]["sink"] > 0
    assert done.stderr.count("sink failed") == 1
    lines = (in_tmp / "full" / "m.log").read_text().splitlines()
    assert 0 < len(lines) < 60 and os.path.getsize(in_tmp / "full" / "m.log") <= 1024


KILLED = textwrap.dedent("""
    import sys
    from mfotel.demo.training import run_demo
    run_demo(steps=100000, port=0, metrics=["loss", "learning_rate", "grad_norm"],
             linger_seconds=0, min_step_seconds=0.002, output={"console": False, "file": True,
             "file_path": sys.argv[1], "format": sys.argv[2]})
""")


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_kill_9_leaves_only_complete_lines(in_tmp, fmt):
    path = in_tmp / f"m.{fmt}.log"
    process = subprocess.Popen([sys.executable, "-c", KILLED, str(path), fmt],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=in_tmp)
    try:
        # 200 steps of at least 2 ms each after the start: kill 9 in the middle of writing
        wait_for(lambda: path.exists() and path.read_text().count("\n") >= 200,
                 startup() + settle(200 * 0.002), 0.05, "200 lines written", alive=[process])
        os.kill(process.pid, signal.SIGKILL)
        process.wait(10)
    finally:
        if process.poll() is None:
            process.kill()
    text = path.read_text()
    assert text.endswith("\n")
    report = ParseReport()
    rows = list(parse_file(path, report=report))
    assert report.problem_count == 0, report.problems
    steps = [row.step for row in rows]
    assert len(steps) >= 200 and steps == list(range(1, len(steps) + 1))
    assert all(math.isfinite(row.loss) for row in rows)


def test_scrape_storm_every_scrape_answered_and_training_continues(port, in_tmp):
    stop, answered, failures = threading.Event(), [0], []

    def scraper() -> None:
        while not stop.is_set():
            try:
                body = scrape(f"http://127.0.0.1:{port}/metrics")
                if "mindformers_train_steps_total" in body:
                    answered[0] += 1
                else:
                    failures.append("incomplete body")
            except OSError as exc:
                failures.append(repr(exc))

    threads = [threading.Thread(target=scraper, daemon=True) for _ in range(50)]

    def start_storm() -> None:
        for t in threads:
            t.start()

    def end_storm() -> None:  # before the endpoint closes, so no scrape is cut off
        stop.set()
        for t in threads:
            t.join(10)
    result = run_demo(steps=400, port=port, linger_seconds=0, min_step_seconds=0.025,
                      output={"console": False},
                      extra_callbacks=(at_step(1, start_storm), at_step(400, end_storm)))
    assert len(result.losses) == 400
    assert failures == []
    assert answered[0] > 50


def test_exception_inside_extraction_is_counted(port, in_tmp, caplog, monkeypatch):
    import mfotel.callback

    def broken(outputs):
        raise ValueError("unexpected net_outputs")
    monkeypatch.setattr(mfotel.callback, "parse_net_outputs", broken)
    with caplog.at_level(logging.WARNING, logger="mfotel"):
        result = run_demo(steps=6, port=port, linger_seconds=0)
    state = result.monitor.instruments.state
    assert len(result.losses) == 6 and state.steps == 6  # health signals still recorded
    assert state.export_errors["extract"] == 6
    assert sum("unexpected net_outputs" in r.getMessage() for r in caplog.records) == 1


def test_nonfinite_and_huge_values_in_every_metric(port, caplog):
    cfg = parse_config({"metrics": ["loss", "learning_rate", "grad_norm", "throughput"],
                        "prometheus": {"host": "127.0.0.1", "port": port}})
    exporter = rank_exporter(cfg, job_name="huge")
    telemetry, inst = exporter.telemetry, exporter.instruments
    try:
        st = inst.state
        st.loss, st.learning_rate, st.grad_norm, st.throughput = 1e300, math.inf, -1e-300, math.nan
        inst.set_native("weight_norm", math.inf, {"param": "a"})
        inst.set_native("weight_norm", 3e38, {"param": "b"})
        with caplog.at_level(logging.WARNING):
            body = samples(scrape(telemetry.endpoint.url))
        assert value(body, "mindformers_train_loss") == 1e300
        assert value(body, "mindformers_train_grad_norm") == -1e-300
        assert value(body, "mindformers_train_learning_rate") is None  # Inf dropped, not sent
        assert value(body, "mindformers_train_throughput_samples_per_second") is None
        assert value(body, "mindformers_train_weight_norm", param="b") == 3e38
        assert value(body, "mindformers_train_weight_norm", param="a") is None
        assert not [r for r in caplog.records if "not finite" in r.getMessage()]
    finally:
        telemetry.shutdown()
