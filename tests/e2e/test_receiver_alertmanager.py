"""The real Alertmanager (0.25) sends the credentials of the shipped, documented `http_config`
to the real `mfotel alerts-receiver`, and only then does an alert act; and a real MindSpore run
is not steered by forged webhooks.
"""
from __future__ import annotations

import json
import shutil
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import yaml

from mfotel.actions.control import CONTROL_FILE
from mfotel.localstack.alerting import operator_alertmanager_config
from mfotel.localstack.servers import Alertmanager
from tests.support import http
from tests.support.metrics import step_scraper, value
from tests.support.receiver import FORGED, ROOT, make_certs, notification, post, start_receiver
from tests.support.training import at_step
from tests.support.waiting import settle, wait_for

pytestmark = pytest.mark.slow
SHIPPED = ROOT / "alertmanager" / "alertmanager.yml"
TOKEN, PASSWORD = "am-token-5d1c9e", "am-password-77b2"


def documented(key: str) -> dict[str, Any]:
    """The commented `key:` block of the mfotel-pager webhook in alertmanager.yml, as YAML
    (what a user uncomments)."""
    lines = SHIPPED.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith(f"# {key}:")
                 or line.strip().startswith(f"#   {key}:"))
    prefix = lines[start][:lines[start].index(key)]
    block = [lines[start][len(prefix):]]
    for line in lines[start + 1:]:
        if not line.startswith(prefix + " "):
            break
        block.append(line[len(prefix):])
    return yaml.safe_load("\n".join(block))


def uncommented_http_config(secrets: Path, *keys: str) -> dict[str, Any]:
    """The documented http_config (authorization) plus documented alternatives, with the
    secret paths pointing into `secrets`."""
    config: dict[str, Any] = {}
    for key in keys:
        part = documented("http_config")["http_config"] if key == "authorization" \
            else documented(key)
        config.update(part)
    text = json.dumps(config)
    for name in ("mfotel-receiver-token", "mfotel-receiver-password", "mfotel-receiver-ca.crt"):
        text = text.replace(f"/etc/alertmanager/secrets/{name}", str(secrets / name))
    return json.loads(text)


@pytest.fixture
def secrets(tmp_path: Path) -> Path:
    directory = tmp_path / "secrets"
    directory.mkdir()
    (directory / "mfotel-receiver-token").write_text(TOKEN + "\n")
    (directory / "mfotel-receiver-password").write_text(PASSWORD)
    cert, key = make_certs(directory, "receiver")
    shutil.copy(cert, directory / "mfotel-receiver-ca.crt")
    return directory


def alertmanager_for(receiver_url: str, http_config: dict[str, Any], workdir: Path
                     ) -> Alertmanager:
    """The shipped alertmanager.yml, pointed at the receiver."""
    workdir.mkdir(parents=True, exist_ok=True)
    shutil.copytree(SHIPPED.parent / "templates", workdir / "templates")
    return Alertmanager(operator_alertmanager_config(SHIPPED.read_text(), receiver_url,
                                                     http_config), workdir=workdir)


def fire(alertmanager: Alertmanager, job: str) -> None:
    """Post a firing MindFormersLossNotFinite to Alertmanager's API, as Prometheus would."""
    alert = [{"labels": {"alertname": "MindFormersLossNotFinite", "severity": "critical",
                         "job_name": job, "rank": "0"},
              "annotations": {"summary": "Training loss is NaN or Inf."},
              "startsAt": datetime.now(timezone.utc).isoformat()}]
    assert http.post(f"{alertmanager.url}/api/v2/alerts", alert).status == 200


def notified() -> float:
    """The NaN page's route has no group_wait: Alertmanager notifies as soon as it dispatches."""
    return settle(0.0)


CASES = {
    "bearer token": (("--bearer-token-file", "mfotel-receiver-token"), ("authorization",)),
    "basic auth": (("--basic-auth-username", "alertmanager", "--basic-auth-password-file",
                    "mfotel-receiver-password"), ("basic_auth",)),
    "bearer token over TLS": (("--bearer-token-file", "mfotel-receiver-token",
                               "--tls-cert-file", "receiver.crt", "--tls-key-file", "receiver.key"),
                              ("authorization", "tls_config")),
}


@pytest.mark.parametrize("case", CASES)
def test_alertmanager_sends_the_documented_credentials_and_the_alert_acts(
        tmp_path: Path, secrets: Path, case: str) -> None:
    options, documented_keys = CASES[case]
    args = [str(secrets / a) if (secrets / a).exists() else a for a in options]
    control = tmp_path / "ctl"
    (control / "victim").mkdir(parents=True)
    receiver = start_receiver("--control-dir", str(control / "{job_name}"), *args)
    am = alertmanager_for(receiver.url, uncommented_http_config(secrets, *documented_keys),
                          tmp_path / "am")
    try:
        with am:
            fire(am, "victim")
            request_file = control / "victim" / CONTROL_FILE
            wait_for(request_file.exists, notified(),
                     message="the alert to reach the receiver and act")
            request = json.loads(request_file.read_text())
            assert (request["action"], request["source"]) == ("stop", "alert")
            # forged posts straight to the receiver change nothing
            context = None
            if receiver.url.startswith("https"):
                import ssl
                context = ssl.create_default_context(cafile=str(secrets / "receiver.crt"))
            for headers in ({}, {"Authorization": "Bearer not-the-token"}):
                assert post(receiver.url, FORGED, headers, context=context)[0] == 401
            assert json.loads(request_file.read_text())["id"] == request["id"]
    finally:
        out, _ = receiver.stop()
    assert "control: MindFormersLossNotFinite -> stop requested for job victim" in out


def test_without_the_http_config_alertmanager_is_refused_and_nothing_acts(
        tmp_path: Path, secrets: Path) -> None:
    control = tmp_path / "ctl"
    (control / "victim").mkdir(parents=True)
    receiver = start_receiver("--control-dir", str(control), "--bearer-token-file",
                              str(secrets / "mfotel-receiver-token"))
    try:
        with alertmanager_for(receiver.url, {}, tmp_path / "am") as am:
            fire(am, "victim")
            wait_for(lambda: "refused a request with 401 from 127.0.0.1"
                     in receiver.stderr_so_far(), notified(),
                     message="Alertmanager's unauthenticated notification")
    finally:
        out, _ = receiver.stop()
    assert out == "" and list((control / "victim").iterdir()) == []


def test_forged_webhooks_do_not_steer_a_healthy_run(port, in_tmp, secrets: Path) -> None:
    """A real run behind a receiver that scales the lr by 0.5 per alert: forged fire/resolve
    pairs (which once scaled it by 2^-10) get 401 and change nothing; ten authenticated pairs
    are bounded to 3 requests (the engine applies the latest one it reads at its step)."""
    from mfotel.demo.training import run_demo
    job = "healthy"
    control = in_tmp / "ctl"
    (control / job).mkdir(parents=True)  # rank 0 creates it too; the receiver needs it now
    receiver = start_receiver("--control-dir", str(control / "{job_name}"),
                              "--control-action", "scale_lr", "--control-factor", "0.5",
                              "--bearer-token-file", str(secrets / "mfotel-receiver-token"))
    codes: dict[str, list[int]] = {"forged": [], "genuine": []}

    def pairs(kind: str, token: str | None) -> None:
        for pair in range(10):
            starts = f"2025-01-01T00:{pair:02d}:00Z"
            for status in ("firing", "resolved"):
                codes[kind].append(post(receiver.url, notification(job, status, starts_at=starts),
                                        token=token)[0])
        if kind == "forged":
            codes[kind].append(post(receiver.url, {"alerts": [
                {**FORGED["alerts"][0], "labels": {**FORGED["alerts"][0]["labels"],
                                                   "job_name": job}}]})[0])

    scraper = step_scraper(f"http://127.0.0.1:{port}/metrics", steps={19, 40})
    try:
        result = run_demo(steps=40, port=port, job_name=job, lr_schedule="constant",
                          output={"console": False},
                          actions={"control_dir": str(control / "{job_name}")},
                          extra_callbacks=(scraper, at_step(5, lambda: pairs("forged", "wrong")),
                                           at_step(20, lambda: pairs("genuine", TOKEN))))
    finally:
        out, _ = receiver.stop()
    assert codes["forged"] == [401] * 21 and codes["genuine"] == [200] * 20
    assert len(result.losses) == 40, "the run must not be stopped"
    lr = "mindformers_train_learning_rate"
    assert value(scraper.bodies[19], lr, job_name=job) == pytest.approx(0.01)
    assert value(scraper.bodies[40], lr, job_name=job) == pytest.approx(0.005)   # once x0.5
    assert value(scraper.bodies[40], "mindformers_train_actions_total", action="scale_lr",
                 source="alert") == 1
    assert out.count("scale_lr requested for job healthy") == 3
    assert out.count("(--control-max-actions 3)") == 7
