"""The web-config module parses and checks; it serves nothing and depends on no server.

Honoured and refused keys against real files and clients: test_endpoint_security.py and
test_endpoint_mtls.py.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from mfotel.config import ConfigError, parse_config
from mfotel.endpoint import webconfig
from mfotel.endpoint.webconfig import (
    WebConfig,
    endpoint_web_config,
    load_web_config,
    parse_duration,
)
from tests.support.endpoint import web_config

#: What webconfig.py may import from mfotel (relative to mfotel/endpoint/): the config leaf's
#: errors, reader and settings (the prometheus section that names the files).
ALLOWED = {"..config.errors", "..config.source", "..config.settings", "..regular_file"}


def test_webconfig_imports_nothing_of_mfotel_but_the_config_leaf():
    tree = ast.parse(Path(webconfig.__file__).read_text())
    imported = {"." * node.level + (node.module or "") for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.level}
    absolute = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names} | {node.module or "" for node in ast.walk(tree)
                                            if isinstance(node, ast.ImportFrom) and not node.level}
    assert imported <= ALLOWED, imported - ALLOWED
    assert not any(name.startswith("mfotel") for name in absolute)


@pytest.mark.parametrize("text,seconds", [
    ("100ms", 0.1), ("1s", 1.0), ("1m30s", 90.0), ("2h", 7200.0), ("1.5s", 1.5),
    ("250us", 250e-6), ("250µs", 250e-6), ("10ns", 1e-8), (0, 0.0),
    ("", None), ("fast", None), ("1x", None), ("-1s", None), ("1", None), (1, None),
    (None, None), ("1s ", None),
])
def test_go_durations_are_parsed_as_exporter_toolkit_writes_them(text, seconds):
    parsed = parse_duration(text)
    assert parsed == (pytest.approx(seconds) if seconds is not None else None)


def test_a_file_of_every_section_loads_into_plain_values(tmp_path):
    path = tmp_path / "web.yml"
    path.write_text("basic_auth_users:\n  prometheus: $2y$04$" + "a" * 53 + "\n"
                    "http_server_config:\n  http2: false\n  headers: {X-Frame-Options: deny}\n"
                    "rate_limit: {interval: 250ms, burst: 3}\n")
    assert load_web_config(path) == WebConfig(
        tls=None, users={"prometheus": b"$2y$04$" + b"a" * 53},
        headers={"X-Frame-Options": "deny"}, rate_limit=(0.25, 3))


def test_the_endpoint_web_config_is_the_file_else_the_certificate_else_none(tmp_path, certs):
    """One function for a rank's endpoint and the node endpoint beside it (mfotel-instrument)."""
    def prom(**keys: str):
        return parse_config({"prometheus": keys}, source="train.yaml").prometheus

    assert endpoint_web_config(prom(), "train.yaml") is None
    cert, key = str(certs / "cert.pem"), str(certs / "key.pem")
    plain = endpoint_web_config(prom(certfile=cert, keyfile=key), "train.yaml")
    assert plain is not None and plain.tls is not None and plain.tls.cert_file == cert
    assert not plain.users
    path = web_config(tmp_path / "web.yml", certs / "cert.pem", certs / "key.pem",
                      users={"prometheus": "pw"})
    # the web-config file wins over certfile / keyfile
    loaded = endpoint_web_config(prom(web_config_file=str(path), certfile=cert, keyfile=key),
                                 "train.yaml")
    assert loaded is not None and set(loaded.users) == {"prometheus"}
    with pytest.raises(ConfigError) as bad:
        endpoint_web_config(prom(certfile=str(tmp_path / "missing.pem"), keyfile=key),
                            "train.yaml")
    assert "train.yaml" in str(bad.value) and "prometheus.certfile" in str(bad.value)
