"""OTEL_SDK_DISABLED in a real MindSpore run: no endpoint, no push, and the monitor lines are
still written. The other OpenTelemetry variables: tests/unit/test_otel_env.py."""
from __future__ import annotations

import logging

import pytest

from tests.support.metrics import scrape


@pytest.mark.slow
def test_sdk_disabled_run_still_writes_monitor_lines(port, in_tmp, monkeypatch, capsys, caplog):
    from mfotel.demo.training import run_demo
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    with caplog.at_level(logging.WARNING, logger="mfotel"):
        result = run_demo(steps=4, port=port, step_interval=2)
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("[Monitor]")]
    assert [x.split(",")[0] for x in lines] == ["[Monitor] step: 2", "[Monitor] step: 4"]
    assert result.monitor.telemetry is not None and result.monitor.telemetry.endpoint is None
    notices = [r.getMessage() for r in caplog.records if "OTEL_SDK_DISABLED" in r.getMessage()]
    assert len(notices) == 1 and "[Monitor]" in notices[0]
    with pytest.raises(OSError):
        scrape(f"http://127.0.0.1:{port}/metrics")
