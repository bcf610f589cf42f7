"""OTelMonitor's multi-rank behaviour on real CPU trainings: port collisions, resume, run
identity and cardinality levels, read back through the real /metrics endpoint."""
from __future__ import annotations

import re

import pytest

from mfotel.config import ConfigError, parse_config
from mfotel.contract import PROCESS_SERIES
from mfotel.demo.training import SyntheticRegression, build_model, run_demo
from mfotel.identity import RankIdentity
from tests.support.metrics import samples, scrape, step_scraper, value
from tests.support.paths import ROOT
from tests.support.ranks import rank_exporter

pytestmark = pytest.mark.slow
ALL_METRICS = ["loss", "learning_rate", "grad_norm", "throughput", "step_time"]
DOC = ROOT / "docs" / "multirank.md"


def test_second_rank_on_a_taken_port_fails_before_training(port, in_tmp, monkeypatch):
    cfg = parse_config({"prometheus": {"host": "127.0.0.1", "port": port}})
    rank0 = rank_exporter(cfg, RankIdentity(rank=0, world_size=2), "mfotel-demo")
    # rank 1 launched without a local rank: DEVICE_ID 0 makes it local rank 0 too
    monkeypatch.setenv("RANK_ID", "1")
    monkeypatch.setenv("RANK_SIZE", "2")
    monkeypatch.setenv("DEVICE_ID", "0")
    try:
        with pytest.raises(ConfigError, match=f"rank 1 \\(local rank 0\\) and rank 0 \\(local rank "
                                              f"0\\) of job mfotel-demo both want port {port}"):
            run_demo(steps=3, port=port)
        body = samples(scrape(f"http://127.0.0.1:{port}/metrics"))
        assert value(body, "mindformers_train_rank_info")  # rank 0 still serves
    finally:
        rank0.shutdown()


def test_local_rank_beyond_the_node_fails_before_training(port, in_tmp, monkeypatch):
    for name, val in {"RANK_ID": "5", "RANK_SIZE": "8", "LOCAL_RANK": "4",
                      "LOCAL_WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(name, val)
    with pytest.raises(ConfigError, match="LOCAL_RANK=4 is not below LOCAL_WORLD_SIZE=4"):
        run_demo(steps=3, port=port)
    with pytest.raises(OSError):
        scrape(f"http://127.0.0.1:{port + 4}/metrics")  # nothing was left serving


def test_resumed_run_continues_the_global_step(port, in_tmp):
    """Model.train(3, ds, initial_epoch=1) restarts cur_step_num at 1; the step must not."""
    import mindspore as ms
    import mindspore.dataset as ds

    from mfotel import OTelMonitor
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")  # before any kernel runs in this process, as run_demo does
    per_epoch, batch = 5, 8
    dataset = ds.GeneratorDataset(SyntheticRegression(per_epoch, batch), ["x", "y"],
                                  shuffle=False).batch(batch)
    monitor = OTelMonitor(metrics=ALL_METRICS, prometheus={"host": "127.0.0.1", "port": port,
                                                           "linger_seconds": 0})
    scraper = step_scraper(f"http://127.0.0.1:{port}/metrics", {1, 10})
    build_model(3 * per_epoch, batch, "constant").train(
        3, dataset, callbacks=[monitor, scraper], dataset_sink_mode=False, initial_epoch=1)
    first, last = scraper.bodies[1], scraper.bodies[10]
    assert value(first, "mindformers_train_step") == 6       # epoch 2, step 1 of 5
    assert value(first, "mindformers_train_steps_total") == 1  # steps of this process
    assert value(first, "mindformers_train_samples_total") == batch
    assert value(first, "mindformers_train_step_duration_seconds_count") == 1
    assert value(first, "mindformers_train_progress_ratio") == pytest.approx(6 / 15)
    assert value(last, "mindformers_train_step") == 15
    assert value(last, "mindformers_train_steps_total") == 10
    assert value(last, "mindformers_train_progress_ratio") == 1
    assert monitor.instruments.state.status == 2  # completed, not "stopped early"


def test_an_integration_given_resume_step_continues_the_count(port, in_tmp):
    from mindspore.train import Callback

    from mfotel.callback import OTelMonitor

    class SetResume(Callback):  # what an integration does once it knows the resumed step
        def on_train_begin(self, run_context):
            for callback in run_context.original_args().list_callback:
                if isinstance(callback, OTelMonitor):
                    callback.resume_step = 37
    scraper = step_scraper(f"http://127.0.0.1:{port}/metrics", {1, 3})
    import mindspore as ms
    import mindspore.dataset as ds
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")  # before any kernel runs in this process, as run_demo does
    monitor = OTelMonitor(prometheus={"host": "127.0.0.1", "port": port, "linger_seconds": 0})
    dataset = ds.GeneratorDataset(SyntheticRegression(3, 8), ["x", "y"], shuffle=False).batch(8)
    build_model(3, 8, "constant").train(1, dataset, callbacks=[SetResume(), monitor, scraper],
                                        dataset_sink_mode=False)
    assert value(scraper.bodies[1], "mindformers_train_step") == 38
    assert value(scraper.bodies[3], "mindformers_train_step") == 40
    assert value(scraper.bodies[3], "mindformers_train_steps_total") == 3


def test_run_identity_survives_a_restart(port, in_tmp):
    state = {"state_file": str(in_tmp / "run_{job_name}_{rank}.json")}
    first = run_demo(steps=8, port=port, nan_at_step=3, on_nonfinite="stop", run=state)
    assert first.monitor.instruments.state.status == 3  # stopped early: the run is unfinished
    scraper = step_scraper(f"http://127.0.0.1:{port}/metrics", {2})
    second = run_demo(steps=4, port=port, run=state, extra_callbacks=(scraper,))
    run_id = first.monitor.run.run_id
    assert second.monitor.run.run_id == run_id and second.monitor.run.attempt == 2
    body = scraper.bodies[2]
    assert value(body, "mindformers_train_rank_info", run_id=run_id, attempt="2") == 1
    assert value(body, "target_info", mfotel_run_id=run_id, mfotel_attempt="2") == 1
    third = run_demo(steps=2, port=port, run=state)  # after the completed second attempt
    assert third.monitor.run.run_id != run_id and third.monitor.run.attempt == 1


def _series_per_rank(port: int, rank: int, monkeypatch, **config) -> dict[str, int]:
    monkeypatch.setenv("RANK_ID", str(rank))
    monkeypatch.setenv("RANK_SIZE", "2")
    scraper = step_scraper(f"http://127.0.0.1:{port}/metrics", {3})
    run_demo(steps=3, port=port, seq_length=16, metrics=ALL_METRICS, linger_seconds=0,
             output={"console": False}, extra_callbacks=(scraper,), **config)
    counts: dict[str, int] = {}
    for name, _ in scraper.bodies[3]:
        counts[name] = counts.get(name, 0) + 1
    return counts


def _documented_counts() -> dict[str, int]:
    """The series-per-rank table of docs/multirank.md (`| level | ... | N |` rows)."""
    rows = re.findall(r"^\| `(full|health)`[^|]*\| ([^|]+) \| (\d+) \|", DOC.read_text(), re.M)
    return {f"{level} {who.strip()}": int(n) for level, who, n in rows}


def test_cardinality_levels_series_per_rank_match_the_docs(port, in_tmp, monkeypatch):
    full = _series_per_rank(port, 0, monkeypatch)
    metric_rank = _series_per_rank(port, 0, monkeypatch, cardinality="health")
    other_rank = _series_per_rank(port, 1, monkeypatch, cardinality="health")
    assert full["mindformers_train_step_duration_seconds_bucket"] == 16
    assert metric_rank["mindformers_train_step_duration_seconds_bucket"] == 1  # +Inf only
    assert "mindformers_train_loss" in metric_rank and "mindformers_train_loss" not in other_rank
    process = {name + ("_total" if kind == "counter" else "")
               for name, kind in PROCESS_SERIES.items()}
    assert set(full) - set(other_rank) == {
        "mindformers_train_loss", "mindformers_train_learning_rate", "mindformers_train_grad_norm",
        "mindformers_train_throughput_samples_per_second",
        "mindformers_train_device_throughput_tokens_per_second", *process}  # health: no process_*
    assert _documented_counts() == {"full every rank": sum(full.values()),
                                    "health metric ranks": sum(metric_rank.values()),
                                    "health other ranks": sum(other_rank.values())}
