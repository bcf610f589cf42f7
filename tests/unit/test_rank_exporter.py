"""The rank-exporter factory (mfotel.rank_exporter): a real rank's endpoint in one call, and
the step-duration queue that keeps the SDK's work off the training thread."""
from __future__ import annotations

import time

from mfotel import instruments as instruments_module
from mfotel.config import parse_config
from mfotel.identity import RankIdentity, RunIdentity
from mfotel.rank_exporter import rank_exporter
from tests.support.metrics import samples, scrape, value


def _cfg(port: int, **extra: object):
    return parse_config({"metrics": ["loss", "step_time"], **extra,
                         "prometheus": {"host": "127.0.0.1", "port": port}})


def test_a_rank_exporter_serves_the_contract_with_identity_and_run(port):
    identity = RankIdentity(rank=3, local_rank=0, world_size=4, node="n1", device_id="0")
    run = RunIdentity(run_id="r-1", attempt=2, configured=True)
    with rank_exporter(_cfg(port), identity, "llama", run=run) as exporter:
        exporter.state.loss = 2.5
        exporter.instruments.record_step_seconds(0.2)
        exporter.instruments.touch()
        body = samples(scrape(exporter.url))
    labels = {"job_name": "llama", "rank": "3"}
    assert value(body, "mindformers_train_loss", **labels) == 2.5
    assert value(body, "mindformers_train_step_duration_seconds_count", **labels) == 1
    assert value(body, "mindformers_train_rank_info", run_id="r-1", attempt="2", node="n1") == 1
    assert value(body, "target_info", mfotel_run_id="r-1", mfotel_attempt="2") == 1
    assert value(body, "mfotel_export_errors_total", stage="scrape") == 0  # pre-created


def test_serve_false_leaves_room_for_routes_and_errors_are_counted(port):
    errors: list[str] = []
    exporter = rank_exporter(_cfg(port), RankIdentity(), "j", on_error=errors.append,
                             serve=False)
    try:
        assert exporter.url is None
        exporter.serve({"/hello": lambda environ, start: (start("200 OK", []), [b"hi"])[1]})
        assert scrape(exporter.url.replace("/metrics", "/hello")) == "hi"
        exporter.telemetry.on_error("otlp")              # what a failing push reports
        assert errors == ["otlp"] and exporter.state.export_errors["otlp"] == 1
    finally:
        exporter.shutdown()


def test_step_durations_wait_for_a_collection_or_a_hand_over_thread(port, monkeypatch):
    """record_step_seconds only queues; a scrape hands the queue to the SDK, and so does a
    short-lived thread when PENDING_LIMIT wait and nobody scrapes (bounded memory)."""
    monkeypatch.setattr(instruments_module, "PENDING_LIMIT", 100)
    with rank_exporter(_cfg(port), RankIdentity(), "j") as exporter:
        inst = exporter.instruments
        for _ in range(50):
            inst.record_step_seconds(0.1)
        assert inst.pending_step_durations == 50                    # only queued
        inst.touch()
        body = samples(scrape(exporter.url))                        # the scrape hands over
        assert value(body, "mindformers_train_step_duration_seconds_count") == 50
        assert inst.pending_step_durations == 0
        for _ in range(150):                                        # nobody scrapes
            inst.record_step_seconds(0.1)
        deadline = time.monotonic() + 10
        while inst.pending_step_durations >= 100 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert inst.pending_step_durations < 100                    # handed over meanwhile
        inst.touch()
        body = samples(scrape(exporter.url))
        assert value(body, "mindformers_train_step_duration_seconds_count") == 200
