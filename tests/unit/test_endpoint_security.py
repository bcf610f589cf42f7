"""TLS and basic auth on /metrics (Prometheus web-config format), against real clients and
attackers. A real Prometheus scrapes it in tests/e2e/test_endpoint_scraped_by_prometheus.py."""
from __future__ import annotations

import ssl
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any

import bcrypt
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mfotel.config import ConfigError
from mfotel.endpoint.webconfig import CIPHER_SUITES, load_web_config
from tests.support.endpoint import basic, request, serve
from tests.support.http import get

PASSWORD = "s3cret-scrape"


@pytest.fixture
def web_config(tmp_path, certs):
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()
    path = tmp_path / "web.yml"
    path.write_text(f"tls_server_config:\n  cert_file: {certs / 'cert.pem'}\n"
                    f"  key_file: {certs / 'key.pem'}\n"
                    f"basic_auth_users:\n  prometheus: '{hashed}'\n")
    return path


def test_https_with_basic_auth(port, web_config, certs):
    telemetry, _ = serve(port, web_config_file=str(web_config))
    context = ssl.create_default_context(cafile=str(certs / "cert.pem"))
    try:
        assert telemetry.endpoint.url == f"https://127.0.0.1:{port}/metrics"
        assert request(port, context=context).status == 401
        assert request(port, context=context, **basic("prometheus", "wrong")).status == 401
        assert request(port, context=context, **basic("intruder", PASSWORD)).status == 401
        reply = request(port, context=context, **basic("prometheus", PASSWORD))
        assert reply.status == 200
        assert b'mindformers_train_loss{job_name="secure",rank="0"} 1.25' in reply.body
        with pytest.raises(OSError):  # plain http is refused by the TLS socket
            get(f"http://127.0.0.1:{port}/metrics", timeout=5)
        assert request(port, context=context, **basic("prometheus", PASSWORD)).status == 200
    finally:
        telemetry.shutdown()


def test_bad_web_config_names_file_and_fix(tmp_path):
    path = tmp_path / "web.yml"
    path.write_text("basic_auth_users:\n  prometheus: plaintext\n")
    with pytest.raises(ConfigError, match=r"basic_auth_users.prometheus: not a bcrypt hash.*Fix"):
        load_web_config(path)
    path.write_text("tls_server_config:\n  cert_file: c.pem\n")
    with pytest.raises(ConfigError, match="cert_file and key_file go together"):
        load_web_config(path)


# ---------------------------------------------------------------- basic auth against attackers
@pytest.fixture
def auth_endpoint(port, tmp_path):
    """A plain-HTTP endpoint behind basic auth (user prometheus), built by
    `start(cost, **limits)`."""
    started = []

    def start(cost: int = 4, **prometheus):
        hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=cost)).decode()
        path = tmp_path / "auth.yml"
        path.write_text(f"basic_auth_users:\n  prometheus: '{hashed}'\n")
        telemetry, _ = serve(port, web_config_file=str(path), **prometheus)
        started.append(telemetry)
        return telemetry
    yield start
    for telemetry in started:
        telemetry.shutdown()


def cpu_timed(call: Callable[[], Any]) -> tuple[float, Any]:
    """(CPU seconds this process spent, result) of `call`."""
    started = time.process_time()
    result = call()
    return time.process_time() - started, result


def test_unknown_user_costs_as_much_as_a_wrong_password(auth_endpoint, port):
    auth_endpoint(cost=12, auth_failures_per_second=1000)  # ~0.3 s per bcrypt check
    wrong, unknown = [], []
    for i in range(4):  # interleaved
        wrong.append(cpu_timed(lambda i=i: request(port, **basic("prometheus", f"wrong-{i}"))))
        unknown.append(cpu_timed(lambda i=i: request(port, **basic(f"nobody-{i}", PASSWORD))))
    assert {r.status for _, r in wrong + unknown} == {401}
    # an unknown user is checked against a dummy hash of the same cost: no enumeration by
    # timing (before: ~1 ms against ~300 ms). Measured in this process's CPU time (the
    # endpoint's workers run here), which the machine's load does not stretch as it does
    # wall time: one bcrypt check of cost 12 is ~0.3 s of CPU either way.
    known_cost = statistics.median(t for t, _ in wrong)
    assert known_cost > 0.05
    assert statistics.median(t for t, _ in unknown) > 0.5 * known_cost, (wrong, unknown)


def test_failed_logins_get_429_per_address_then_for_everyone(auth_endpoint, port):
    # 0.02 failures/s per address (burst 5), 0.04/s for all (burst 10): slow enough that no
    # token comes back while the test runs, however loaded the machine
    auth_endpoint(auth_failures_per_second=0.02)
    statuses = [request(port, source="127.0.0.2", **basic("prometheus", f"x{i}")).status
                for i in range(6)]
    assert statuses == [401] * 5 + [429]
    limited = request(port, source="127.0.0.2", **basic("prometheus", "x-next"))
    assert limited.status == 429 and 1 <= int(limited.headers["Retry-After"]) <= 1 / 0.02
    # another address has its own bucket, until all clients together spent theirs (10)
    others = [request(port, source=f"127.0.0.{3 + i}", **basic("prometheus", f"y{i}")).status
              for i in range(6)]
    assert others == [401] * 5 + [429]


def test_verified_scraper_is_served_while_an_attacker_is_rate_limited(auth_endpoint, port):
    auth_endpoint(auth_failures_per_second=0.02)  # no token back while the test runs
    assert request(port, **basic("prometheus", PASSWORD)).status == 200
    attack = [request(port, source="127.0.0.2", **basic("prometheus", f"guess-{i}")).status
              for i in range(25)]
    # 5 bcrypt checks (the address's burst), then 429 without bcrypt, then, the client having
    # failed 20 times, its connections are closed as soon as accepted
    assert attack[:5] == [401] * 5 and attack[5:20] == [429] * 15 and attack[-1] == 0, attack
    # verified credentials are cached (apart from failures): no bcrypt, no token needed
    assert all(request(port, **basic("prometheus", PASSWORD)).status == 200 for _ in range(5))
    assert request(port, **basic("prometheus", "guess-0")).status == 401  # a cached failure


def test_malformed_and_overlong_credentials_are_401_not_500(auth_endpoint, port):
    auth_endpoint()
    assert request(port, **basic("prometheus", "p" * 100)).status == 401  # bcrypt's 72-byte cap
    assert request(port, Authorization="Basic !!!not-base64").status == 401
    assert request(port, Authorization="Bearer abc").status == 401
    assert request(port, **basic("prometheus", PASSWORD)).status == 200


# ---------------------------------------------------------------- web-config: honoured or refused
def write_web(tmp_path, text: str):
    path = tmp_path / "web.yml"
    path.write_text(text)
    return path


TLS = "tls_server_config: {cert_file: c.pem, key_file: k.pem, "
BAD_WEB_CONFIGS = [
    (TLS + "client_auth_type: RequireAnyClientCert}",
     "client_auth_type: RequireAnyClientCert accepts certificates nobody verified",
     "RequireAndVerifyClientCert with client_ca_file"),
    (TLS + "client_auth_type: RequestClientCert}",
     "client_auth_type: RequestClientCert accepts", "NoClientCert"),
    (TLS + "client_ca_file: ca.pem}",
     "client_auth_type: client_ca_file is set but client certificates are not asked for",
     "RequireAndVerifyClientCert"),
    (TLS + "client_auth_type: RequireAndVerifyClientCert}",
     "client_ca_file: client_auth_type RequireAndVerifyClientCert needs the CA",
     "set client_ca_file"),
    (TLS + "client_auth_type: VerifyClient}",
     "client_auth_type: unknown value", "VerifyClientCertIfGiven"),
    ("tls_server_config: {min_version: TLS13}", "cert_file: min_version given but TLS is off",
     "set both cert_file and key_file"),
    (TLS + "min_version: TLS14}",
     "min_version: unknown TLS version 'TLS14'", "TLS12, TLS13"),
    (TLS + "min_version: TLS13, max_version: TLS12}",
     "min_version: TLS13 is above max_version TLS12", "lower min_version"),
    (TLS + "cipher_suites: [TLS_RSA_WITH_RC4_128_SHA]}",
     "cipher_suites: unknown name 'TLS_RSA_WITH_RC4_128_SHA'",
     "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256"),
    (TLS + "curve_preferences: [X25519, CurveP256]}",
     "curve_preferences: 2 curves listed", "list one curve (e.g. [X25519])"),
    (TLS + "curve_preferences: [P256]}",
     "curve_preferences: unknown name 'P256'", "did you mean 'CurveP256'"),
    (TLS + "client_auth_type: VerifyClientCertIfGiven,"
     " client_ca_file: ca.pem, client_allowed_sans: [scraper.example]}",
     "client_allowed_sans: needs client certificates", "RequireAndVerifyClientCert"),
    (TLS + "client_ca_files: ca.pem}",
     "tls_server_config.client_ca_files: unknown key", "did you mean 'client_ca_file'"),
    ("tls_server_config: {cert: '-----BEGIN CERTIFICATE-----', key_file: k.pem}",
     "tls_server_config.cert: inline certificates and keys are not supported", "set cert_file"),
    ("basic_auth_user: {prometheus: x}", "basic_auth_user: unknown key",
     "did you mean 'basic_auth_users'"),
    ("http_server_config: {headers: {X-Frame-Options: allow}}",
     "headers.X-Frame-Options: 'allow' is not allowed", "deny, sameorigin"),
    ("http_server_config: {headers: {Server: mfotel}}",
     "headers.Server: this header cannot be configured", "Content-Security-Policy"),
    ("rate_limit: {interval: fast, burst: 3}", "rate_limit.interval: 'fast' is not a duration",
     "100ms"),
    ("rate_limit: {interval: 1s}", "rate_limit.burst: 0 is not a whole number >= 1", "set burst"),
]


@pytest.mark.parametrize("text,problem,fix", BAD_WEB_CONFIGS,
                         ids=[c[1][:40] for c in BAD_WEB_CONFIGS])
def test_web_config_key_not_honoured_is_an_error_naming_file_key_and_fix(tmp_path, text, problem,
                                                                          fix):
    path = write_web(tmp_path, text + "\n")
    with pytest.raises(ConfigError) as error:
        load_web_config(path)
    message = str(error.value)
    assert message.startswith(f"{path}: monitor_config.prometheus.web_config_file: ")
    assert problem in message and fix in message.split("Fix:")[1], message


def test_unreadable_tls_files_name_the_key(tmp_path, certs):
    path = write_web(tmp_path, f"tls_server_config:\n  cert_file: {certs / 'cert.pem'}\n"
                               "  key_file: missing.key\n")
    with pytest.raises(ConfigError,
                       match=r"tls_server_config.cert_file: cannot load it .*Fix: point"):
        load_web_config(path)
    path = write_web(tmp_path, f"tls_server_config:\n  cert_file: {certs / 'cert.pem'}\n"
                               f"  key_file: {certs / 'key.pem'}\n"
                               "  client_auth_type: RequireAndVerifyClientCert\n"
                               f"  client_ca_file: {certs / 'key.pem'}\n")  # a key, not a CA
    with pytest.raises(ConfigError, match=r"tls_server_config.client_ca_file: cannot load it"):
        load_web_config(path)


def test_go_cipher_names_map_to_the_same_suites_in_openssl():
    listing = subprocess.run(["openssl", "ciphers", "-stdname", "ALL"], capture_output=True,
                             text=True, check=True).stdout
    openssl_names = {}
    for line in listing.splitlines():  # "<standard name> - <OpenSSL name> <protocol> ..."
        if " - " in line:
            standard, rest = line.split(" - ", 1)
            openssl_names[standard.strip()] = rest.split()[0]
    for go_name, openssl_name in CIPHER_SUITES.items():
        assert openssl_names[go_name] == (openssl_name or go_name), go_name


def test_rate_limit_and_headers_of_the_web_config_apply_to_every_response(port, tmp_path):
    path = write_web(tmp_path, "rate_limit: {interval: 1h, burst: 2}\n"
                               "http_server_config:\n  headers:\n"
                               "    X-Content-Type-Options: nosniff\n"
                               "    X-Frame-Options: deny\n")
    telemetry, _ = serve(port, web_config_file=str(path))
    try:
        replies = [request(port), request(port, path="/nowhere"), request(port)]
        assert [r.status for r in replies] == [200, 404, 429]
        assert all(r.headers["X-Content-Type-Options"] == "nosniff" and
                   r.headers["X-Frame-Options"] == "deny" for r in replies)
        assert int(replies[2].headers["Retry-After"]) > 0
    finally:
        telemetry.shutdown()


_WEB_KEYS = ["tls_server_config", "http_server_config", "basic_auth_users", "rate_limit",
             "cert_file", "key_file", "client_auth_type", "client_ca_file", "client_ca",
             "min_version", "max_version", "cipher_suites", "curve_preferences",
             "prefer_server_cipher_suites", "client_allowed_sans", "headers", "http2",
             "interval", "burst", "X-Frame-Options", "prometheus", "TLS13", "1s"]
_scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 10**6), st.floats(),
                     st.sampled_from(_WEB_KEYS), st.text(max_size=10))
_values = st.recursive(_scalars, lambda children: st.one_of(
    st.lists(children, max_size=3),
    st.dictionaries(st.one_of(st.sampled_from(_WEB_KEYS), st.text(max_size=6)), children,
                    max_size=4)), max_leaves=10)


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_values)
def test_random_web_configs_load_or_raise_an_error_naming_the_file(tmp_path, document):
    path = write_web(tmp_path, yaml.safe_dump(document))
    try:
        load_web_config(path)
    except ConfigError as exc:
        assert str(exc).startswith(f"{path}: ") and "Fix:" in str(exc), str(exc)
