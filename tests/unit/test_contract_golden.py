"""Golden: the exposed Prometheus names, types and label keys of the metric contract.

The table below is written out by hand on purpose: a change to a name, a unit suffix or a label
key must be a deliberate edit here (and in the README, dashboards and rules). The same names
must come out of an OpenTelemetry Collector or a Prometheus that translates our OTLP push: the
OTLP payload is received by the in-test receiver (tests/support/otlp_receiver.py) and named by a
table-tested port of the translation rules (tests/support/prometheus_translation.py; the real
implementation is a Go library, prometheus/otlptranslator, which cannot run here).
"""
from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mfotel.config import parse_config
from mfotel.contract import CONTRACT, PROCESS_SERIES, SEED_METRICS, MetricSpec
from mfotel.identity import RankIdentity
from mfotel.instruments import Instruments
from tests.support.metrics import samples, scrape, value
from tests.support.otlp_receiver import OtlpReceiver, points
from tests.support.prometheus_translation import prometheus_name
from tests.support.ranks import rank_exporter
from tests.support.waiting import settle

JR = ("job_name", "rank")
GOLDEN = {
    "mindformers_train_loss": ("gauge", JR),
    "mindformers_train_learning_rate": ("gauge", JR),
    "mindformers_train_grad_norm": ("gauge", JR),
    "mindformers_train_throughput_samples_per_second": ("gauge", JR),
    "mindformers_train_samples": ("counter", JR),
    "mindformers_train_tokens": ("counter", JR),
    "mindformers_train_step_duration_seconds": ("histogram", JR),
    "mindformers_train_device_throughput_tokens_per_second": ("gauge", JR),
    "mindformers_train_model_flops_utilization_ratio": ("gauge", JR),
    "mindformers_train_step": ("gauge", JR),
    "mindformers_train_steps": ("counter", JR),
    "mindformers_train_last_step_timestamp_seconds": ("gauge", JR),
    "mindformers_train_step_outside_seconds": ("counter", JR),
    "mindformers_train_step_begin_timestamp_seconds": ("gauge", JR),
    "mindformers_train_loss_finite": ("gauge", JR),
    "mindformers_train_nonfinite": ("counter", ("job_name", "metric", "rank")),
    "mindformers_train_overflow": ("counter", JR),
    "mindformers_train_loss_scale": ("gauge", JR),
    "mindformers_train_epoch": ("gauge", JR),
    "mindformers_train_progress_ratio": ("gauge", JR),
    "mindformers_train_status": ("gauge", JR),
    "mindformers_train_first_nonfinite_step": ("gauge", JR),
    "mindformers_train_start_timestamp_seconds": ("gauge", JR),
    "mindformers_train_end_timestamp_seconds": ("gauge", ("job_name", "rank", "reason")),
    "mindformers_train_time_seconds": ("counter", ("job_name", "phase", "rank")),
    "mindformers_train_process_start_timestamp_seconds": ("gauge", JR),
    "mindformers_train_last_checkpoint_timestamp_seconds": ("gauge", JR),
    "mindformers_train_checkpoint_duration_seconds": ("gauge", JR),
    "mindformers_train_checkpoints": ("counter", JR),
    "mindformers_train_checkpoint_interval_steps": ("gauge", JR),
    "mindformers_train_checkpoint_interval_seconds": ("gauge", JR),
    "mindformers_train_eval_loss": ("gauge", JR),
    "mindformers_train_eval_step": ("gauge", JR),
    "mindformers_train_eval_duration_seconds": ("gauge", JR),
    "mindformers_train_rank_info": ("gauge", ("device_id", "host", "job_name", "local_rank",
                                              "node", "rank", "world_size")),
    "mindformers_train_actions": ("counter", ("action", "job_name", "rank", "source")),
    "mfotel_export_errors": ("counter", ("job_name", "rank", "stage")),
}
#: prometheus_client's process collector, beside the contract (not at cardinality health).
PROCESS_GOLDEN = {
    "process_cpu_seconds": ("counter", JR),
    "process_resident_memory_bytes": ("gauge", JR),
    "process_virtual_memory_bytes": ("gauge", JR),
    "process_start_time_seconds": ("gauge", JR),
    "process_open_fds": ("gauge", JR),
    "process_max_fds": ("gauge", JR),
}


def _record_everything(inst: Instruments) -> None:
    """Every contract instrument, with a value."""
    st = inst.state
    for key in ("loss", "learning_rate", "grad_norm", "throughput", "loss_scale", "progress",
                "device_tokens", "mfu", "start_timestamp", "last_checkpoint_timestamp",
                "checkpoint_duration", "checkpoint_interval_seconds", "eval_loss",
                "eval_duration"):
        setattr(st, key, 0.5)
    st.checkpoints, st.checkpoint_interval_steps, st.eval_step = 1, 100, 1
    st.samples, st.tokens, st.step, st.steps, st.overflow, st.epoch = 8, 128, 1, 1, 0, 1
    st.last_step_timestamp, st.loss_finite, st.status, st.first_nonfinite_step = 1.0, 1, 1, 1
    st.step_begin_timestamp, st.step_outside = 0.9, 0.01
    st.end_timestamp, st.end_reason = 2.0, "failed"
    st.actions[("stop", "control")] = 1
    st.time, st.process_start_timestamp = {"startup": 1.0, "step": 0.5}, 0.0
    inst.record_step_seconds(0.2)


IDENTITY = RankIdentity(rank=3, local_rank=0, world_size=4, node="n1", device_id="0")


def _full_exposition(port: int, **config: object) -> str:
    cfg = parse_config({"metrics": list(SEED_METRICS), "seq_length": 16,
                        "prometheus": {"host": "127.0.0.1", "port": port}, **config})
    with rank_exporter(cfg, IDENTITY, "golden", serve=False) as exporter:
        _record_everything(exporter.instruments)
        return scrape(exporter.serve().url)


def test_exposed_names_types_and_label_keys_are_pinned(port):
    families = {f.name: f for f in text_string_to_metric_families(_full_exposition(port))}
    exposed = {name: (f.type, tuple(sorted(set().union(*(s.labels for s in f.samples)) - {"le"})))
               for name, f in families.items() if name != "target_info"}
    assert exposed == {**GOLDEN, **PROCESS_GOLDEN}


def test_contract_table_agrees_with_golden():
    assert {spec.prometheus_name: spec.kind for spec in CONTRACT} == \
        {name: kind for name, (kind, _) in GOLDEN.items()}
    assert PROCESS_SERIES == {name: kind for name, (kind, _) in PROCESS_GOLDEN.items()}


def test_target_info_joins_on_job_name_and_rank_like_every_series(port):
    body = samples(_full_exposition(port, resource_attributes={"rank": "7", "team": "nlp"}))
    info = value(body, "target_info", job_name="golden", rank="3")  # rank: not overridable
    assert info == 1.0
    assert value(body, "target_info", mfotel_rank="3", service_name="golden", team="nlp") == 1.0


def test_process_series_describe_the_training_process(port):
    import psutil
    body = samples(_full_exposition(port))
    me = psutil.Process()
    labels = {"job_name": "golden", "rank": "3"}
    rss = value(body, "process_resident_memory_bytes", **labels)
    assert 0.5 * me.memory_info().rss < rss < 2 * me.memory_info().rss
    assert abs(value(body, "process_start_time_seconds", **labels) - me.create_time()) < 1.5
    assert 0 < value(body, "process_cpu_seconds_total", **labels) <= sum(me.cpu_times()[:2]) + 1
    assert value(body, "process_open_fds", **labels) >= 3
    assert value(body, "process_max_fds", **labels) > 0


def test_cardinality_health_serves_no_process_series(port):
    body = samples(_full_exposition(port, cardinality="health", metric_ranks=[3]))
    assert not [name for name, _ in body if name.startswith("process_")]
    assert value(body, "mindformers_train_loss", job_name="golden", rank="3") == 0.5


def test_histogram_buckets_are_seconds_and_scope_labels_are_off(port):
    body = _full_exposition(port)
    assert ('mindformers_train_step_duration_seconds_bucket'
            '{job_name="golden",le="0.25",rank="3"} 1.0') in body
    assert "otel_scope_name" not in body
    assert 'target_info{' in body and 'mfotel_rank="3"' in body and 'service_name="golden"' in body


# ---------------------------------------------------------------- OTLP -> Prometheus names
def _exposed(spec: MetricSpec) -> str:
    return spec.sample_name if spec.kind == "counter" else spec.prometheus_name


def test_otlp_push_translates_to_the_contract_names():
    """What a collector (prometheus / prometheusremotewrite exporter, default translation
    strategy UnderscoreEscapingWithSuffixes) or Prometheus' OTLP receiver names our metrics."""
    with OtlpReceiver() as receiver:
        cfg = parse_config({"metrics": list(SEED_METRICS), "seq_length": 16,
                            "prometheus": {"port": 0},
                            "otlp": {"endpoint": receiver.url, "interval_seconds": 60}})
        with rank_exporter(cfg, IDENTITY, "golden", serve=False) as exporter:
            _record_everything(exporter.instruments)
        # the final push, sent before shutdown returns
        assert receiver.wait(lambda r: r.requests, settle())
    kinds = {"gauge": "gauge", "histogram": "histogram"}
    translated = {}
    for point in points(receiver.requests[-1]):
        kind = kinds.get(point.kind) or ("counter" if point.monotonic else "updowncounter")
        translated[point.name] = prometheus_name(point.name, point.unit, kind)
    assert translated == {spec.otel_name: _exposed(spec) for spec in CONTRACT}


def test_no_contract_unit_makes_a_translation_add_a_suffix_the_contract_lacks():
    for spec in CONTRACT:
        assert prometheus_name(spec.otel_name, spec.unit, spec.kind) == _exposed(spec), spec.key
    ratios = [spec.key for spec in CONTRACT if spec.unit == "1"]
    assert ratios == ["mfu", "progress"]  # `1` only for a true 0..1 ratio


@pytest.mark.parametrize("name, unit, kind, suffixes, expected", [
    # documented behaviour of the OTLP -> Prometheus translation, one rule per row
    ("simple_metric", "", "gauge", False, "simple_metric"),
    ("metric@with#special$chars", "", "gauge", False, "metric_with_special_chars"),
    ("123metric", "", "gauge", False, "_123metric"),
    ("http.server.request.duration", "s", "histogram", False, "http_server_request_duration"),
    ("requests", "", "counter", True, "requests_total"),
    ("requests_total", "", "counter", True, "requests_total"),
    ("cpu_usage", "1", "gauge", True, "cpu_usage_ratio"),
    ("cpu_usage_ratio", "1", "gauge", True, "cpu_usage_ratio"),
    ("items", "1", "counter", True, "items_total"),
    ("active_connections", "", "updowncounter", True, "active_connections"),
    ("http.server.request.duration", "s", "histogram", True,
     "http_server_request_duration_seconds"),
    ("response_time_seconds", "s", "gauge", True, "response_time_seconds"),
    ("memory_usage", "By", "gauge", True, "memory_usage_bytes"),
    ("requests", "1/s", "gauge", True, "requests_per_second"),
    ("throughput", "By/s", "gauge", True, "throughput_bytes_per_second"),
    ("custom_metric", "custom_unit", "gauge", True, "custom_metric_custom_unit"),
    ("custom_metric", "{custom}", "gauge", True, "custom_metric"),
    ("custom_metric", "By/{custom}", "gauge", True, "custom_metric_bytes"),
    ("samples", "{sample}/s", "gauge", True, "samples_per_second"),
    ("metric__with__multiple__underscores", "unit__multiple__underscores", "gauge", True,
     "metric_with_multiple_underscores_unit_multiple_underscores"),
    ("custom_metric", "unit@with#special/chars", "gauge", True,
     "custom_metric_unit_with_special_per_chars"),
    ("uptime", "d", "gauge", True, "uptime_days"),
    ("temperature", "Cel", "gauge", True, "temperature_celsius"),
    ("cpu_seconds_total", "s", "counter", True, "cpu_seconds_total"),
    ("123_requests", "", "counter", True, "_123_requests_total"),
])
def test_translation_port_follows_the_documented_rules(name, unit, kind, suffixes, expected):
    assert prometheus_name(name, unit, kind, suffixes) == expected
