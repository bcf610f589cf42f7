"""Golden: the exposed Prometheus names, types and label keys of the metric contract.

The table below is written out by hand on purpose: a change to a name, a unit suffix or a label
key must be a deliberate edit here (and in the README, dashboards and rules).
"""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from conftest import scrape
from mfotel.config import parse_config
from mfotel.contract import CONTRACT, SEED_METRICS
from mfotel.identity import RankIdentity
from mfotel.instruments import Instruments
from mfotel.telemetry import Telemetry

JR = ("job_name", "rank")
GOLDEN = {
    "mindformers_train_loss": ("gauge", JR),
    "mindformers_train_learning_rate": ("gauge", JR),
    "mindformers_train_grad_norm": ("gauge", JR),
    "mindformers_train_throughput_samples_per_second": ("gauge", JR),
    "mindformers_train_samples": ("counter", JR),
    "mindformers_train_tokens": ("counter", JR),
    "mindformers_train_step_duration_seconds": ("histogram", JR),
    "mindformers_train_step": ("gauge", JR),
    "mindformers_train_steps": ("counter", JR),
    "mindformers_train_last_step_timestamp_seconds": ("gauge", JR),
    "mindformers_train_loss_finite": ("gauge", JR),
    "mindformers_train_nonfinite": ("counter", ("job_name", "metric", "rank")),
    "mindformers_train_overflow": ("counter", JR),
    "mindformers_train_loss_scale": ("gauge", JR),
    "mindformers_train_epoch": ("gauge", JR),
    "mindformers_train_progress_ratio": ("gauge", JR),
    "mindformers_train_status": ("gauge", JR),
    "mindformers_train_first_nonfinite_step": ("gauge", JR),
    "mindformers_train_rank_info": ("gauge", ("device_id", "host", "job_name", "local_rank",
                                              "node", "rank", "world_size")),
    "mindformers_train_actions": ("counter", ("action", "job_name", "rank", "source")),
    "mfotel_export_errors": ("counter", ("job_name", "rank", "stage")),
}


def _full_exposition(port: int) -> str:
    cfg = parse_config({"metrics": list(SEED_METRICS), "seq_length": 16,
                        "prometheus": {"host": "127.0.0.1", "port": port}})
    identity = RankIdentity(rank=3, local_rank=0, world_size=4, node="n1", device_id="0")
    telemetry = Telemetry(cfg, identity, "golden")
    meter = telemetry.start()
    telemetry.serve()
    try:
        inst = Instruments(meter, {"job_name": "golden", "rank": "3"}, cfg.metrics, identity.labels())
        st = inst.state
        for key in ("loss", "learning_rate", "grad_norm", "throughput", "loss_scale", "progress"):
            setattr(st, key, 0.5)
        st.samples, st.tokens, st.step, st.steps, st.overflow, st.epoch = 8, 128, 1, 1, 0, 1
        st.last_step_timestamp, st.loss_finite, st.status, st.first_nonfinite_step = 1.0, 1, 1, 1
        st.actions[("stop", "control")] = 1
        inst.record_step_seconds(0.2)
        return scrape(telemetry.endpoint.url)
    finally:
        telemetry.shutdown()


def test_exposed_names_types_and_label_keys_are_pinned(port):
    families = {f.name: f for f in text_string_to_metric_families(_full_exposition(port))}
    exposed = {name: (f.type, tuple(sorted(set().union(*(s.labels for s in f.samples)) - {"le"})))
               for name, f in families.items() if name != "target_info"}
    assert exposed == GOLDEN


def test_contract_table_agrees_with_golden():
    assert {spec.prometheus_name: spec.kind for spec in CONTRACT} == \
        {name: kind for name, (kind, _) in GOLDEN.items()}


def test_histogram_buckets_are_seconds_and_scope_labels_are_off(port):
    body = _full_exposition(port)
    assert 'mindformers_train_step_duration_seconds_bucket{job_name="golden",le="0.25",rank="3"} 1.0' in body
    assert "otel_scope_name" not in body
    assert 'target_info{' in body and 'mfotel_rank="3"' in body and 'service_name="golden"' in body
