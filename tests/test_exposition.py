"""/metrics serving: formats, compression, and the collection/render caches."""
from __future__ import annotations

import gzip
import socket
import urllib.request

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_om

from conftest import samples, value
from endpoint_support import request
from mfotel.config import parse_config
from mfotel.exposition import Router
from mfotel.identity import RankIdentity
from mfotel.instruments import Instruments
from mfotel.telemetry import Telemetry


@pytest.fixture
def served(port):
    cfg = parse_config({"metrics": ["loss"], "prometheus": {"host": "127.0.0.1", "port": port}})
    telemetry = Telemetry(cfg, RankIdentity(), "expo")
    inst = Instruments(telemetry.start(), {"job_name": "expo", "rank": "0"}, cfg.metrics,
                       native_meter=telemetry.native_meter)
    inst.set_native("weight_norm", 2.5, {"param": "w"})
    telemetry.serve(lambda: inst.version, lambda: inst.native_version)
    yield telemetry, inst
    telemetry.shutdown()


def get(url: str, **headers: str) -> tuple[dict, bytes]:
    request = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(request, timeout=5) as response:
        return dict(response.headers), response.read()


def test_openmetrics_has_one_eof_and_parses(served):
    telemetry, inst = served
    inst.state.loss = 1.5
    inst.touch()
    headers, body = get(telemetry.endpoint.url,
                        Accept="application/openmetrics-text; version=1.0.0")
    assert headers["Content-Type"].startswith("application/openmetrics-text")
    assert body.count(b"# EOF") == 1 and body.endswith(b"# EOF\n")
    names = {f.name for f in parse_om(body.decode())}
    assert {"mindformers_train_loss", "mindformers_train_weight_norm", "target"} <= names


def test_gzip_body_equals_plain_body(served):
    telemetry, inst = served
    inst.state.loss = 0.25
    inst.touch()
    _, plain = get(telemetry.endpoint.url)
    headers, packed = get(telemetry.endpoint.url, **{"Accept-Encoding": "gzip"})
    assert headers["Content-Encoding"] == "gzip"

    def steady(body: bytes) -> list[bytes]:  # process_* are re-read once a second
        return [line for line in body.splitlines() if not line.startswith(b"process_")]
    assert steady(gzip.decompress(packed)) == steady(plain)


def test_values_change_only_through_a_new_version(served):
    telemetry, inst = served
    inst.state.loss = 1.0
    inst.touch()
    first = samples(get(telemetry.endpoint.url)[1].decode())
    inst.state.loss = 2.0  # not touched: a scrape serves the cached collection
    assert value(samples(get(telemetry.endpoint.url)[1].decode()), "mindformers_train_loss") == 1.0
    inst.touch()
    again = samples(get(telemetry.endpoint.url)[1].decode())
    assert value(first, "mindformers_train_loss") == 1.0
    assert value(again, "mindformers_train_loss") == 2.0
    assert value(again, "mindformers_train_weight_norm", param="w") == 2.5


def test_native_recollection_is_budgeted(served):
    telemetry, inst = served
    native = telemetry.app.collectors[1]
    native.budget = 1e-9  # any re-collection "costs" far more than the budget allows
    get(telemetry.endpoint.url)
    inst.set_native("weight_norm", 9.0, {"param": "w"})
    body = samples(get(telemetry.endpoint.url)[1].decode())
    assert value(body, "mindformers_train_weight_norm", param="w") == 2.5  # previous values
    native.budget = None
    body = samples(get(telemetry.endpoint.url)[1].decode())
    assert value(body, "mindformers_train_weight_norm", param="w") == 9.0


@pytest.mark.parametrize("path", ["/", "/metricsx", "/metrics/", "/favicon.ico", "/api/v1/query"])
def test_only_documented_paths_serve_metrics(served, path):
    telemetry, _ = served
    reply = request(telemetry.endpoint.port, path=path)
    assert reply.status == 404 and b"mindformers_train" not in reply.body
    assert b"/metrics" in reply.body  # says where the metrics are
    assert request(telemetry.endpoint.port, path="/metrics?debug=1").status == 200


def test_head_has_the_headers_of_get_and_no_body(served):
    telemetry, _ = served
    get_reply = request(telemetry.endpoint.port)
    head_reply = request(telemetry.endpoint.port, method="HEAD")
    assert head_reply.status == 200 and head_reply.body == b""
    assert head_reply.headers["Content-Length"] == str(len(get_reply.body))
    assert request(telemetry.endpoint.port, method="POST").status == 405


def test_router_prefix_entries_serve_the_paths_below_them():
    def app(name):
        def serve_name(environ, start_response):
            start_response("200 OK", [])
            return [name.encode()]
        return serve_name
    router = Router({"/metrics": app("metrics"), "/api/": app("api"), "/": app("page")})
    answered = {}

    def call(path):
        body = b"".join(router({"PATH_INFO": path}, lambda status, headers: answered.update(s=status)))
        return answered["s"][:3], body
    assert call("/api/v1/status") == ("200", b"api")
    assert call("/") == ("200", b"page")
    assert call("/metrics") == ("200", b"metrics")
    assert call("/other")[0] == "404"


def test_ipv6_loopback_host_is_served(port):
    if not socket.has_ipv6:
        pytest.fail("this machine has no IPv6; the endpoint's IPv6 support cannot be checked")
    cfg = parse_config({"metrics": ["loss"], "prometheus": {"host": "::1", "port": port}})
    telemetry = Telemetry(cfg, RankIdentity(), "expo6")
    inst = Instruments(telemetry.start(), {"job_name": "expo6", "rank": "0"}, cfg.metrics)
    inst.state.loss = 3.0
    telemetry.serve(lambda: inst.version)
    try:
        assert telemetry.endpoint.url == f"http://[::1]:{port}/metrics"
        _, body = get(telemetry.endpoint.url)
        assert value(samples(body.decode()), "mindformers_train_loss") == 3.0
    finally:
        telemetry.shutdown()
