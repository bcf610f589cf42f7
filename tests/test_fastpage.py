"""Fast path: the callback posts a NaN loss straight to a real Alertmanager.

With no Prometheus at all the page still arrives; with Prometheus and the shipped rule also
firing, Alertmanager holds one alert, not two (same labels: deduplicated), and the shipped
route (group_wait 0s) sends one page for it, not a second one when the rule's copy arrives.
"""
from __future__ import annotations

import time

import pytest
import yaml

from mfotel.alerting.fastpage import loss_alert
from mfotel.demo.alerting import AlertingStack, scrape_gate, shipped_files
from mfotel.demo.stack import free_port, http_get_json
from mfotel.demo.training import run_demo

pytestmark = pytest.mark.slow
ALERT = "MindFormersLossNotFinite"


def loss_alerts(stack: AlertingStack, job: str) -> list[dict]:
    return [a for a in http_get_json(f"{stack.alertmanager.url}/api/v2/alerts")
            if a["labels"].get("alertname") == ALERT and a["labels"].get("job_name") == job]


def nan_route_group_interval() -> float:
    """Seconds between two notifications of the shipped NaN route's group (e.g. "1m")."""
    routes = yaml.safe_load(shipped_files()["alertmanager"])["route"]["routes"]
    (route,) = [r for r in routes if f'alertname = "{ALERT}"' in r.get("matchers", [])]
    value = route["group_interval"]
    return float(value[:-1]) * {"s": 1, "m": 60}[value[-1]]


def pages(stack: AlertingStack, job: str) -> list:
    return stack.receiver.received(
        lambda a: a.firing and a.alertname == ALERT and a.labels.get("job_name") == job)


def test_alert_labels_match_the_rule():
    alert = loss_alert("llama", 3, 17, float("nan"))
    assert alert["labels"] == {"alertname": ALERT, "severity": "critical", "job_name": "llama",
                               "rank": "3"}
    assert alert["annotations"]["runbook_url"].endswith("#mindformerslossnotfinite")


def test_fast_path_pages_without_prometheus_and_dedups_with_the_rule(tmp_path, in_tmp):
    port = free_port()
    with AlertingStack([f"127.0.0.1:{port}"], out=None, workdir=tmp_path / "stack") as stack:
        stack.prometheus.stop()  # first: no Prometheus, so only the fast path can page
        run_demo(steps=12, port=port, nan_at_step=5, job_name="fast", linger_seconds=0,
                 alertmanager_url=stack.alertmanager.url, output={"console": False})
        page = stack.receiver.wait_for(
            lambda a: a.firing and a.alertname == ALERT and a.labels.get("job_name") == "fast",
            timeout=30)
        assert page.labels["rank"] == "0" and "step 5" in page.annotations["description"]

        stack.prometheus.start()  # now the rule fires too, for a second job
        # the NaN (step 5) comes only once Prometheus scrapes the run, however loaded the
        # machine: the rule then sees it during the run or in the linger after it
        both = run_demo(steps=40, port=port, nan_at_step=5, job_name="both", linger_seconds=3,
                        min_step_seconds=0.05, alertmanager_url=stack.alertmanager.url,
                        output={"console": False},
                        extra_callbacks=(scrape_gate(stack.prometheus, "both", 4),))
        stack.prometheus.wait_for(
            f'ALERTS{{alertname="{ALERT}", job_name="both", alertstate="firing"}}', timeout=30)
        # Prometheus' copy reached Alertmanager when the alert carries its generator URL
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(
                a.get("generatorURL") for a in loss_alerts(stack, "both")):
            time.sleep(0.2)
        alerts = loss_alerts(stack, "both")
        assert both.monitor.instruments.state.export_errors["alertmanager"] == 0  # it posted
        assert len(alerts) == 1, alerts  # the rule's alert and the posted one are one alert
        assert "mindformers_train_loss_finite" in alerts[0]["generatorURL"], alerts  # the rule
        assert alerts[0]["labels"] == {"alertname": ALERT, "severity": "critical",
                                       "job_name": "both", "rank": "0"}

        # One page each: nothing more when the group is next flushed (group_interval after
        # the first page), although the rule's copy arrived after the first page went out.
        first = pages(stack, "both")[0]
        assert "posted by the training process" in first.annotations["description"]
        wait = first.received_at + nan_route_group_interval() + 5 - time.time()
        with pytest.raises(TimeoutError):
            again = stack.receiver.wait_for(
                lambda a: a.firing and a.alertname == ALERT and a.received_at > first.received_at,
                timeout=max(wait, 0))
            pytest.fail(f"paged twice: {again.line()} ({again.annotations})")
        assert len(pages(stack, "fast")) == 1 and len(pages(stack, "both")) == 1


def test_unreachable_alertmanager_is_counted_not_raised(in_tmp):
    result = run_demo(steps=8, port=free_port(), nan_at_step=3, linger_seconds=0,
                      alertmanager_url=f"http://127.0.0.1:{free_port()}",
                      output={"console": False})
    assert len(result.losses) == 8
    deadline = time.monotonic() + 10
    errors = result.monitor.instruments.state.export_errors
    while time.monotonic() < deadline and errors["alertmanager"] == 0:
        time.sleep(0.05)
    assert errors["alertmanager"] == 1
