"""OTLP/HTTP push to a real in-test receiver (otlp_receiver; no collector binary runs here).

The receiver decodes the exporter's protobuf with opentelemetry-proto. The tests check that the
payload carries the names, values and attributes the Prometheus endpoint shows, that a collector
that is down is counted and warned about once, and that a hung collector does not hold training.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import pytest

from conftest import samples, scrape, value
from opentelemetry.sdk.metrics import MeterProvider

from mfotel.cluster.otlp import OtlpPush
from mfotel.config import OtlpConfig, parse_config
from mfotel.contract import CONTRACT
from mfotel.identity import RankIdentity
from mfotel.instruments import Instruments
from otlp_receiver import OtlpReceiver, Point, points
from mfotel.demo.stack import free_port
from mfotel.telemetry import Telemetry
from multirank_support import EndpointPoller

JOB = "mfotel-otlp"


def _by_name(request: Any) -> dict[str, list[Point]]:
    found: dict[str, list[Point]] = {}
    for point in points(request):
        found.setdefault(point.name, []).append(point)
    return found


def test_receiver_decodes_what_the_sdk_exporter_pushes():
    with OtlpReceiver() as receiver:
        cfg = parse_config({"metrics": ["loss"], "prometheus": {"port": 0},
                            "otlp": {"endpoint": receiver.url, "interval_seconds": 60}})
        telemetry = Telemetry(cfg, RankIdentity(rank=3, world_size=4, node="n1"), JOB)
        inst = Instruments(telemetry.start(), {"job_name": JOB, "rank": "3"}, cfg.metrics)
        inst.state.loss, inst.state.steps = 1.25, 7
        telemetry.shutdown()  # the final push
        assert receiver.wait(lambda r: r.requests, 10)
    found = _by_name(receiver.requests[-1])
    [loss] = found["mindformers.train.loss"]
    assert (loss.kind, loss.value, loss.attributes) == ("gauge", 1.25, {"job_name": JOB, "rank": "3"})
    [steps] = found["mindformers.train.steps"]
    assert (steps.kind, steps.value, steps.monotonic) == ("sum", 7.0, True)
    assert loss.resource["service.name"] == JOB and loss.resource["mfotel.rank"] == 3


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
                          otlp={"endpoint": receiver.url, "interval_seconds": 0.2})
    final_scrape = [b for b in poller.bodies["r0"] if value(b, "mindformers_train_status") == 2][-1]
    final_push = _by_name(receiver.requests[-1])  # sent at shutdown, after the final scrape
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


def _wait_in_training(at_step: int, condition: Any, what: str) -> Any:
    """A callback that, at `at_step`, waits (bounded) until `condition()` holds."""
    from mindspore.train import Callback

    class Wait(Callback):
        def on_train_step_end(self, run_context: Any) -> None:
            if int(run_context.original_args().cur_step_num) == at_step:
                deadline = time.monotonic() + 30
                while not condition() and time.monotonic() < deadline:
                    time.sleep(0.02)
                assert condition(), f"{what} did not happen within 30 s"
    return Wait()


@pytest.mark.slow
def test_collector_down_counts_errors_and_warns_once(port, in_tmp, caplog):
    from mfotel.demo.training import run_demo
    url = f"http://127.0.0.1:{port}/metrics"
    errors = lambda: value(samples(scrape(url)), "mfotel_export_errors_total",  # noqa: E731
                           stage="otlp") >= 2
    down = f"http://127.0.0.1:{free_port()}/v1/metrics"  # nothing listens there
    with caplog.at_level(logging.DEBUG):
        result = run_demo(steps=20, port=port, job_name=JOB, linger_seconds=0,
                          otlp={"endpoint": down, "interval_seconds": 0.1, "timeout_seconds": 0.5},
                          extra_callbacks=(_wait_in_training(5, errors, "two failed OTLP pushes"),))
    assert len(result.losses) == 20  # training finished
    assert result.monitor.instruments.state.export_errors["otlp"] >= 2
    warnings = [r for r in caplog.records if "OTLP export" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert down in warnings[0].getMessage() and "mfotel_export_errors_total" in warnings[0].getMessage()
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

    with OtlpReceiver(hang=True) as receiver:
        result = run_demo(steps=20, port=port, job_name=JOB, linger_seconds=0,
                          otlp={"endpoint": receiver.url, "interval_seconds": 0.1,
                                "timeout_seconds": 60},
                          extra_callbacks=(_wait_in_training(3, lambda: receiver.received >= 1,
                                                             "a push reaching the collector"),
                                           LastStep()))
    assert len(result.losses) == 20
    received, answered = at_last_step[0]
    assert received >= 1 and answered == 0  # steps 4..20 ran while that push hung
    assert result.monitor.instruments.state.export_errors["otlp"] == 0  # released, not failed


def _otlp_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "OTLP" in r.getMessage()]


def test_a_dead_push_thread_is_counted_and_warned_about_once(caplog):
    """The SDK's reader thread dies silently on errors outside the export (here an interval
    too large for Event.wait, which config validation refuses but a direct OtlpConfig does not)."""
    errors: list[str] = []
    cfg = OtlpConfig(endpoint=f"http://127.0.0.1:{free_port()}/v1/metrics", interval_seconds=1e300)
    with caplog.at_level(logging.WARNING, logger="mfotel"):
        telemetry = Telemetry(parse_config({"prometheus": {"port": 0}}), RankIdentity(), JOB,
                              on_error=errors.append)
        telemetry.cfg = dataclasses.replace(telemetry.cfg, otlp=cfg)
        telemetry.start()
        threads = [r._daemon_thread for p in telemetry.providers for r in p._metric_readers
                   if getattr(r, "_daemon_thread", None) is not None]
        for thread in threads:
            thread.join(10)
    assert len(threads) == 2 and not any(t.is_alive() for t in threads)
    assert errors == ["otlp", "otlp"]  # each reader's death counted
    warning, = _otlp_warnings(caplog)
    assert warning.startswith("mfotel: the OTLP push thread stopped (OverflowError")
    assert 'mfotel_export_errors_total{stage="otlp"}' in warning
    telemetry.shutdown()


def test_failure_warnings_never_show_the_url_password(caplog):
    down = f"http://trainer:s3cret-pw@127.0.0.1:{free_port()}"
    errors: list[int] = []
    push = OtlpPush(parse_config({"otlp": {"endpoint": down, "timeout_seconds": 0.5}}).otlp,
                    on_error=lambda: errors.append(1))
    with caplog.at_level(logging.WARNING, logger="mfotel"):
        provider = MeterProvider(metric_readers=[push.reader()])
        provider.get_meter("t").create_counter("c").add(1)
        provider.force_flush(timeout_millis=5000)  # an export; nothing is listening
        provider.shutdown(timeout_millis=2000)
    assert errors
    warning, = _otlp_warnings(caplog)
    assert "s3cret-pw" not in warning
    assert "http://trainer:***@127.0.0.1:" in warning and "/v1/metrics" in warning
