"""/metrics serving: formats, compression, and the collection/render caches."""
from __future__ import annotations

import gzip
import urllib.request

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_om

from conftest import samples, value
from mfotel.config import parse_config
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
