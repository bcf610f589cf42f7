"""Real MindSpore training pushing OTLP/HTTP to the in-test receiver
(tests/support/otlp_receiver.py; no collector binary runs here): the push carries the values and
labels the endpoint serves, a
collector that is down is counted and warned about once, a hung collector does not hold training.
"""
from __future__ import annotations

import logging
from typing import Any

import pytest

from mfotel.contract import CONTRACT
from mfotel.localstack.servers import free_port
from tests.support.metrics import samples, scrape, value
from tests.support.multirank import EndpointPoller
from tests.support.otlp_receiver import OtlpReceiver, Point, by_name
from tests.support.training import wait_at_step
from tests.support.waiting import settle

JOB = "mfotel-otlp"


def _sample_for(point: Point) -> tuple[str, ...]:
    """Prometheus sample names of a contract instrument's OTLP point."""
    spec = next(s for s in CONTRACT if s.otel_name == point.name)
    if point.kind == "histogram":
        return (spec.prometheus_name + "_count", spec.prometheus_name + "_sum")
    return (spec.sample_name,)


@pytest.mark.slow
def test_training_pushes_the_values_and_labels_it_serves(port, in_tmp):
    from mfotel.demo.training import run_demo
    with OtlpReceiver() as receiver, \
            EndpointPoller({"r0": f"http://127.0.0.1:{port}/metrics"}) as poller:
        result = run_demo(steps=12, port=port, job_name=JOB, linger_seconds=30,
                          otlp={"endpoint": receiver.url, "interval_seconds": 1})
    final_scrape = [b for b in poller.bodies["r0"] if value(b, "mindformers_train_status") == 2][-1]
    final_push = by_name(receiver.requests[-1])  # sent at shutdown, after the final scrape
    contract_points = [p for name, pts in final_push.items() for p in pts
                       if any(s.otel_name == name for s in CONTRACT)]
    assert {p.name for p in contract_points} >= {"mindformers.train.loss",
                                                 "mindformers.train.learning_rate",
                                                 "mindformers.train.step.duration",
                                                 "mindformers.train.status",
                                                 "mfotel.export.errors"}
    for point in contract_points:
        names = _sample_for(point)
        expected = [value(final_scrape, n, **point.attributes) for n in names]
        got = [point.count, point.sum] if point.kind == "histogram" else [point.value]
        assert got == expected, point.name
        assert point.attributes["job_name"] == JOB and point.attributes["rank"] == "0"
    assert final_push["mindformers.train.loss"][0].value == result.losses[12]
    assert final_push["mindformers.train.step"][0].value == 12
    resource = contract_points[0].resource
    assert resource["service.name"] == JOB and resource["mfotel.rank"] == 0


@pytest.mark.slow
def test_collector_down_counts_errors_and_warns_once(port, in_tmp, caplog):
    from mfotel.demo.training import run_demo
    url = f"http://127.0.0.1:{port}/metrics"

    def errors() -> bool:
        return (value(samples(scrape(url)), "mfotel_export_errors_total", stage="otlp") or 0) >= 2

    down = f"http://127.0.0.1:{free_port()}/v1/metrics"  # nothing listens there
    interval, timeout = 1, 1  # the floors of both keys
    two_failed = wait_at_step(5, errors, settle(2 * (interval + timeout)), "two failed OTLP pushes")
    with caplog.at_level(logging.DEBUG):
        result = run_demo(steps=20, port=port, job_name=JOB, linger_seconds=0,
                          otlp={"endpoint": down, "interval_seconds": interval,
                                "timeout_seconds": timeout},
                          extra_callbacks=(two_failed,))
    assert len(result.losses) == 20  # training finished
    assert result.monitor.instruments.state.export_errors["otlp"] >= 2
    warnings = [r for r in caplog.records if "OTLP export" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    warning = warnings[0].getMessage()
    assert down in warning and "mfotel_export_errors_total" in warning
    assert not [r for r in caplog.records if r.name.startswith("opentelemetry.exporter")]


@pytest.mark.slow
def test_hung_collector_does_not_hold_training(port, in_tmp):
    from mindspore.train import Callback

    from mfotel.demo.training import run_demo
    at_last_step: list[tuple[int, int]] = []

    class LastStep(Callback):
        def on_train_step_end(self, run_context: Any) -> None:
            if int(run_context.original_args().cur_step_num) == 20:
                at_last_step.append((receiver.received, receiver.answered))
                receiver.release()  # let the final push at shutdown through

    interval = 1  # the floor of otlp.interval_seconds
    with OtlpReceiver(hang=True) as receiver:
        pushed = wait_at_step(3, lambda: receiver.received >= 1, settle(interval),
                              "a push reaching the collector")
        result = run_demo(steps=20, port=port, job_name=JOB, linger_seconds=0,
                          otlp={"endpoint": receiver.url, "interval_seconds": interval,
                                "timeout_seconds": 60},
                          extra_callbacks=(pushed, LastStep()))
    assert len(result.losses) == 20
    received, answered = at_last_step[0]
    assert received >= 1 and answered == 0  # steps 4..20 ran while that push hung
    assert result.monitor.instruments.state.export_errors["otlp"] == 0  # released, not failed
