"""End to end: NaN -> Prometheus rule -> Alertmanager -> receiver -> control file -> run stops.

The real binaries run the shipped prometheus.yml, alertmanager.yml and prometheus/rules with
the intervals shortened (mfotel.localstack.alerting.AlertingStack: 1 s scrape and evaluation, no
group_wait). Alertmanager authenticates to the receiver with a bearer token from a file, as a
receiver that acts requires. The run is configured to continue on NaN (on_nonfinite: warn);
only the page can stop it. The test prints how many steps (and seconds) ran between the NaN
and the stop.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from mfotel.actions.control import SCHEDULE_FILE, AlertControl
from mfotel.alerting.credentials import alertmanager_http_config, load_auth
from mfotel.localstack.alerting import AlertingStack
from mfotel.localstack.servers import free_port

pytestmark = pytest.mark.slow
JOB, NAN_AT, STEPS, STEP_SECONDS = "actions-alert", 15, 400, 0.1


def step_times(sink: dict[int, float]) -> Any:
    from mindspore.train import Callback

    class Clock(Callback):
        def on_train_step_end(self, run_context: Any) -> None:
            sink[int(run_context.original_args().cur_step_num)] = time.time()
    return Clock()


def test_nan_page_stops_the_run_through_the_control_file(tmp_path: Path, monkeypatch,
                                                         record_property) -> None:
    from mfotel.demo.training import run_demo
    monkeypatch.chdir(tmp_path)
    port = free_port()
    token = tmp_path / "receiver-token"
    token.write_text("e2e-token-0b1d\n")
    stack = AlertingStack([f"127.0.0.1:{port}"], out=None, workdir=tmp_path / "stack",
                          receiver_auth=load_auth(bearer_token_file=str(token)),
                          webhook_http_config=alertmanager_http_config(str(token)))
    stack.receiver.control = AlertControl(str(tmp_path / "ctl" / "{job_name}"),
                                          ["MindFormersLossNotFinite"], out=None)
    ended: dict[int, float] = {}
    with stack:
        assert stack.prometheus is not None
        result = run_demo(steps=STEPS, port=port, nan_at_step=NAN_AT, job_name=JOB,
                          on_nonfinite="warn", min_step_seconds=STEP_SECONDS,
                          linger_seconds=3.0, output={"console": False},
                          extra_callbacks=(step_times(ended),),
                          actions={"control_dir": str(tmp_path / "ctl" / "{job_name}")})
        exported = stack.prometheus.wait_for(
            f'mindformers_train_actions_total{{job_name="{JOB}", action="stop", '
            f'source="alert"}} == 1', timeout=30)
    stop = max(result.losses)
    wasted, seconds = stop - NAN_AT, ended[stop] - ended[NAN_AT]
    record_property("steps_wasted", wasted)
    print(f"\nNaN at step {NAN_AT} -> run stopped after step {stop}: {wasted} steps "
          f"({seconds:.1f} s at >= {STEP_SECONDS} s/step) ran after the NaN")
    assert NAN_AT < stop < STEPS
    assert result.monitor.actions.counts[("stop", "alert")] == 1
    assert result.monitor.instruments.state.status == 3
    assert exported[0]["metric"]["rank"] == "0"
    (page,) = [a for a in stack.receiver.received() if a.firing
               and a.alertname == "MindFormersLossNotFinite"][:1]
    assert page.labels["job_name"] == JOB
    (scheduled,) = json.loads((tmp_path / "ctl" / JOB / SCHEDULE_FILE).read_text())["actions"]
    assert (scheduled["action"], scheduled["source"], scheduled["step"]) == ("stop", "alert", stop)
    assert "MindFormersLossNotFinite" in scheduled["reason"]
    assert stack.receiver.control.written == [tmp_path / "ctl" / JOB / "control.json"]
    assert not stack.receiver.rejected   # every notification carried the token
