"""Fast path: the callback posts a NaN loss straight to a real Alertmanager.

With no Prometheus at all the page still arrives; with Prometheus and the shipped rule also
firing, Alertmanager holds one alert, not two (same labels: deduplicated), and the shipped
route (group_wait 0s) sends one page for it, not a second one when the rule's copy arrives.
"""
from __future__ import annotations

import base64
import json
import logging
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import quote

import bcrypt
import pytest
import yaml

from mfotel.alerting.fastpage import loss_alert, page_async
from mfotel.demo.alerting import scrape_gate
from mfotel.demo.training import run_demo
from mfotel.localstack.alerting import AlertingStack, shipped_files
from mfotel.localstack.servers import Alertmanager, free_port, http_get_json
from tests.support.waiting import settle, wait_for

pytestmark = pytest.mark.slow
ALERT = "MindFormersLossNotFinite"
INTERVAL = 1.0  # the scrape and evaluation interval of AlertingStack


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


def test_fast_path_pages_without_prometheus_and_dedups_with_the_rule(tmp_path, in_tmp):
    port = free_port()
    with AlertingStack([f"127.0.0.1:{port}"], out=None, workdir=tmp_path / "stack") as stack:
        stack.prometheus.stop()  # first: no Prometheus, so only the fast path can page
        run_demo(steps=12, port=port, nan_at_step=5, job_name="fast", linger_seconds=0,
                 alertmanager_url=stack.alertmanager.url, output={"console": False})
        page = stack.receiver.wait_for(
            lambda a: a.firing and a.alertname == ALERT and a.labels.get("job_name") == "fast",
            timeout=settle())  # posted at the step, sent at once (group_wait 0s)
        assert page.labels["rank"] == "0" and "step 5" in page.annotations["description"]

        stack.prometheus.start()  # now the rule fires too, for a second job
        # the NaN (step 5) comes only once Prometheus scrapes the run, however loaded the
        # machine: the rule then sees it during the run or in the linger after it
        both = run_demo(steps=40, port=port, nan_at_step=5, job_name="both", linger_seconds=3,
                        min_step_seconds=0.05, alertmanager_url=stack.alertmanager.url,
                        output={"console": False},
                        extra_callbacks=(scrape_gate(stack.prometheus, "both", 4),))
        stack.prometheus.wait_for(
            f'ALERTS{{alertname="{ALERT}", job_name="both", alertstate="firing"}}',
            timeout=settle(INTERVAL, INTERVAL))
        # Prometheus' copy reached Alertmanager when the alert carries its generator URL
        wait_for(lambda: any(a.get("generatorURL") for a in loss_alerts(stack, "both")),
                 settle(INTERVAL), 0.2, "the rule's copy of the alert in Alertmanager")
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
    errors = result.monitor.instruments.state.export_errors
    wait_for(lambda: errors["alertmanager"], settle(), 0.05, "the failed post counted")
    assert errors["alertmanager"] == 1


# ---------------------------------------------------------------- Alertmanager behind basic auth
PAGER_PASSWORD = "p@ss:word/1"  # reserved characters: percent-encoded in the URL


class AuthAlertmanager(Alertmanager):
    """A real Alertmanager 0.25 behind exporter-toolkit basic auth (`--web.config.file`)."""

    def __init__(self, workdir: Path) -> None:
        super().__init__("route: {receiver: 'null'}\nreceivers: [{name: 'null'}]\n", workdir)
        hashed = bcrypt.hashpw(PAGER_PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()
        self.web_config = self.workdir / "web.yml"
        self.web_config.write_text(f"basic_auth_users:\n  pager: '{hashed}'\n")
        token = base64.b64encode(f"pager:{PAGER_PASSWORD}".encode()).decode()
        self.authorization = f"Basic {token}"

    def command(self) -> list[str]:
        return [*super().command(), f"--web.config.file={self.web_config}"]

    def get(self, path: str, authorization: str | None) -> tuple[int, bytes]:
        request = urllib.request.Request(self.url + path)
        if authorization:
            request.add_header("Authorization", authorization)
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, b""

    def start(self, timeout: float = 30.0) -> AuthAlertmanager:  # /-/ready needs the auth too
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                            cwd=self.workdir)
        deadline = time.monotonic() + timeout
        while not self._ready():
            assert self.process.poll() is None, self.log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "alertmanager not ready"
            time.sleep(0.1)
        return self

    def _ready(self) -> bool:
        try:
            return self.get("/-/ready", self.authorization)[0] == 200
        except OSError:
            return False


def test_fast_path_posts_to_an_alertmanager_behind_basic_auth(tmp_path, in_tmp, caplog):
    """`http://user:password@host` as Alertmanager users write it: the first version tried to
    resolve "pager:...@127.0.0.1" as a host name and never posted."""
    with AuthAlertmanager(tmp_path / "am") as am:
        assert am.get("/api/v2/alerts", None)[0] == 401    # the auth is real
        url = f"http://pager:{quote(PAGER_PASSWORD, safe='')}@127.0.0.1:{am.port}"
        with caplog.at_level(logging.WARNING, logger="mfotel"):
            result = run_demo(steps=8, port=free_port(), nan_at_step=3, job_name="authpage",
                              linger_seconds=0, alertmanager_url=url, output={"console": False})
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not any(
                    a["labels"].get("job_name") == "authpage"
                    for a in json.loads(am.get("/api/v2/alerts", am.authorization)[1])):
                time.sleep(0.1)
        alerts = json.loads(am.get("/api/v2/alerts", am.authorization)[1])
        assert [a["labels"] for a in alerts] == [{"alertname": ALERT, "severity": "critical",
                                                  "job_name": "authpage", "rank": "0"}]
        assert result.monitor.instruments.state.export_errors["alertmanager"] == 0
        assert not [r for r in caplog.records if "Alertmanager" in r.getMessage()]

        # a wrong password: refused by Alertmanager, counted, and never printed
        failed = threading.Event()
        with caplog.at_level(logging.WARNING, logger="mfotel"):
            page_async(f"http://pager:wrong-secret-9@127.0.0.1:{am.port}",
                       loss_alert("authpage", 1, 3, float("nan")), failed.set).join(30)
        assert failed.is_set()
        (warning,) = [r.getMessage() for r in caplog.records if "Alertmanager" in r.getMessage()]
        assert "wrong-secret-9" not in warning
        assert f"http://pager:***@127.0.0.1:{am.port}" in warning
        assert "401" in warning
