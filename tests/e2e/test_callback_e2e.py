"""OTelMonitor on real tiny MindSpore trainings (CPU), read back through the real /metrics."""
from __future__ import annotations

import json
import logging
import math
import re
import socket
import threading
import time
from typing import Any

import numpy as np
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_om

from mfotel.demo.training import SyntheticRegression, run_demo
from tests.support.http import get, get_text
from tests.support.metrics import samples, scrape, step_scraper, value
from tests.support.training import at_step

pytestmark = pytest.mark.slow
BATCH = 8


def cosine_lr(step_index: int, total: int, base: float = 0.01) -> float:
    """nn.CosineDecayLR(min=base/100, max=base, decay_steps=total) at `step_index`."""
    low = base / 100
    return low + 0.5 * (base - low) * (1 + math.cos(math.pi * min(step_index, total) / total))


def run(port: int, steps: int, scrape_steps=None, extra=(), **kwargs):
    scraper = step_scraper(f"http://127.0.0.1:{port}/metrics", scrape_steps)
    result = run_demo(steps=steps, port=port, extra_callbacks=(scraper, *extra), **kwargs)
    return result, scraper.bodies


def test_exposed_values_equal_what_the_run_produced(port, in_tmp):
    result, bodies = run(port, 12, {3, 6, 9, 12}, step_interval=3, lr_schedule="cosine")
    for step, body in bodies.items():
        labels = {"job_name": "mfotel-demo", "rank": "0"}
        assert value(body, "mindformers_train_loss", **labels) == result.losses[step]
        assert value(body, "mindformers_train_grad_norm", **labels) == result.grad_norms[step]
        assert value(body, "mindformers_train_learning_rate", **labels) == \
            pytest.approx(cosine_lr(step - 1, 12), rel=1e-5)
        assert value(body, "mindformers_train_step", **labels) == step
        assert value(body, "mindformers_train_steps_total", **labels) == step
        assert value(body, "mindformers_train_samples_total", **labels) == BATCH * step
        assert value(body, "mindformers_train_step_duration_seconds_count", **labels) == step
        assert value(body, "mindformers_train_progress_ratio", **labels) == step / 12
        assert value(body, "mindformers_train_loss_finite", **labels) == 1
        assert value(body, "mindformers_train_status", **labels) == 1
        assert value(body, "mindformers_train_nonfinite_total", metric="loss") == 0
        assert value(body, "mindformers_train_first_nonfinite_step") is None
        assert abs(value(body, "mindformers_train_last_step_timestamp_seconds") - time.time()) < 120
        assert value(body, "mindformers_train_throughput_samples_per_second") > 0
    assert result.monitor.instruments.state.status == 2


def test_list_lr_is_the_one_each_step_used(port, in_tmp):
    schedule = [0.01 * 0.9 ** (i // 5) for i in range(12)]
    result, bodies = run(port, 12, {1, 5, 6, 11}, lr_schedule="list")
    for step, body in bodies.items():
        assert value(body, "mindformers_train_learning_rate") == pytest.approx(schedule[step - 1])


def test_constant_lr(port, in_tmp):
    _, bodies = run(port, 4, {4}, lr_schedule="constant")
    assert value(bodies[4], "mindformers_train_learning_rate") == pytest.approx(0.01)


def _numpy_grad_norm(params: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
    """Global L2 norm of d(MSE)/d(params) for Dense(16,32) -> ReLU -> Dense(32,1), by hand."""
    (w1, b1), (w2, b2) = [(params[f"{i}.weight"], params[f"{i}.bias"]) for i in ("0", "2")]
    z = x @ w1.T + b1
    h = np.maximum(z, 0)
    pred = h @ w2.T + b2
    d = 2 * (pred - y) / pred.size
    dh = (d @ w2) * (z > 0)
    grads = [d.T @ h, d.sum(0), dh.T @ x, dh.sum(0)]
    return float(np.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in grads)))


def test_grad_norm_matches_numpy(port, in_tmp):
    from mindspore.train import Callback
    captured: dict[int, dict[str, np.ndarray]] = {}

    class Weights(Callback):
        def on_train_step_begin(self, run_context):
            cb = run_context.original_args()
            step = int(cb.cur_step_num)  # already the step about to run
            if step in (1, 7):
                # copy: on CPU asnumpy() is a view that the optimizer updates in place
                captured[step] = {p.name: p.asnumpy().copy()
                                  for p in cb.train_network.network.trainable_params()}

    scraper = step_scraper(f"http://127.0.0.1:{port}/metrics", {1, 7})
    run_demo(steps=8, port=port, lr_schedule="constant", extra_callbacks=(Weights(), scraper))
    data = SyntheticRegression(8, BATCH)
    for step in (1, 7):
        rows = slice((step - 1) * BATCH, step * BATCH)
        expected = _numpy_grad_norm(captured[step], data.x[rows], data.y[rows])
        assert value(scraper.bodies[step], "mindformers_train_grad_norm") == \
            pytest.approx(expected, rel=1e-4)


def test_nan_flips_loss_finite_and_is_exposed_as_it_is(port, in_tmp, caplog):
    """Records every 4 steps; the NaN comes at step 6, between two records: /metrics shows it
    at once (text and OpenMetrics, parsed by prometheus_client), not the last finite loss."""
    k, url = 6, f"http://127.0.0.1:{port}/metrics"
    openmetrics: dict[int, str] = {}
    at_k = at_step(k, lambda: openmetrics.update({k: get_text(url, headers={
        "Accept": "application/openmetrics-text; version=1.0.0"})}))
    with caplog.at_level(logging.WARNING, logger="mfotel"):
        result, bodies = run(port, 10, {k - 1, k, k + 2}, nan_at_step=k, step_interval=4,
                             extra=(at_k,))
    assert math.isnan(result.losses[k]) and math.isfinite(result.losses[k - 1])
    assert math.isnan(result.grad_norms[k])
    before, at, after = bodies[k - 1], bodies[k], bodies[k + 2]
    assert value(before, "mindformers_train_loss_finite") == 1
    assert value(at, "mindformers_train_loss_finite") == 0
    assert value(before, "mindformers_train_nonfinite_total", metric="loss") == 0
    assert value(at, "mindformers_train_nonfinite_total", metric="loss") == 1
    assert value(after, "mindformers_train_nonfinite_total", metric="loss") == 3  # stays NaN
    assert value(before, "mindformers_train_loss") == result.losses[4]  # the last record
    assert math.isnan(value(at, "mindformers_train_loss"))             # as it is
    assert math.isnan(value(at, "mindformers_train_grad_norm"))
    assert math.isnan(value(after, "mindformers_train_loss"))          # a record step
    om = {f.name: f.samples for f in parse_om(openmetrics[k])}
    assert [math.isnan(s.value) for s in om["mindformers_train_loss"]] == [True]
    assert [math.isnan(s.value) for s in om["mindformers_train_grad_norm"]] == [True]
    assert [s.value for s in om["mindformers_train_loss_finite"]] == [0]
    assert value(at, "mindformers_train_first_nonfinite_step") == k
    nan_warnings = [r for r in caplog.records if "loss is nan" in r.getMessage()]
    assert len(nan_warnings) == 1 and f"step {k}" in nan_warnings[0].getMessage()


def test_on_nonfinite_stop_ends_the_run_cleanly(port, in_tmp):
    result = run_demo(steps=20, port=port, nan_at_step=5, on_nonfinite="stop")
    assert max(result.losses) == 5
    assert result.monitor.instruments.state.status == 3


def test_status_completed_is_scrapeable_during_linger(port, in_tmp):
    seen: list[float] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            try:
                status = value(samples(scrape(f"http://127.0.0.1:{port}/metrics")),
                               "mindformers_train_status")
                if status is not None and (not seen or seen[-1] != status):
                    seen.append(status)
            except OSError:
                pass
            stop.wait(0.05)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    result = run_demo(steps=30, port=port, linger_seconds=60.0, min_step_seconds=0.02)
    stop.set()
    poller.join(5)
    assert seen[-1] == 2 and 1 in seen
    assert result.monitor.final_scraped  # the linger ended at the first scrape of status 2
    with pytest.raises(OSError):
        scrape(f"http://127.0.0.1:{port}/metrics")  # endpoint stopped after the linger


def test_console_and_file_lines_line_by_line(port, in_tmp, capsys):
    result = run_demo(steps=10, port=port, step_interval=3, metrics=["loss", "grad_norm"],
                      output={"console": True, "file": True,
                              "file_path": "logs/{job_name}_{rank}.log"})
    expected = [f"[Monitor] step: {s}, loss: {result.losses[s]:.6g}, "
                f"grad_norm: {result.grad_norms[s]:.6g}" for s in (3, 6, 9)]
    path = in_tmp / "logs" / "mfotel-demo_0.log"
    # every line ends with its time field (", time: <ISO 8601>"), checked in test_sinks.py; the
    # file's lines, the run's record, carry the time account before it (test_time_account_e2e)
    lines = [line.rpartition(", time: ")[0] for line in path.read_text().splitlines()]
    assert [line.partition(", account_steps: ")[0] for line in lines] == expected
    assert all(", account_startup: " in line and line.endswith(" s") for line in lines)
    out = capsys.readouterr().out
    assert [line.rpartition(", time: ")[0] for line in out.splitlines()
            if line.startswith("[Monitor]")] == expected
    assert f"writes monitor lines to {path}" in out  # the resolved absolute path, once


def test_json_lines_file(port, in_tmp):
    result = run_demo(steps=6, port=port, step_interval=2, metrics=["loss"], nan_at_step=4,
                      output={"console": False, "file": True, "file_path": "m.jsonl",
                              "format": "json"})
    records = [json.loads(line) for line in (in_tmp / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4, 6]
    assert records[0]["loss"] == result.losses[2] and records[1]["loss"] == "nan"
    assert {r["rank"] for r in records} == {0} and records[0]["job_name"] == "mfotel-demo"


@pytest.mark.parametrize("log_rank, rank, writes", [(0, 1, False), ([1, 3], 1, True),
                                                    (-1, 5, True), (0, 0, True)])
def test_log_rank_gates_console_and_file(port, in_tmp, capsys, monkeypatch, log_rank, rank, writes):
    monkeypatch.setenv("RANK_ID", str(rank))
    monkeypatch.setenv("RANK_SIZE", "8")
    result = run_demo(steps=4, port=port, step_interval=2, metrics=["loss"], log_rank=log_rank,
                      output={"console": True, "file": True, "file_path": "m_{rank}.log"})
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("[Monitor]")]
    path = in_tmp / f"m_{rank}.log"
    assert (len(lines) == 2) is writes and path.exists() is writes
    assert result.monitor.identity.rank == rank


def test_dense_early_interval_shows_in_lines(port, in_tmp, capsys):
    run_demo(steps=25, port=port, step_interval=10, early_steps=3, metrics=["loss"])
    steps = [int(x.split(",")[0].split(": ")[1]) for x in capsys.readouterr().out.splitlines()
             if x.startswith("[Monitor]")]
    assert steps == [1, 2, 3, 10, 20]


def test_port_in_use_warns_and_training_continues(port, in_tmp, caplog):
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", port))
    blocker.listen()
    try:
        with caplog.at_level(logging.WARNING, logger="mfotel"):
            result = run_demo(steps=5, port=port)
    finally:
        blocker.close()
    assert len(result.losses) == 5
    message = " ".join(r.getMessage() for r in caplog.records)
    assert f"127.0.0.1:{port}" in message and "rank 0" in message
    assert "training continues" in message
    assert result.monitor.instruments.state.export_errors["server"] == 1


def test_failure_inside_the_callback_is_counted_not_raised(port, in_tmp, caplog, monkeypatch):
    from mfotel.callback import LearningRateReader

    def broken(self, optimizer):
        raise RuntimeError("lr exploded")
    monkeypatch.setattr(LearningRateReader, "find", broken)
    with caplog.at_level(logging.WARNING, logger="mfotel"):
        result = run_demo(steps=6, port=port)
    assert len(result.losses) == 6
    assert result.monitor.instruments.state.export_errors["callback"] == 6
    assert sum("lr exploded" in r.getMessage() for r in caplog.records) == 1  # warned once


def test_one_monitor_for_two_train_calls_ends_each_run(port, in_tmp):
    """Notebooks and two-phase scripts call Model.train twice with the same callbacks: the second
    run starts anew (steps, status, endpoint) and ends as the first did, endpoint stopped,
    rather than leaving its endpoint up with status running until the process exits."""
    import mindspore.dataset as ds

    from mfotel import OTelMonitor
    from mfotel.demo.training import build_model

    monitor = OTelMonitor(step_interval=2, metrics=["loss"], job_name="two-runs",
                          output={"console": False, "file": True, "file_path": "m.log"},
                          prometheus={"host": "127.0.0.1", "port": port, "linger_seconds": 0})
    url = f"http://127.0.0.1:{port}/metrics"
    for steps in (6, 4):
        scraper = step_scraper(url)
        data = ds.GeneratorDataset(SyntheticRegression(steps, BATCH), ["x", "y"],
                                   shuffle=False).batch(BATCH)
        build_model(steps, BATCH, "cosine").train(1, data, callbacks=[monitor, scraper],
                                                  dataset_sink_mode=False)
        last = scraper.bodies[steps]
        assert value(last, "mindformers_train_step") == steps          # counted from 1 again
        assert value(last, "mindformers_train_steps_total") == steps
        assert value(last, "mindformers_train_status") == 1
        assert monitor.instruments.state.status == 2                     # completed
        with pytest.raises(OSError):
            scrape(url)                                                  # endpoint stopped
    steps_logged = [int(line.split(",")[0].split()[-1])
                    for line in (in_tmp / "m.log").read_text().splitlines()]
    assert steps_logged == [2, 4, 6, 2, 4]                               # both runs, appended


def test_the_logging_rank_prints_where_its_endpoint_is(port, in_tmp, capfd):
    """A plain MindSpore run says at train begin where /metrics and the live page are (stdout:
    a plain run configures no logging), and the address printed answers."""
    from mindspore.train import Callback
    fetched: dict[str, int] = {}

    class FetchPrinted(Callback):
        def on_train_step_end(self, run_context: Any) -> None:
            if int(run_context.original_args().cur_step_num) != 2:
                return
            printed = [line for line in capfd.readouterr().out.splitlines()
                       if line.startswith("mfotel: job mfotel-demo on ")]
            fetched["lines"] = len(printed)
            found = re.search(r" /metrics at (\S+) \(local rank 0\); the live page at / of "
                              r"each port, e\.g\. (\S+) \(loopback only: ", printed[0])
            assert found, printed
            metrics, page = found.groups()
            assert metrics == f"http://127.0.0.1:{port}/metrics"
            assert page == f"http://127.0.0.1:{port}/"
            fetched["step"] = value(samples(scrape(metrics)), "mindformers_train_step")
            fetched["page"] = get(page).status
    run_demo(steps=3, port=port, extra_callbacks=(FetchPrinted(),), output={"console": False})
    assert fetched == {"lines": 1, "step": 2, "page": 200}
