"""Mutual TLS and TLS parameters of the web-config, against real clients.

Certificates are made by the openssl CLI for each test module (the `pki` fixture). A real
Prometheus scrapes with client certificates in tests/e2e/test_endpoint_scraped_by_prometheus.py.
"""
from __future__ import annotations

import socket
import ssl

import pytest

from mfotel.config import ConfigError, parse_config
from mfotel.identity import RankIdentity
from mfotel.telemetry import Telemetry
from tests.support.endpoint import REFUSED, request, serve


@pytest.fixture
def endpoint(port, pki, tmp_path):
    """Serve /metrics with `tls_server_config` = the server certificate plus `settings`."""
    started = []

    def start(**settings: str) -> int:
        lines = [f"  cert_file: {pki.cert('server')}", f"  key_file: {pki.key('server')}",
                 *(f"  {key}: {value}" for key, value in settings.items())]
        path = tmp_path / "web.yml"
        path.write_text("tls_server_config:\n" + "\n".join(lines) + "\n")
        telemetry, _ = serve(port, web_config_file=str(path))
        started.append(telemetry)
        return port
    yield start
    for telemetry in started:
        telemetry.shutdown()


def status(port: int, pki, client: str | None = None) -> int:
    """HTTP status of a scrape presenting `client`'s certificate (0: refused by TLS)."""
    return request(port, context=pki.client_context(client), timeout=5).status


def handshake(port: int, context: ssl.SSLContext) -> tuple[str, str] | None:
    """(TLS version, cipher) negotiated with 127.0.0.1:port, or None if the handshake fails."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
                context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            return tls.version(), tls.cipher()[0]
    except (ssl.SSLError, ConnectionError):
        return None


def test_mutual_tls_admits_only_certificates_of_the_client_ca(endpoint, pki):
    port = endpoint(client_auth_type="RequireAndVerifyClientCert", client_ca_file=pki.ca)
    assert status(port, pki) == REFUSED.status            # no certificate
    assert status(port, pki, "rogue") == REFUSED.status   # signed by another CA
    assert status(port, pki, "scraper") == 200
    assert status(port, pki, "other") == 200


def test_verify_client_cert_if_given_admits_anonymous_clients_but_no_forged_certificate(
        endpoint, pki):
    port = endpoint(client_auth_type="VerifyClientCertIfGiven", client_ca_file=pki.ca)
    assert status(port, pki) == 200
    assert status(port, pki, "rogue") == REFUSED.status
    assert status(port, pki, "scraper") == 200


def test_client_allowed_sans_admit_only_the_listed_names(endpoint, pki):
    port = endpoint(client_auth_type="RequireAndVerifyClientCert", client_ca_file=pki.ca,
                    client_allowed_sans="[scraper.example, 10.0.0.1]")
    assert status(port, pki, "scraper") == 200
    assert status(port, pki, "other") == REFUSED.status   # right CA, name not listed
    assert status(port, pki, "rogue") == REFUSED.status   # listed name, wrong CA


@pytest.mark.parametrize("bound,client_bound,client_version,served", [
    ("min_version", "maximum_version", ssl.TLSVersion.TLSv1_2, "TLSv1.3"),
    ("max_version", "minimum_version", ssl.TLSVersion.TLSv1_3, "TLSv1.2")])
def test_min_and_max_version_bound_the_protocol(endpoint, pki, bound, client_bound,
                                                client_version, served):
    port = endpoint(**{bound: "TLS13" if bound == "min_version" else "TLS12"})
    outside = pki.client_context()  # a client that only speaks the version the server refuses
    setattr(outside, client_bound, client_version)
    assert handshake(port, outside) is None
    assert handshake(port, pki.client_context())[0] == served


@pytest.mark.parametrize("prefer_server,chosen", [("true", "ECDHE-ECDSA-AES256-GCM-SHA384"),
                                                  ("false", "ECDHE-ECDSA-AES128-GCM-SHA256")])
def test_cipher_suites_restrict_tls12_in_the_preferred_order(endpoint, pki, prefer_server, chosen):
    port = endpoint(max_version="TLS12", prefer_server_cipher_suites=prefer_server,
                    cipher_suites="[TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384, "
                                  "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256]")
    only_other = pki.client_context()
    only_other.set_ciphers("ECDHE-ECDSA-CHACHA20-POLY1305")
    assert handshake(port, only_other) is None
    client_order = pki.client_context()  # the client prefers AES128, the server AES256
    client_order.set_ciphers("ECDHE-ECDSA-AES128-GCM-SHA256:ECDHE-ECDSA-AES256-GCM-SHA384")
    assert handshake(port, client_order) == ("TLSv1.2", chosen)


def test_curve_preferences_restrict_the_key_exchange(endpoint, pki):
    port = endpoint(curve_preferences="[CurveP384]")
    x25519 = pki.client_context()
    x25519.set_ecdh_curve("X25519")
    assert handshake(port, x25519) is None
    p384 = pki.client_context()
    p384.set_ecdh_curve("secp384r1")
    assert handshake(port, p384) is not None


def test_unloadable_certfile_is_a_config_error(tmp_path, port):
    cfg = parse_config({"prometheus": {"host": "127.0.0.1", "port": port,
                                       "certfile": str(tmp_path / "none.pem"),
                                       "keyfile": str(tmp_path / "none.key")}})
    with pytest.raises(ConfigError, match=r"monitor_config.prometheus.certfile: cannot load .*Fix"):
        Telemetry(cfg, RankIdentity(), "tls")
