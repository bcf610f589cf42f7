"""TLS and basic auth on /metrics (Prometheus web-config format), scraped by real clients."""
from __future__ import annotations

import base64
import ssl
import subprocess
import urllib.error
import urllib.request

import bcrypt
import pytest

from mfotel.config import ConfigError, parse_config
from mfotel.identity import RankIdentity
from mfotel.instruments import Instruments
from mfotel.demo.stack import Prometheus
from mfotel.telemetry import Telemetry
from mfotel.webconfig import load_web_config

PASSWORD = "s3cret-scrape"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("certs")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem")],
                   check=True, capture_output=True)
    return d


@pytest.fixture
def web_config(tmp_path, certs):
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()
    path = tmp_path / "web.yml"
    path.write_text(f"tls_server_config:\n  cert_file: {certs / 'cert.pem'}\n"
                    f"  key_file: {certs / 'key.pem'}\n"
                    f"basic_auth_users:\n  prometheus: '{hashed}'\n")
    return path


def start(port: int, web_config) -> tuple[Telemetry, Instruments]:
    cfg = parse_config({"prometheus": {"host": "127.0.0.1", "port": port,
                                       "web_config_file": str(web_config)}})
    telemetry = Telemetry(cfg, RankIdentity(), "secure")
    inst = Instruments(telemetry.start(), {"job_name": "secure", "rank": "0"}, cfg.metrics)
    inst.state.loss = 1.25
    telemetry.serve(lambda: inst.version)
    return telemetry, inst


def get(url: str, certs, user: str | None = None, password: str | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url)
    if user:
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    context = ssl.create_default_context(cafile=str(certs / "cert.pem"))
    try:
        with urllib.request.urlopen(request, timeout=5, context=context) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""


def test_https_with_basic_auth(port, web_config, certs):
    telemetry, _ = start(port, web_config)
    try:
        url = telemetry.endpoint.url
        assert url == f"https://127.0.0.1:{port}/metrics"
        assert get(url, certs)[0] == 401
        assert get(url, certs, "prometheus", "wrong")[0] == 401
        assert get(url, certs, "intruder", PASSWORD)[0] == 401
        status, body = get(url, certs, "prometheus", PASSWORD)
        assert status == 200 and 'mindformers_train_loss{job_name="secure",rank="0"} 1.25' in body
        with pytest.raises(OSError):  # plain http is refused by the TLS socket
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        assert get(url, certs, "prometheus", PASSWORD)[0] == 200  # and the server lives on
    finally:
        telemetry.shutdown()


@pytest.mark.slow
def test_real_prometheus_scrapes_with_tls_and_credentials(port, web_config, certs, tmp_path):
    telemetry, _ = start(port, web_config)
    config = f"""
global: {{scrape_interval: 1s}}
scrape_configs:
  - job_name: mfotel
    scheme: https
    tls_config: {{ca_file: {certs / 'cert.pem'}}}
    basic_auth: {{username: prometheus, password: {PASSWORD}}}
    static_configs: [{{targets: ['127.0.0.1:{port}']}}]
  - job_name: mfotel-no-credentials
    scheme: https
    tls_config: {{ca_file: {certs / 'cert.pem'}}}
    static_configs: [{{targets: ['127.0.0.1:{port}']}}]
"""
    try:
        with Prometheus(config, workdir=tmp_path / "prom") as prom:
            result = prom.wait_for('mindformers_train_loss{job_name="secure"}', timeout=30)
            assert float(result[0]["value"][1]) == 1.25
            up = {r["metric"]["job"]: r["value"][1] for r in prom.wait_for("up", timeout=30)}
            assert up["mfotel"] == "1"
            refused = prom.wait_for('up{job="mfotel-no-credentials"} == 0', timeout=30)
            assert refused
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
