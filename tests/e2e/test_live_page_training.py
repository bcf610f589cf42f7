"""The live page fed by OTelMonitor during a real MindSpore run (CPU, graph mode)."""
from __future__ import annotations

import logging
import math
from itertools import pairwise
from typing import Any

import pytest

from tests.support.http import get
from tests.support.live_page import decoded, strict_json
from tests.support.metrics import samples, value

pytestmark = pytest.mark.slow


def fetch_at_last_step(url: str, last_step: int, into: dict,
                       others: tuple[str, ...] = ()) -> Any:
    """A callback (after the monitor) that GETs `url` at the end of the last step, its body
    parsed as strict JSON (no NaN: what a browser accepts); and the paths `others` of the
    same endpoint, their text in into[path]."""
    from mindspore.train import Callback

    class Fetch(Callback):
        def on_train_step_end(self, run_context: Any) -> None:
            if int(run_context.original_args().cur_step_num) != last_step:
                return
            reply = get(url)
            into["status"] = reply.status
            if reply.status == 200:
                into["body"] = strict_json(reply.body)
            base = url.split("/", 3)[:3]
            for path in others:
                into[path] = get("/".join(base) + path).text
    return Fetch()


def test_the_page_shows_a_real_runs_records_and_marks_a_nan_between_records(port, in_tmp, caplog):
    from mfotel.demo.training import run_demo
    got: dict = {}
    with caplog.at_level(logging.INFO, logger="mfotel"):
        result = run_demo(steps=30, step_interval=5, port=port, nan_at_step=13,
                          output={"console": False},
                          extra_callbacks=(fetch_at_last_step(
                              f"http://127.0.0.1:{port}/api/history", 30, got,
                              ("/metrics", "/api/summary", "/api/history?format=numbers",
                               "/api/overview")),))
    assert f"live page http://127.0.0.1:{port}/" in caplog.text
    assert got["status"] == 200
    data, current = decoded(got["body"]), got["body"]["current"]
    assert data["steps"] == [5, 10, 15, 20, 25, 30]     # the record steps, as [Monitor] lines
    loss = data["series"]["loss"]
    assert loss[:2] == [result.losses[5], result.losses[10]] and loss[2:] == [None] * 4
    assert data["series"]["grad_norm"][:2] == [result.grad_norms[5], result.grad_norms[10]]
    lr = data["series"]["learning_rate"]
    assert all(a > b > 0 for a, b in pairwise(lr))    # the cosine schedule
    assert all(v > 0 for v in data["series"]["step_time"])
    assert all(v is None or v > 0 for v in data["series"]["throughput"])
    # step 13 is no record step: its NaN is marked all the same, as one range up to now
    assert {"metric": "loss", "first": 13, "last": 30, "value": "NaN"} in data["marks"]
    assert all(math.isnan(result.losses[s]) for s in range(13, 31))
    assert (current["step"], current["first_nonfinite_step"]) == (30, 13)
    assert current["nonfinite_now"]["loss"] == "NaN" and current["nonfinite_total"]["loss"] == 18
    # /metrics shows the loss as it is (NaN); JSON has no NaN: null, and nonfinite_values
    # says what /metrics shows
    assert current["status_name"] == "running" and current["loss"] is None
    assert current["nonfinite_values"] == {"loss": "NaN", "grad_norm": "NaN"}
    assert math.isnan(value(samples(got["/metrics"]), "mindformers_train_loss"))
    for path in ("/api/summary", "/api/history?format=numbers", "/api/overview"):
        strict_json(got[path])   # valid JSON, NaN nowhere
    numbers = strict_json(got["/api/history?format=numbers"])
    assert numbers["series"]["loss"][2:] == [None] * 4
    assert strict_json(got["/api/summary"])["nonfinite_values"]["loss"] == "NaN"


def test_prometheus_ui_false_leaves_only_metrics(port, in_tmp):
    from mfotel.demo.training import run_demo
    page: dict = {}
    result = run_demo(steps=6, step_interval=1, port=port, output={"console": False},
                      prometheus={"host": "127.0.0.1", "port": port, "ui": False},
                      extra_callbacks=(fetch_at_last_step(f"http://127.0.0.1:{port}/api/summary",
                                                          6, page),))
    assert page["status"] == 404 and result.monitor.live is None
