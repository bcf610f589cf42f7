"""A real Prometheus scrapes the secured /metrics endpoint: with TLS and basic auth, and with
mutual TLS restricted to certain client names; scrapers without the credentials are refused.

The endpoint's TLS, auth and limits against raw clients: tests/unit/test_endpoint_*.py.
"""
from __future__ import annotations

from mfotel.localstack.servers import Prometheus
from tests.support.endpoint import serve, web_config

PASSWORD = "s3cret-scrape"


def test_real_prometheus_scrapes_with_tls_and_credentials(port, certs, tmp_path):
    config_file = web_config(tmp_path / "web.yml", certs / "cert.pem", certs / "key.pem",
                             users={"prometheus": PASSWORD})
    telemetry, _ = serve(port, web_config_file=str(config_file))
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


def test_real_prometheus_scrapes_with_client_certificates(port, pki, tmp_path):
    config_file = web_config(tmp_path / "web.yml", pki.cert("server"), pki.key("server"),
                             client_auth_type="RequireAndVerifyClientCert",
                             client_ca_file=pki.ca, client_allowed_sans="[scraper.example]")
    telemetry, _ = serve(port, web_config_file=str(config_file))

    def job(name: str, client: str | None) -> str:
        certs = (f", cert_file: {pki.cert(client)}, key_file: {pki.key(client)}" if client else "")
        return (f"  - job_name: {name}\n    scheme: https\n"
                f"    tls_config: {{ca_file: {pki.ca}{certs}}}\n"
                f"    static_configs: [{{targets: ['127.0.0.1:{port}']}}]\n")
    config = ("global: {scrape_interval: 1s, scrape_timeout: 1s}\nscrape_configs:\n"
              + job("scraper", "scraper") + job("other-name", "other") + job("anonymous", None))
    try:
        with Prometheus(config, workdir=tmp_path / "prom") as prom:
            loss = prom.wait_for('mindformers_train_loss{job="scraper"}', timeout=30)
            assert float(loss[0]["value"][1]) == 1.25
            assert prom.wait_for('count(up{job=~"other-name|anonymous"} == 0) == 2', timeout=30)
            up = {r["metric"]["job"]: r["value"][1] for r in prom.query("up")}
            assert up == {"scraper": "1", "other-name": "0", "anonymous": "0"}
    finally:
        telemetry.shutdown()
