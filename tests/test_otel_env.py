"""OpenTelemetry environment variables: explicit config key > OTEL_* variable > default.

One test per row of the README's table: set the variable, check the effective value; for the
OTLP variables a real push reaches the in-test OTLP receiver (tests/otlp_receiver.py) at the
right path with the right headers.
"""
from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pytest

from conftest import samples, scrape, value
from mfotel.config import ConfigError, load_config, parse_config, resolve_otel_env
from mfotel.config.otel_env import VARIABLES
from mfotel.identity import RankIdentity
from mfotel.instruments import Instruments
from mfotel.telemetry import Telemetry
from otlp_receiver import OtlpReceiver, points

JOB = "mfotel-env"


def effective(data: dict[str, Any], env: dict[str, str], **kwargs: Any):
    return resolve_otel_env(parse_config(data, source="train.yaml"), env, **kwargs)


def push_once(data: dict[str, Any], env: dict[str, str], receiver: OtlpReceiver,
              job: str = JOB) -> Any:
    """Resolve, start a Telemetry with a loss of 1.5, shut down (the final push); the request."""
    resolved = effective({"prometheus": {"port": 0}, **data}, env)
    cfg = resolved.config
    telemetry = Telemetry(cfg, RankIdentity(rank=0, world_size=1, node="n0"), cfg.job_name or job)
    inst = Instruments(telemetry.start(), {"job_name": cfg.job_name or job, "rank": "0"}, ("loss",))
    inst.state.loss = 1.5
    telemetry.shutdown()
    assert receiver.wait(lambda r: r.received >= 1, 10), "no push arrived"
    return resolved


def test_the_readme_table_lists_every_variable_with_its_key():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("## OpenTelemetry environment variables", 1)[1].split("\n## ", 1)[0]
    rows = {m[0]: m[1] for m in re.findall(r"^\| `(OTEL_\w+)` \| `?([\w.]+|\(none\))`? \|",
                                           section, re.M)}
    assert rows == {name: key if key != "-" else "(none)" for name, key, _ in VARIABLES}
    assert len(rows) == 13


# ---------------------------------------------------------------- OTEL_SERVICE_NAME
def test_service_name_names_the_job_when_job_name_is_not_written(tmp_path):
    path = tmp_path / "llama-sft.yaml"
    path.write_text("monitor_config:\n  step_interval: 5\n")
    stem_default = load_config(path)
    assert stem_default.job_name == "llama-sft"                       # the default
    assert resolve_otel_env(stem_default, {}).config.job_name == "llama-sft"
    resolved = resolve_otel_env(stem_default, {"OTEL_SERVICE_NAME": "svc-a"})
    assert resolved.config.job_name == "svc-a"                        # variable over default
    assert resolved.sources["job_name"] == "OTEL_SERVICE_NAME"
    path.write_text("monitor_config:\n  job_name: explicit\n")
    assert resolve_otel_env(load_config(path), {"OTEL_SERVICE_NAME": "svc-a"}).config.job_name \
        == "explicit"                                                 # explicit key over variable


def test_service_name_is_the_resource_service_name_pushed():
    with OtlpReceiver() as receiver:
        push_once({"otlp": {"endpoint": receiver.url}}, {"OTEL_SERVICE_NAME": "svc-b"}, receiver)
    [loss] = [p for p in points(receiver.requests[-1]) if p.name == "mindformers.train.loss"]
    assert loss.resource["service.name"] == "svc-b" and loss.attributes["job_name"] == "svc-b"


def test_unsafe_service_name_is_warned_about_and_ignored():
    resolved = effective({}, {"OTEL_SERVICE_NAME": "../../etc"}, default_job_name="dflt")
    assert resolved.config.job_name == "dflt"
    warning, = resolved.warnings
    assert warning.startswith("environment: OTEL_SERVICE_NAME: '../../etc' is not a safe job name")
    assert "ignored" in warning


# ---------------------------------------------------------------- OTEL_RESOURCE_ATTRIBUTES
def test_resource_attributes_merge_under_the_config_key():
    env = {"OTEL_RESOURCE_ATTRIBUTES": "team=nlp,cluster=a%20b,deployment.environment=prod"}
    resolved = effective({"resource_attributes": {"team": "vision"}}, env)
    assert resolved.config.resource_attributes == {
        "team": "vision", "cluster": "a b", "deployment.environment": "prod"}
    assert resolved.sources["resource_attributes"] == "OTEL_RESOURCE_ATTRIBUTES"


def test_service_name_inside_resource_attributes_names_the_job_below_otel_service_name():
    env = {"OTEL_RESOURCE_ATTRIBUTES": "service.name=from-attrs,team=x"}
    assert effective({}, env).config.job_name == "from-attrs"
    assert effective({}, {**env, "OTEL_SERVICE_NAME": "svc"}).config.job_name == "svc"
    assert "service.name" not in effective({}, env).config.resource_attributes


def test_resource_attributes_are_pushed_on_the_resource():
    with OtlpReceiver() as receiver:
        push_once({"otlp": {"endpoint": receiver.url}},
                  {"OTEL_RESOURCE_ATTRIBUTES": "k8s.cluster.name=c1"}, receiver)
    loss = next(p for p in points(receiver.requests[-1]) if p.name == "mindformers.train.loss")
    assert loss.resource["k8s.cluster.name"] == "c1"


def test_a_malformed_resource_attribute_is_warned_about_and_skipped():
    resolved = effective({}, {"OTEL_RESOURCE_ATTRIBUTES": "team=nlp,oops"})
    assert resolved.config.resource_attributes == {"team": "nlp"}
    assert any("OTEL_RESOURCE_ATTRIBUTES: entry 2 is not name=value" in w for w in resolved.warnings)


# ---------------------------------------------------------------- OTLP endpoint
def test_generic_endpoint_is_a_base_url_with_v1_metrics_appended():
    with OtlpReceiver() as receiver:
        resolved = push_once({}, {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.base_url}, receiver)
    assert resolved.config.otlp.endpoint == receiver.base_url + "/v1/metrics"
    assert resolved.sources["otlp.endpoint"] == "OTEL_EXPORTER_OTLP_ENDPOINT"
    assert receiver.arrivals[-1][0] == "/v1/metrics" and receiver.requests  # decoded: 200


def test_generic_endpoint_with_a_path_keeps_it_and_appends_v1_metrics():
    with OtlpReceiver() as receiver:
        resolved = push_once({}, {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.base_url + "/otlp/"},
                             receiver)
    assert resolved.config.otlp.endpoint.endswith("/otlp/v1/metrics")
    assert receiver.arrivals[-1][0] == "/otlp/v1/metrics"


def test_signal_endpoint_is_used_as_is_and_wins_over_the_generic_one():
    with OtlpReceiver() as receiver:
        env = {"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": receiver.base_url + "/custom/path",
               "OTEL_EXPORTER_OTLP_ENDPOINT": "http://elsewhere:4318"}
        resolved = push_once({}, env, receiver)
    assert resolved.config.otlp.endpoint == receiver.base_url + "/custom/path"
    assert receiver.arrivals[-1][0] == "/custom/path"


def test_config_base_url_gets_v1_metrics_and_wins_over_the_variables():
    with OtlpReceiver() as receiver:
        env = {"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://elsewhere:4318/v1/metrics"}
        resolved = push_once({"otlp": {"endpoint": receiver.base_url}}, env, receiver)
    assert resolved.config.otlp.endpoint == receiver.base_url + "/v1/metrics"
    assert "otlp.endpoint" not in resolved.sources
    assert receiver.arrivals[-1][0] == "/v1/metrics" and receiver.requests


def test_explicit_null_endpoint_turns_the_push_off_despite_the_environment():
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}
    assert effective({"otlp": {"endpoint": None}}, env).config.otlp.endpoint is None
    assert effective({"otlp": {"interval_seconds": 5}}, env).config.otlp.endpoint \
        == "http://collector:4318/v1/metrics"


def test_a_non_http_protocol_is_warned_about():
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317",
           "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    assert any("http/protobuf only" in w for w in effective({}, env).warnings)


# ---------------------------------------------------------------- OTLP headers
def test_headers_are_url_decoded_and_sent():
    with OtlpReceiver() as receiver:
        env = {"OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer%20s3cret,x-tenant=t1"}
        resolved = push_once({"otlp": {"endpoint": receiver.url}}, env, receiver)
    assert resolved.config.otlp.headers == {"authorization": "Bearer s3cret", "x-tenant": "t1"}
    headers = receiver.arrivals[-1][1]
    assert headers["authorization"] == "Bearer s3cret" and headers["x-tenant"] == "t1"


def test_signal_headers_win_over_generic_and_the_config_key_wins_over_both():
    env = {"OTEL_EXPORTER_OTLP_HEADERS": "a=generic", "OTEL_EXPORTER_OTLP_METRICS_HEADERS": "a=metrics"}
    assert effective({}, env).config.otlp.headers == {"a": "metrics"}
    with OtlpReceiver() as receiver:
        push_once({"otlp": {"endpoint": receiver.url, "headers": {"a": "config"}}}, env, receiver)
    assert receiver.arrivals[-1][1]["a"] == "config"


# ---------------------------------------------------------------- timeouts and interval
@pytest.mark.parametrize("env, seconds, variable", [
    ({"OTEL_EXPORTER_OTLP_METRICS_TIMEOUT": "1500", "OTEL_EXPORTER_OTLP_TIMEOUT": "9000"},
     1.5, "OTEL_EXPORTER_OTLP_METRICS_TIMEOUT"),
    ({"OTEL_EXPORTER_OTLP_TIMEOUT": "2500", "OTEL_METRIC_EXPORT_TIMEOUT": "9000"},
     2.5, "OTEL_EXPORTER_OTLP_TIMEOUT"),
    ({"OTEL_METRIC_EXPORT_TIMEOUT": "7000"}, 7.0, "OTEL_METRIC_EXPORT_TIMEOUT"),
])
def test_timeout_variables_are_milliseconds_in_order(env, seconds, variable):
    resolved = effective({}, env)
    assert resolved.config.otlp.timeout_seconds == seconds
    assert resolved.sources["otlp.timeout_seconds"] == variable
    assert effective({"otlp": {"timeout_seconds": 3}}, env).config.otlp.timeout_seconds == 3.0


def test_export_interval_is_milliseconds_and_reaches_the_reader():
    resolved = effective({"otlp": {"endpoint": "http://127.0.0.1:9/v1/metrics"}},
                         {"OTEL_METRIC_EXPORT_INTERVAL": "2500"})
    assert resolved.config.otlp.interval_seconds == 2.5
    from mfotel.cluster.otlp import OtlpPush
    reader = OtlpPush(resolved.config.otlp, on_error=lambda: None).reader()
    try:
        assert reader._export_interval_millis == 2500
    finally:
        reader.shutdown(timeout_millis=1000)
    assert effective({"otlp": {"interval_seconds": 5}}, {"OTEL_METRIC_EXPORT_INTERVAL": "2500"}
                     ).config.otlp.interval_seconds == 5.0


@pytest.mark.parametrize("variable, text", [
    ("OTEL_METRIC_EXPORT_INTERVAL", "soon"), ("OTEL_METRIC_EXPORT_INTERVAL", "1e300"),
    ("OTEL_METRIC_EXPORT_INTERVAL", "nan"), ("OTEL_EXPORTER_OTLP_TIMEOUT", "-5"),
    ("OTEL_EXPORTER_PROMETHEUS_PORT", "70000"), ("OTEL_EXPORTER_PROMETHEUS_PORT", "９４６４"),
    ("OTEL_EXPORTER_OTLP_ENDPOINT", "collector:4318"),
])
def test_invalid_values_are_warned_about_and_ignored(variable, text):
    resolved = effective({}, {variable: text})
    default = effective({}, {}).config
    assert resolved.config == default
    warning, = resolved.warnings
    assert warning.startswith(f"environment: {variable}: ") and "ignored" in warning


# ---------------------------------------------------------------- Prometheus endpoint
def test_prometheus_host_and_port_serve_the_endpoint(port):
    resolved = effective({}, {"OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1",
                              "OTEL_EXPORTER_PROMETHEUS_PORT": str(port)})
    cfg = resolved.config
    assert (cfg.prometheus.host, cfg.prometheus.port) == ("127.0.0.1", port)
    telemetry = Telemetry(cfg, RankIdentity(), JOB)
    inst = Instruments(telemetry.start(), {"job_name": JOB, "rank": "0"}, ("loss",))
    inst.state.loss = 0.25
    telemetry.serve()
    try:
        body = samples(scrape(f"http://127.0.0.1:{port}/metrics"))
        assert value(body, "mindformers_train_loss", job_name=JOB) == 0.25
    finally:
        telemetry.shutdown()
    assert effective({"prometheus": {"port": 9500}}, {"OTEL_EXPORTER_PROMETHEUS_PORT": str(port)}
                     ).config.prometheus.port == 9500


# ---------------------------------------------------------------- OTEL_SDK_DISABLED
def test_sdk_disabled_turns_off_endpoint_and_push_even_when_configured():
    resolved = effective({"prometheus": {"port": 9500}, "otlp": {"endpoint": "http://c:4318"}},
                         {"OTEL_SDK_DISABLED": "TRUE"})
    assert resolved.sdk_disabled
    assert resolved.config.prometheus.port == 0 and resolved.config.otlp.endpoint is None
    assert not effective({}, {"OTEL_SDK_DISABLED": "false"}).sdk_disabled
    assert any("neither true nor false" in w for w in effective({}, {"OTEL_SDK_DISABLED": "1"}).warnings)


@pytest.mark.slow
def test_sdk_disabled_run_still_writes_monitor_lines(port, in_tmp, monkeypatch, capsys, caplog):
    from mfotel.demo.training import run_demo
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    with caplog.at_level(logging.WARNING, logger="mfotel"):
        result = run_demo(steps=4, port=port, step_interval=2)
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("[Monitor]")]
    assert [x.split(",")[0] for x in lines] == ["[Monitor] step: 2", "[Monitor] step: 4"]
    assert result.monitor.telemetry is not None and result.monitor.telemetry.endpoint is None
    notices = [r.getMessage() for r in caplog.records if "OTEL_SDK_DISABLED" in r.getMessage()]
    assert len(notices) == 1 and "[Monitor]" in notices[0]
    with pytest.raises(OSError):
        scrape(f"http://127.0.0.1:{port}/metrics")


def test_bad_config_is_still_an_error_whatever_the_environment():
    with pytest.raises(ConfigError, match="otlp.interval_seconds"):
        effective({"otlp": {"interval_seconds": 0}}, {"OTEL_METRIC_EXPORT_INTERVAL": "1000"})
