"""Every answer of every endpoint carries the security headers, over real HTTP: /metrics, the
live page, refusals made by the auth middleware (401, 429), by the router (404) and by the
server itself (431), and the alerts receiver's answers."""
from __future__ import annotations

import bcrypt
import pytest

from mfotel.alerting.receiver import AlertsReceiver
from mfotel.endpoint.auth import Credentials
from mfotel.endpoint.wsgi import SECURITY_HEADERS
from tests.support.endpoint import basic, request, serve
from tests.support.receiver import get, notification, post

PASSWORD = "headers-pw"
ENDPOINT = dict(SECURITY_HEADERS)


def secure(headers: dict[str, str], csp: str = ENDPOINT["Content-Security-Policy"]) -> bool:
    return (headers.get("X-Content-Type-Options") == "nosniff"
            and headers.get("X-Frame-Options") == "DENY"
            and headers.get("Referrer-Policy") == "no-referrer"
            and headers.get("Content-Security-Policy") == csp)


@pytest.fixture
def auth_endpoint(port, tmp_path):
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()
    path = tmp_path / "web.yml"
    path.write_text(f"basic_auth_users:\n  prometheus: '{hashed}'\n")
    telemetry, _ = serve(port, web_config_file=str(path))
    yield port
    telemetry.shutdown()


def test_metrics_and_every_refusal_carry_the_security_headers(auth_endpoint):
    port = auth_endpoint
    replies = {
        "metrics": request(port, **basic("prometheus", PASSWORD)),
        "401": request(port),
        "404": request(port, path="/nowhere", **basic("prometheus", PASSWORD)),
        "431": request(port, **{"X-Padding": "a" * 20000}),
    }
    for guess in range(6):  # wrong passwords until the failure limit answers 429
        replies["429"] = request(port, source="127.0.0.5", **basic("prometheus", f"x{guess}"))
    assert {name: reply.status for name, reply in replies.items()} == {
        "metrics": 200, "401": 401, "404": 404, "431": 431, "429": 429}
    assert b"mindformers_train_loss" in replies["metrics"].body
    for name, reply in replies.items():
        assert secure(reply.headers), (name, reply.headers)
        assert list(reply.headers).count("X-Frame-Options") == 1


def test_the_live_page_keeps_its_own_content_security_policy(port):
    from mfotel.ui.app import CSP
    from tests.unit.test_live_page import serve_page
    telemetry, _, _ = serve_page(port)
    try:
        page, script, metrics = (request(port, path=path) for path in ("/", "/ui/app.js",
                                                                      "/metrics"))
    finally:
        telemetry.shutdown()
    assert (page.status, script.status, metrics.status) == (200, 200, 200)
    assert secure(page.headers, CSP) and secure(script.headers, CSP)  # the page's policy, once
    assert list(page.headers).count("Content-Security-Policy") == 1
    assert secure(metrics.headers)


def test_web_config_headers_replace_the_defaults_they_name(port, tmp_path):
    path = tmp_path / "web.yml"
    path.write_text("http_server_config:\n  headers:\n    X-Frame-Options: sameorigin\n")
    telemetry, _ = serve(port, web_config_file=str(path))
    try:
        reply = request(port)
    finally:
        telemetry.shutdown()
    assert reply.status == 200 and reply.headers["X-Frame-Options"] == "sameorigin"
    assert reply.headers["X-Content-Type-Options"] == "nosniff"


def test_the_alerts_receiver_answers_carry_the_security_headers():
    token = "hdr-token"
    with AlertsReceiver(port=0, out=None, err=None,
                        auth=Credentials(bearer_token=token.encode())) as receiver:
        port = receiver.port
        replies = {"200": request(port, path="/-/healthy"),
                   "401": request(port, path="/alerts", method="POST"),
                   "404": request(port, path="/nowhere", Authorization=f"Bearer {token}")}
        assert post(receiver.url, notification(), token=token)[0] == 200
        assert get(receiver.url, token=token)[0] == 200
    assert {name: reply.status for name, reply in replies.items()} == {
        "200": 200, "401": 401, "404": 404}
    for name, reply in replies.items():
        assert secure(reply.headers), (name, reply.headers)
