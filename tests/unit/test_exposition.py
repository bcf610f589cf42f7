"""/metrics serving: formats, compression, and the collection/render caches."""
from __future__ import annotations

import gzip
import math
import socket
import threading
import time

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_om
from prometheus_client.parser import text_string_to_metric_families as parse_text

from mfotel.endpoint.exposition import NOT_A_SCRAPE, Router
from tests.support.endpoint import request
from tests.support.http import get
from tests.support.metrics import samples, value
from tests.support.otlp_receiver import OtlpReceiver, by_name
from tests.support.waiting import settle

OPENMETRICS = "application/openmetrics-text; version=1.0.0"


@pytest.fixture
def served(port, rank_exporters):
    exporter = rank_exporters({"metrics": ["loss"],
                               "prometheus": {"host": "127.0.0.1", "port": port}}, job_name="expo")
    exporter.instruments.set_native("weight_norm", 2.5, {"param": "w"})
    return exporter.telemetry, exporter.instruments


def test_openmetrics_has_one_eof_and_parses(served):
    telemetry, inst = served
    inst.state.loss = 1.5
    inst.touch()
    reply = get(telemetry.endpoint.url,
                headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    headers, body = reply.headers, reply.body
    assert headers["Content-Type"].startswith("application/openmetrics-text")
    assert body.count(b"# EOF") == 1 and body.endswith(b"# EOF\n")
    names = {f.name for f in parse_om(body.decode())}
    assert {"mindformers_train_loss", "mindformers_train_weight_norm", "target"} <= names


def _loss_and_norm(url: str) -> dict[str, list[tuple[float, float]]]:
    """format -> [(loss, grad norm)] of one scrape in each format, read with prometheus_client's
    own parsers (one value each: the list catches a duplicate sample)."""
    found: dict[str, list[tuple[float, float]]] = {}
    for name, accept, parse in (("text", "text/plain", parse_text),
                                ("openmetrics", OPENMETRICS, parse_om)):
        reply = get(url, headers={"Accept": accept})
        assert reply.headers["Content-Type"].startswith(accept.split(";")[0])
        values = {f.name: [s.value for s in f.samples] for f in parse(reply.text)}
        found[name] = list(zip(values["mindformers_train_loss"],
                               values["mindformers_train_grad_norm"], strict=True))
    return found


def _same(got: tuple[float, float], expected: tuple[float, float]) -> bool:
    return all(math.isnan(e) and math.isnan(g) or g == e
               for g, e in zip(got, expected, strict=True))


def test_loss_and_grad_norm_are_exposed_as_they_are_and_pushed_last_finite(port, rank_exporters):
    """NaN, +Inf and -Inf reach /metrics in both formats (the OTel SDK drops them: the exposition
    puts them back at collection), also before any finite value; the OTLP push keeps the last
    finite value, as docs/otel.md says."""
    nan, inf = float("nan"), float("inf")
    with OtlpReceiver() as receiver:
        exporter = rank_exporters({"metrics": ["loss", "grad_norm"],
                                   "prometheus": {"host": "127.0.0.1", "port": port},
                                   "otlp": {"endpoint": receiver.url, "interval_seconds": 60}},
                                  job_name="as-is")
        st = exporter.state
        for loss, norm in ((nan, inf), (1.5, 2.0), (inf, nan), (-inf, -inf), (0.5, nan)):
            st.loss, st.grad_norm = loss, norm
            exporter.instruments.touch()
            for fmt, values in _loss_and_norm(exporter.url).items():
                assert len(values) == 1 and _same(values[0], (loss, norm)), (fmt, values)
        text = get(exporter.url).text
        assert 'mindformers_train_loss{job_name="as-is",rank="0"} 0.5' in text
        assert 'mindformers_train_grad_norm{job_name="as-is",rank="0"} NaN' in text
        st.grad_norm = -inf
        exporter.instruments.touch()
        om = get(exporter.url, headers={"Accept": OPENMETRICS}).text
        assert 'mindformers_train_grad_norm{job_name="as-is",rank="0"} -Inf' in om
        exporter.shutdown()  # the final push, sent before shutdown returns
        assert receiver.wait(lambda r: r.requests, settle())
    pushed = by_name(receiver.requests[-1])
    assert [p.value for p in pushed["mindformers.train.loss"]] == [0.5]
    assert [p.value for p in pushed["mindformers.train.grad_norm"]] == [2.0]  # last finite


def test_gzip_body_equals_plain_body(served):
    telemetry, inst = served
    inst.state.loss = 0.25
    inst.touch()
    plain = get(telemetry.endpoint.url).body
    reply = get(telemetry.endpoint.url, headers={"Accept-Encoding": "gzip"})
    packed = reply.body
    assert reply.headers["Content-Encoding"] == "gzip"

    def steady(body: bytes) -> list[bytes]:  # process_* are re-read once a second
        return [line for line in body.splitlines() if not line.startswith(b"process_")]
    assert steady(gzip.decompress(packed)) == steady(plain)


def test_values_change_only_through_a_new_version(served):
    telemetry, inst = served
    inst.state.loss = 1.0
    inst.touch()
    first = samples(get(telemetry.endpoint.url).text)
    inst.state.loss = 2.0  # not touched: a scrape serves the cached collection
    assert value(samples(get(telemetry.endpoint.url).text), "mindformers_train_loss") == 1.0
    inst.touch()
    again = samples(get(telemetry.endpoint.url).text)
    assert value(first, "mindformers_train_loss") == 1.0
    assert value(again, "mindformers_train_loss") == 2.0
    assert value(again, "mindformers_train_weight_norm", param="w") == 2.5


def test_native_recollection_is_budgeted(served):
    telemetry, inst = served
    native = telemetry.app.collectors[1]
    native.budget = 1e-9  # any re-collection "costs" far more than the budget allows
    get(telemetry.endpoint.url)
    inst.set_native("weight_norm", 9.0, {"param": "w"})
    body = samples(get(telemetry.endpoint.url).text)
    assert value(body, "mindformers_train_weight_norm", param="w") == 2.5  # previous values
    native.budget = None
    body = samples(get(telemetry.endpoint.url).text)
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
        body = b"".join(router({"PATH_INFO": path},
                               lambda status, headers: answered.update(s=status)))
        return answered["s"][:3], body
    assert call("/api/v1/status") == ("200", b"api")
    assert call("/") == ("200", b"page")
    assert call("/metrics") == ("200", b"metrics")
    assert call("/other")[0] == "404"


def test_ipv6_loopback_host_is_served(port, rank_exporters):
    if not socket.has_ipv6:
        pytest.fail("this machine has no IPv6; the endpoint's IPv6 support cannot be checked")
    exporter = rank_exporters({"metrics": ["loss"], "prometheus": {"host": "::1", "port": port}},
                              job_name="expo6", serve=False)
    exporter.state.loss = 3.0
    exporter.serve()
    assert exporter.url == f"http://[::1]:{port}/metrics"
    assert value(samples(get(exporter.url).text), "mindformers_train_loss") == 3.0


def _scrape(url: str, timeout_header: str | None, pause: float = 0.0) -> bytes:
    """GET /metrics over a raw connection, `pause` seconds after connecting (a scrape the
    machine's load delays), with Prometheus' time-out header when given."""
    host, port = url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
    extra = f"X-Prometheus-Scrape-Timeout-Seconds: {timeout_header}\r\n" if timeout_header else ""
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        time.sleep(pause)
        sock.sendall(f"GET /metrics HTTP/1.1\r\nHost: x\r\n{extra}\r\n".encode())
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


@pytest.mark.parametrize("header, pause, counts", [
    (None, 0.0, True), ("10", 0.0, True), ("soon", 0.0, True),
    ("0.000001", 0.0, False), ("1", 0.7, False), ("1", 0.0, True)],
    ids=["no-header", "in-time", "unreadable-header", "too-late", "delayed-past-half", "prompt"])
def test_a_scrape_ends_the_linger_only_if_its_scraper_still_waited(served, header, pause, counts):
    """Prometheus drops a body that arrives after its scrape_timeout: the final status it
    carried would never be stored, so such an answer does not end a rank's linger
    (`linger_until_scraped`); one sent within half the time-out does."""
    telemetry, inst = served
    inst.state.loss = 2.5
    inst.touch()
    answer = _scrape(telemetry.endpoint.url, header, pause)
    assert answer.startswith(b"HTTP/1.1 200") and b"mindformers_train_loss" in answer
    assert telemetry.wait_scraped(0.3) is counts


@pytest.mark.parametrize("header, counts", [("1", False), ("10", True)],
                         ids=["past-half-of-1s", "within-half-of-10s"])
def test_a_scrape_that_waited_to_be_accepted_counts_that_wait(served, header, counts):
    """A rank too busy to accept a connection at once (its server thread kept from the CPU)
    answers fast once it does; the scraper's clock ran from its connect. The 0.8 s in the
    kernel's accept queue count: past half of a 1 s time-out, within half of 10 s (seen in a
    loaded run: Prometheus dropped a rank's final scrape that the rank had answered "in
    time", by its clock from the accept)."""
    telemetry, inst = served
    inst.state.loss = 2.5
    inst.touch()
    server = telemetry.endpoint.server
    blocked = threading.Event()
    # the server's thread sleeps: the connection waits unaccepted, its request in the buffer
    server._loop.call_soon_threadsafe(lambda: (blocked.set(), time.sleep(0.8)))
    assert blocked.wait(5)
    answer = _scrape(telemetry.endpoint.url, header)
    assert answer.startswith(b"HTTP/1.1 200") and b"mindformers_train_loss" in answer
    assert telemetry.wait_scraped(0.3) is counts


def test_a_reader_that_is_no_scrape_never_ends_the_linger(served):
    """The node agent reads a rank's identity from /metrics; it says so (NOT_A_SCRAPE) and
    its answer does not end the rank's linger, whatever else it sends: only a scrape stores
    the final status in Prometheus."""
    telemetry, inst = served
    inst.state.loss = 2.5
    inst.touch()
    for headers in ({NOT_A_SCRAPE: "1"},
                    {NOT_A_SCRAPE: "1", "X-Prometheus-Scrape-Timeout-Seconds": "10"}):
        reply = get(telemetry.endpoint.url, headers=headers)
        assert reply.status == 200 and b"mindformers_train_loss 2.5" in reply.body.replace(
            b'{job_name="expo",rank="0"}', b"")
        assert telemetry.wait_scraped(0.3) is False, headers
    get(telemetry.endpoint.url, headers={"X-Prometheus-Scrape-Timeout-Seconds": "10"})
    assert telemetry.wait_scraped(0.3) is True
