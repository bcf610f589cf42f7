"""The auth middleware as a table: fixed credentials, the 401 it answers, mutual-TLS peers.

Over real HTTP with real clients: test_endpoint_security.py (basic auth with bcrypt),
test_endpoint_mtls.py (client certificates), test_receiver_security.py (the receiver).
"""
from __future__ import annotations

import base64

import pytest

from mfotel.endpoint.auth import AllowedSans, Credentials, RequireCredentials
from mfotel.endpoint.wsgi import AUTHENTICATED


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


BOTH = Credentials(bearer_token=b"tok", username="am", password=b"pw")


@pytest.mark.parametrize("header,allowed", [
    ("Bearer tok", True), ("bearer tok", True), ("Bearer  tok ", True),
    (basic("am", "pw"), True),
    (None, False), ("", False), ("Bearer", False), ("Bearer tokx", False), ("tok", False),
    ("Bearer " + "t" * 10_000, False), (basic("am", "tok"), False), (basic("x", "pw"), False),
    (basic("am", "pw")[:-2], False), ("Basic !!!", False), ("Bearer \udcff", False),
])
def test_credentials_allow_exactly_the_configured_secrets(header, allowed):
    assert BOTH.allows(header) is allowed


def test_credentials_need_a_secret_and_never_show_it():
    with pytest.raises(ValueError, match="no credentials"):
        Credentials()
    with pytest.raises(ValueError, match="both a username and a password"):
        Credentials(password=b"pw")
    assert repr(BOTH) == "Credentials(bearer+basic)" and "tok" not in repr(BOTH)


def test_require_credentials_answers_401_with_a_challenge_and_reports_it():
    seen, refused = [], []

    def app(environ, start_response):
        seen.append(environ.get(AUTHENTICATED))
        start_response("200 OK", [])
        return [b"in"]

    guarded = RequireCredentials(app, BOTH, "test", public=("/-/healthy",),
                                 on_refused=refused.append)

    def call(path: str, header: str | None = None) -> tuple[str, dict[str, str], bytes]:
        answer: dict[str, object] = {}
        environ = {"PATH_INFO": path, "REMOTE_ADDR": "192.0.2.1"}
        if header:
            environ["HTTP_AUTHORIZATION"] = header
        body = b"".join(guarded(environ, lambda s, h: answer.update(s=s, h=dict(h))))
        return str(answer["s"]), dict(answer["h"]), body  # type: ignore[call-overload]

    status, headers, body = call("/alerts")
    assert status.startswith("401") and body == b"missing or wrong credentials\n"
    assert headers["WWW-Authenticate"] == 'Bearer realm="test", Basic realm="test"'
    assert call("/alerts", "Bearer tok")[2] == b"in" and call("/-/healthy/")[2] == b"in"
    assert seen == [True, None]  # authenticated, public
    assert [e["PATH_INFO"] for e in refused] == ["/alerts"]


@pytest.mark.parametrize("sans,cert,allowed", [
    (["scraper.example"], {"subjectAltName": (("DNS", "scraper.example"),)}, True),
    (["scraper.example"], {"subjectAltName": (("DNS", "other.example"),)}, False),
    (["2001:db8::1"], {"subjectAltName": (("IP Address", "2001:DB8:0:0:0:0:0:1\n"),)}, True),
    (["10.0.0.1"], {"subjectAltName": (("IP Address", "10.0.0.1"),)}, True),
    (["ops@example.org"], {"subjectAltName": (("email", "ops@example.org"),)}, True),
    (["scraper.example"], {"subject": ((("commonName", "scraper.example"),),)}, False),
    (["scraper.example"], None, False),
])
def test_allowed_sans_match_a_verified_certificate_by_value(sans, cert, allowed):
    assert AllowedSans(sans)(cert) is allowed
