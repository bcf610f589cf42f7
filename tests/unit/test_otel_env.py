"""OpenTelemetry environment variables: explicit config key > OTEL_* variable > default.

One test per row of the table in docs/otel.md: set the variable, check the effective value; for the
OTLP variables a real push reaches the in-test OTLP receiver (tests/support/otlp_receiver.py)
at the right path with the right headers. A run with OTEL_SDK_DISABLED:
tests/e2e/test_otel_env_e2e.py.
"""
from __future__ import annotations

import logging
import re
from typing import Any

import pytest

from mfotel.config import ConfigError, load_config, parse_config, resolve_otel_env
from mfotel.config.otel_env import VARIABLES
from mfotel.identity import RankIdentity
from mfotel.instruments import Instruments
from mfotel.telemetry import Telemetry
from tests.support.metrics import samples, scrape, value
from tests.support.otlp_receiver import OtlpReceiver, points
from tests.support.paths import ROOT
from tests.support.ranks import rank_exporter
from tests.support.waiting import settle

JOB = "mfotel-env"


def effective(data: dict[str, Any], env: dict[str, str], **kwargs: Any):
    return resolve_otel_env(parse_config(data, source="train.yaml"), env, **kwargs)


def push_once(data: dict[str, Any], env: dict[str, str], receiver: OtlpReceiver,
              job: str = JOB) -> Any:
    """Resolve, start a Telemetry with a loss of 1.5, shut down (the final push); the request."""
    resolved = effective({"prometheus": {"port": 0}, **data}, env)
    cfg = resolved.config
    exporter = rank_exporter(cfg, RankIdentity(rank=0, world_size=1, node="n0"),
                             cfg.job_name or job, serve=False)
    exporter.state.loss = 1.5
    exporter.shutdown()  # the final push, sent before shutdown returns
    assert receiver.wait(lambda r: r.received >= 1, settle()), "no push arrived"
    return resolved


def keys_of(key: str) -> list[str]:
    """The config keys of a VARIABLES row ("-": none)."""
    return [] if key == "-" else key.split(", ")


def test_the_docs_table_lists_every_variable_with_its_key():
    readme = (ROOT / "docs" / "otel.md").read_text()
    section = readme.split("## OpenTelemetry environment variables", 1)[1].split("\n## ", 1)[0]
    rows = {m[0]: re.findall(r"`([\w.]+)`", m[1]) or [m[1]]
            for m in re.findall(r"^\| `(OTEL_\w+)` \| ([^|]+?) \|", section, re.M)}
    assert rows == {name: keys_of(key) or ["(none)"] for name, key, _ in VARIABLES}
    assert len(rows) == 14


#: a usable value for each variable, to see whether a shown block lets it through
ENV_VALUES = {
    "OTEL_SERVICE_NAME": "svc-env", "OTEL_RESOURCE_ATTRIBUTES": "team=env",
    "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://collector:4318/v1/metrics",
    "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318",
    "OTEL_EXPORTER_OTLP_METRICS_HEADERS": "authorization=Bearer%20a",
    "OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer%20b",
    "OTEL_EXPORTER_OTLP_METRICS_TIMEOUT": "3000", "OTEL_EXPORTER_OTLP_TIMEOUT": "3000",
    "OTEL_METRIC_EXPORT_TIMEOUT": "3000", "OTEL_METRIC_EXPORT_INTERVAL": "2000",
    "OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1", "OTEL_EXPORTER_PROMETHEUS_PORT": "9500",
    "OTEL_METRICS_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true",
}


def shown_blocks() -> list[tuple[str, str]]:
    """The configuration blocks a user copies: the README's and docs/configuration.md's YAML
    blocks with a monitor_config or an OTelMonitor callback entry, and the example file."""
    blocks = [(f"{name} block {i}", text)
              for name in ("README.md", "docs/configuration.md")
              for i, text in enumerate(re.findall(r"```yaml\n(.*?)```",
                                                  (ROOT / name).read_text(), re.S))
              if "monitor_config:" in text or "type: OTelMonitor" in text]
    return [*blocks, ("examples/monitor_config.yaml",
                      (ROOT / "examples" / "monitor_config.yaml").read_text())]


def test_the_shown_blocks_include_the_full_reference_block():
    names = [name for name, _ in shown_blocks()]
    assert any(n.startswith("README.md") for n in names)
    full = [text for name, text in shown_blocks() if name.startswith("docs/configuration.md")]
    assert len(full) == 1 and "native_series_limit" in full[0]


@pytest.mark.parametrize("name,text", shown_blocks(), ids=[n for n, _ in shown_blocks()])
def test_a_copied_block_leaves_every_otel_variable_in_force(name, text, tmp_path):
    """Keys that beat a variable are commented out in what users copy, with the variable named
    beside them, so a copied block never switches the environment off by accident."""
    path = tmp_path / "train.yaml"
    path.write_text(text)
    cfg = load_config(path)
    assert set(ENV_VALUES) == {variable for variable, _, _ in VARIABLES}
    for variable, key, _ in VARIABLES:
        resolved = resolve_otel_env(cfg, {variable: ENV_VALUES[variable]})
        assert not resolved.warnings, (name, variable, resolved.warnings)
        if key == "-":
            assert resolved.sdk_disabled, name
        for one in keys_of(key):
            assert resolved.sources.get(one) == variable, f"{name}: {one} hides {variable}"
    for line in re.findall(r"^\s*#\s*(\w+:.*)$", text, re.M):
        leaf = line.split(":", 1)[0]
        settable = {variable for variable, key, _ in VARIABLES
                    if any(k.rsplit(".", 1)[-1] == leaf for k in keys_of(key))}
        assert not settable or any(v in line for v in settable), \
            f"{name}: `{line}` should name the variable it leaves in force"


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
    assert any("OTEL_RESOURCE_ATTRIBUTES: entry 2 is not name=value" in w
               for w in resolved.warnings)


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
    env = {"OTEL_EXPORTER_OTLP_HEADERS": "a=generic",
           "OTEL_EXPORTER_OTLP_METRICS_HEADERS": "a=metrics"}
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
    with rank_exporter(cfg, job_name=JOB, serve=False) as exporter:
        exporter.state.loss = 0.25
        exporter.serve()
        body = samples(scrape(f"http://127.0.0.1:{port}/metrics"))
        assert value(body, "mindformers_train_loss", job_name=JOB) == 0.25
    assert effective({"prometheus": {"port": 9500}}, {"OTEL_EXPORTER_PROMETHEUS_PORT": str(port)}
                     ).config.prometheus.port == 9500


# ---------------------------------------------------------------- OTEL_SDK_DISABLED
def test_sdk_disabled_turns_off_endpoint_and_push_even_when_configured():
    resolved = effective({"prometheus": {"port": 9500}, "otlp": {"endpoint": "http://c:4318"}},
                         {"OTEL_SDK_DISABLED": "TRUE"})
    assert resolved.sdk_disabled
    assert resolved.config.prometheus.port == 0 and resolved.config.otlp.endpoint is None
    assert not effective({}, {"OTEL_SDK_DISABLED": "false"}).sdk_disabled
    warnings = effective({}, {"OTEL_SDK_DISABLED": "1"}).warnings
    assert any("neither true nor false" in w for w in warnings)


def test_bad_config_is_still_an_error_whatever_the_environment():
    with pytest.raises(ConfigError, match="otlp.interval_seconds"):
        effective({"otlp": {"interval_seconds": 0}}, {"OTEL_METRIC_EXPORT_INTERVAL": "1000"})


# ---------------------------------------------------------------- a written key wins, and says so
@pytest.mark.parametrize("data, env, line", [
    ({"otlp": {"endpoint": None}}, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"},
     "OTEL_EXPORTER_OTLP_ENDPOINT=http://c:4318 is set but monitor_config.otlp.endpoint: null "
     "(train.yaml) wins: the push is off. Fix: remove otlp.endpoint from monitor_config to let "
     "the variable through, or unset OTEL_EXPORTER_OTLP_ENDPOINT"),
    ({"otlp": {"endpoint": "http://mine:4318"}},
     {"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://u:pw-1@c:4318/v1/metrics"},
     "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT=http://u:***@c:4318/v1/metrics is set but "
     "monitor_config.otlp.endpoint: http://mine:4318 (train.yaml) wins: the push goes to "
     "http://mine:4318/v1/metrics."),
    ({"prometheus": {"port": 9464}}, {"OTEL_EXPORTER_PROMETHEUS_PORT": "9500"},
     "OTEL_EXPORTER_PROMETHEUS_PORT=9500 is set but monitor_config.prometheus.port: 9464 "
     "(train.yaml) wins: the ranks serve port 9464 + local rank."),
    ({"prometheus": {"port": 0}}, {"OTEL_EXPORTER_PROMETHEUS_PORT": "9500"},
     "monitor_config.prometheus.port: 0 (train.yaml) wins: the /metrics endpoint is off."),
    ({"prometheus": {"host": "127.0.0.1"}}, {"OTEL_EXPORTER_PROMETHEUS_HOST": "0.0.0.0"},
     "OTEL_EXPORTER_PROMETHEUS_HOST=0.0.0.0 is set but monitor_config.prometheus.host: "
     "127.0.0.1 (train.yaml) wins. Fix:"),
    ({"job_name": "mine"}, {"OTEL_SERVICE_NAME": "svc"},
     "OTEL_SERVICE_NAME=svc is set but monitor_config.job_name: mine (train.yaml) wins."),
    ({"job_name": "mine"}, {"OTEL_RESOURCE_ATTRIBUTES": "service.name=svc"},
     "OTEL_RESOURCE_ATTRIBUTES=service.name=svc is set but monitor_config.job_name: mine"),
    ({"otlp": {"headers": {"authorization": "Bearer mine-1"}}},
     {"OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer%20env-1,x-tenant=t"},
     "OTEL_EXPORTER_OTLP_HEADERS=authorization=***,x-tenant=*** is set but "
     "monitor_config.otlp.headers: {authorization: ***} (train.yaml) wins."),
    ({"otlp": {"timeout_seconds": 3}}, {"OTEL_EXPORTER_OTLP_TIMEOUT": "9000"},
     "OTEL_EXPORTER_OTLP_TIMEOUT=9000 is set but monitor_config.otlp.timeout_seconds: 3.0"),
    ({"otlp": {"interval_seconds": 5}}, {"OTEL_METRIC_EXPORT_INTERVAL": "2000"},
     "OTEL_METRIC_EXPORT_INTERVAL=2000 is set but monitor_config.otlp.interval_seconds: 5.0"),
    ({"resource_attributes": {"team": "a", "api_token": "mine-2"}},
     {"OTEL_RESOURCE_ATTRIBUTES": "team=b,api_token=env-2,zone=z"},
     "OTEL_RESOURCE_ATTRIBUTES sets team=b but monitor_config.resource_attributes.team: a "
     "(train.yaml) wins. Fix: remove team from resource_attributes"),
])
def test_a_written_key_over_a_set_variable_is_said_in_one_line(data, env, line):
    resolved = effective(data, env)
    said = [w for w in resolved.warnings if line in w]
    assert len(said) == 1, resolved.warnings
    assert all(secret not in w for w in resolved.warnings
               for secret in ("pw-1", "mine-1", "env-1", "mine-2", "env-2"))
    assert effective(data, {}).warnings == []          # nothing set: nothing said


def test_every_set_variable_of_a_written_key_gets_its_own_line():
    env = {"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://a:4318/v1/metrics",
           "OTEL_EXPORTER_OTLP_ENDPOINT": "http://b:4318"}
    lines = effective({"otlp": {"endpoint": None}}, env).warnings
    assert [w.split(" is set", 1)[0] for w in lines] == [
        "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT=http://a:4318/v1/metrics",
        "OTEL_EXPORTER_OTLP_ENDPOINT=http://b:4318"]


def test_a_callback_entry_names_its_own_key_path():
    cfg = parse_config({"otlp": {"endpoint": None}}, source="llama.yaml", prefix="callbacks[1]")
    [line] = resolve_otel_env(cfg, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}).warnings
    assert "but callbacks[1].otlp.endpoint: null (llama.yaml) wins" in line
    assert "remove otlp.endpoint from callbacks[1]" in line


def test_mfotel_check_says_which_key_beat_which_variable(tmp_path):
    from mfotel.checks import check_file
    path = tmp_path / "train.yaml"
    path.write_text("monitor_config:\n  otlp: {endpoint: null}\n  prometheus: {port: 9464}\n")
    report = check_file(path, ranks=1, env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
                                            "OTEL_EXPORTER_PROMETHEUS_PORT": "9600"})
    assert not report.errors
    said = [w for w in report.warnings if " is set but " in w]
    assert [w.split(" is set", 1)[0] for w in said] == [
        "OTEL_EXPORTER_PROMETHEUS_PORT=9600", "OTEL_EXPORTER_OTLP_ENDPOINT=http://c:4318"]
    assert f"monitor_config.otlp.endpoint: null ({path}) wins: the push is off" in said[1]


def test_the_run_start_logs_which_key_beat_which_variable_once(monkeypatch, caplog):
    from mfotel.callback import OTelMonitor
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318")
    with caplog.at_level(logging.WARNING, logger="mfotel"):
        monitor = OTelMonitor(otlp={"endpoint": None}, prometheus={"port": 0})
    assert monitor.config.otlp.endpoint is None
    said = [r.getMessage() for r in caplog.records if " is set but " in r.getMessage()]
    assert said == ["mfotel: OTEL_EXPORTER_OTLP_ENDPOINT=http://c:4318 is set but "
                    "OTelMonitor.otlp.endpoint: null (OTelMonitor(...)) wins: the push is off. "
                    "Fix: remove otlp.endpoint from OTelMonitor to let the variable through, or "
                    "unset OTEL_EXPORTER_OTLP_ENDPOINT"]


# ---------------------------------------------------------------- OTEL_METRICS_EXPORTER
ENDPOINT_ENV = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}


@pytest.mark.parametrize("text, serves, push, said", [
    (None, True, None, []),
    ("", True, None, []),
    ("none", False, None, []),
    ("prometheus", True, None, []),
    ("otlp", False, "http://localhost:4318/v1/metrics", []),
    ("prometheus,otlp", True, "http://localhost:4318/v1/metrics", []),
    (" OTLP , Prometheus,otlp ", True, "http://localhost:4318/v1/metrics", []),
    ("none,otlp", False, "http://localhost:4318/v1/metrics", ["'none' together with other"]),
    ("prometheus2", True, None, ["unknown exporter 'prometheus2' (did you mean 'prometheus'?); "
                                 "ignored, as OpenTelemetry specifies"]),
    ("console", True, None, ["'console' is an OpenTelemetry exporter mfotel does not offer"]),
    ("logging,otlp/stdout", True, None, ["'logging' is an", "'otlp/stdout' is an"]),
    ("bogus,otlp", False, "http://localhost:4318/v1/metrics", ["unknown exporter 'bogus'"]),
])
def test_metrics_exporter_selects_the_endpoint_and_the_push(text, serves, push, said):
    env = {} if text is None else {"OTEL_METRICS_EXPORTER": text}
    resolved = effective({}, env)
    assert (resolved.config.prometheus.port == 9464) is serves
    assert resolved.config.otlp.endpoint == push
    assert len(resolved.warnings) == len(said)
    for warning, words in zip(resolved.warnings, said, strict=True):
        assert warning.startswith("environment: OTEL_METRICS_EXPORTER") and words in warning
    if text and not said:
        changed = {k for k, v in resolved.sources.items() if v == "OTEL_METRICS_EXPORTER"}
        assert changed == {key for key, on in (("prometheus.port", not serves),
                                               ("otlp.endpoint", bool(push))) if on}


def test_metrics_exporter_pushes_to_the_endpoint_variables_url():
    resolved = effective({}, {**ENDPOINT_ENV, "OTEL_METRICS_EXPORTER": "otlp"})
    assert resolved.config.otlp.endpoint == "http://c:4318/v1/metrics"
    assert resolved.sources["otlp.endpoint"] == "OTEL_EXPORTER_OTLP_ENDPOINT"


@pytest.mark.parametrize("text, variable", [
    ("prometheus", "OTEL_EXPORTER_OTLP_ENDPOINT"), ("none", "OTEL_EXPORTER_OTLP_ENDPOINT"),
    ("otlp", "OTEL_EXPORTER_PROMETHEUS_PORT"),
])
def test_variables_of_an_exporter_left_out_are_said_and_ignored(text, variable):
    env = {**ENDPOINT_ENV, "OTEL_EXPORTER_PROMETHEUS_PORT": "9500", "OTEL_METRICS_EXPORTER": text}
    resolved = effective({}, env)
    [warning] = [w for w in resolved.warnings if w.startswith(f"environment: {variable}=")]
    assert f"OTEL_METRICS_EXPORTER={text} does not select" in warning and "ignored" in warning


@pytest.mark.parametrize("data, text, serves, push, line", [
    ({"prometheus": {"port": 9464}}, "otlp", True, "http://localhost:4318/v1/metrics",
     "OTEL_METRICS_EXPORTER=otlp is set but monitor_config.prometheus.port: 9464 (train.yaml) "
     "wins: the ranks serve port 9464 + local rank."),
    ({"prometheus": {"port": 9464}}, "none", True, None,
     "OTEL_METRICS_EXPORTER=none is set but monitor_config.prometheus.port: 9464"),
    ({"prometheus": {"port": 0}}, "prometheus", False, None,
     "OTEL_METRICS_EXPORTER=prometheus is set but monitor_config.prometheus.port: 0 "
     "(train.yaml) wins: the /metrics endpoint is off."),
    ({"otlp": {"endpoint": None}}, "otlp", False, None,
     "OTEL_METRICS_EXPORTER=otlp is set but monitor_config.otlp.endpoint: null (train.yaml) "
     "wins: the push is off."),
    ({"otlp": {"endpoint": "http://mine:4318"}}, "prometheus", True,
     "http://mine:4318/v1/metrics", "OTEL_METRICS_EXPORTER=prometheus is set but "
     "monitor_config.otlp.endpoint: http://mine:4318 (train.yaml) wins: the push goes to"),
])
def test_a_written_key_beats_the_metrics_exporter_and_says_so(data, text, serves, push, line):
    resolved = effective(data, {"OTEL_METRICS_EXPORTER": text})
    assert bool(resolved.config.prometheus.port) is serves
    assert resolved.config.otlp.endpoint == push
    assert [w for w in resolved.warnings if line in w], resolved.warnings


def test_sdk_disabled_wins_over_the_metrics_exporter():
    resolved = effective({}, {"OTEL_METRICS_EXPORTER": "prometheus,otlp",
                              "OTEL_SDK_DISABLED": "true"})
    assert resolved.sdk_disabled and resolved.warnings == []
    assert resolved.config.prometheus.port == 0 and resolved.config.otlp.endpoint is None


@pytest.mark.parametrize("text", ["none", "prometheus", "otlp", "prometheus,otlp"])
def test_metrics_exporter_serves_and_pushes_what_it_selects(text, port):
    """A real endpoint and a real push: each selected exporter carries the loss, the others
    carry nothing (the endpoint's port refuses connections, the receiver gets no request)."""
    with OtlpReceiver() as receiver:
        env = {"OTEL_METRICS_EXPORTER": text, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.base_url,
               "OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1",
               "OTEL_EXPORTER_PROMETHEUS_PORT": str(port)}
        cfg = effective({}, env).config
        telemetry = Telemetry(cfg, RankIdentity(rank=0, world_size=1, node="n0"), JOB)
        inst = Instruments(telemetry.start(), {"job_name": JOB, "rank": "0"}, ("loss",))
        inst.state.loss = 0.75
        telemetry.serve()
        try:
            if "prometheus" in text:
                body = samples(scrape(f"http://127.0.0.1:{port}/metrics"))
                assert value(body, "mindformers_train_loss", job_name=JOB) == 0.75
            else:
                assert telemetry.endpoint is None
                with pytest.raises(OSError):
                    scrape(f"http://127.0.0.1:{port}/metrics")
        finally:
            telemetry.shutdown()  # the final push, when there is one
        if "otlp" in text:
            assert receiver.wait(lambda r: r.requests, 10), "no push arrived"
            [loss] = [p for p in points(receiver.requests[-1])
                      if p.name == "mindformers.train.loss"]
            assert loss.value == 0.75
        else:
            assert receiver.arrivals == []
