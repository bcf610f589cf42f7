"""OTLP/HTTP push to a real in-test receiver (otlp_receiver; no collector binary runs here).

The receiver decodes the exporter's protobuf with opentelemetry-proto. The tests check the
exporter's payload, that a dead push thread is counted and warned about once, and that warnings
never show the URL's password. Real training runs push in tests/e2e/test_otlp_push_e2e.py.
"""
from __future__ import annotations

import dataclasses
import logging

from opentelemetry.sdk.metrics import MeterProvider

from mfotel.cluster.otlp import OtlpPush
from mfotel.config import OtlpConfig, parse_config
from mfotel.identity import RankIdentity
from mfotel.localstack.servers import free_port
from mfotel.telemetry import Telemetry
from tests.support.otlp_receiver import OtlpReceiver, by_name
from tests.support.ranks import rank_exporter
from tests.support.waiting import settle

JOB = "mfotel-otlp"


def test_receiver_decodes_what_the_sdk_exporter_pushes():
    with OtlpReceiver() as receiver:
        cfg = parse_config({"metrics": ["loss"], "prometheus": {"port": 0},
                            "otlp": {"endpoint": receiver.url, "interval_seconds": 60}})
        exporter = rank_exporter(cfg, RankIdentity(rank=3, world_size=4, node="n1"), JOB)
        exporter.state.loss, exporter.state.steps = 1.25, 7
        exporter.shutdown()  # the final push, sent before shutdown returns
        assert receiver.wait(lambda r: r.requests, settle())
    found = by_name(receiver.requests[-1])
    [loss] = found["mindformers.train.loss"]
    assert (loss.kind, loss.value, loss.attributes) == ("gauge", 1.25,
                                                         {"job_name": JOB, "rank": "3"})
    [steps] = found["mindformers.train.steps"]
    assert (steps.kind, steps.value, steps.monotonic) == ("sum", 7.0, True)
    assert loss.resource["service.name"] == JOB and loss.resource["mfotel.rank"] == 3


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
    push = OtlpPush(parse_config({"otlp": {"endpoint": down, "timeout_seconds": 1}}).otlp,
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
