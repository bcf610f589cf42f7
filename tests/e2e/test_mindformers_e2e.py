"""The real mindformers Trainer on CPU, launched through `mfotel-instrument`, scraped while it runs.

Tiny Llama (examples/mindformers), 20 steps in graph mode, the issue's callback entry. What
/metrics shows must equal what MFLossMonitor and TrainingStateMonitor logged for the same steps,
and the log tools read its output directory: mfotel's monitor file beside mindformers' info.log.
"""
from __future__ import annotations

import re

import pytest

from mfotel.logs.cli import main as logs_main
from mfotel.logs.parse import discover
from tests.support.cli import table_rows
from tests.support.metrics import value
from tests.support.tiny_llama import JOB, STEPS, issue_yaml, train

WQ0 = "model.layers.0.attention.wq.weight"

LOSS_LINE = re.compile(
    r"step:\[\s*(?P<step>\d+)/\s*\d+\], loss:\[(?P<loss>[-\d.]+)/[-\d.]+\], "
    r"per_step_time: \d+ms, lr: (?P<lr>[-\d.e]+), overflow cond: (?P<overflow>\w+), "
    r"loss_scale: (?P<scale>[-\d.e]+), global_norm: \[(?P<norm>[-\d.e]+)\]")
NATIVE_LINE = re.compile(r"_to_log: Epoch:\[\s*\d+/\s*\d+\], step:\[\s*(?P<step>\d+)/\s*\d+\] "
                         r"(?P<tag>\S+): (?P<value>\S+)$")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Train once; scrape /metrics every 50 ms until the run reports completed."""
    from mfotel.localstack.servers import free_port
    tmp_path = tmp_path_factory.mktemp("mindformers-e2e")
    port = free_port()
    trained = train(tmp_path, issue_yaml(tmp_path, port), port)
    print(f"\nmindformers e2e: {STEPS} steps, {trained.seconds:.1f} s to completed, "
          f"{len(trained.snapshots)} scrapes")
    return tmp_path, trained.snapshots, trained.info_log, trained.console


def logged(info_log: str) -> tuple[dict[int, dict], dict[int, dict[str, float]]]:
    loss_lines = {int(m["step"]): m.groupdict()
                  for m in map(LOSS_LINE.search, info_log.splitlines()) if m}
    native: dict[int, dict[str, float]] = {}
    for m in map(NATIVE_LINE.search, info_log.splitlines()):
        if m:
            native.setdefault(int(m["step"]), {})[m["tag"]] = float(m["value"])
    return loss_lines, native


def test_the_run_trains_every_step_and_is_scraped_while_running(run):
    _, snapshots, info_log, console = run
    loss_lines, _ = logged(info_log)
    assert sorted(loss_lines) == list(range(1, STEPS + 1)), console[-3000:]
    running = [s for s in snapshots if value(s, "mindformers_train_status") == 1]
    assert running, "no scrape saw the run in progress"
    final = snapshots[-1]
    assert value(final, "mindformers_train_status") == 2
    assert value(final, "mindformers_train_step", job_name=JOB, rank="0") == STEPS
    assert value(final, "mindformers_train_steps_total") == STEPS


def test_seed_metrics_equal_what_mfloss_monitor_logged(run):
    _, snapshots, info_log, _ = run
    loss_lines, _ = logged(info_log)
    final, last = snapshots[-1], loss_lines[STEPS]
    assert value(final, "mindformers_train_loss") == pytest.approx(float(last["loss"]), abs=1e-6)
    assert value(final, "mindformers_train_learning_rate") == pytest.approx(float(last["lr"]),
                                                                             rel=1e-6)
    assert value(final, "mindformers_train_grad_norm") == pytest.approx(float(last["norm"]),
                                                                         rel=1e-6)
    assert value(final, "mindformers_train_loss_scale") == float(last["scale"])
    assert value(final, "mindformers_train_overflow_total") == sum(
        line["overflow"] == "True" for line in loss_lines.values())


def test_scrapes_during_the_run_hold_the_last_recorded_step(run):
    _, snapshots, info_log, _ = run
    loss_lines, _ = logged(info_log)
    for body in snapshots:
        step, loss = value(body, "mindformers_train_step"), value(body, "mindformers_train_loss")
        if step is None or loss is None:
            continue
        recorded = [r for r in range(10, STEPS + 1, 10) if r <= step]
        assert any(loss == pytest.approx(float(loss_lines[r]["loss"]), abs=1e-6)
                   for r in recorded), (step, loss)


def test_native_metrics_are_exposed_with_their_labels(run):
    _, snapshots, info_log, _ = run
    _, native = logged(info_log)
    final, at_end = snapshots[-1], native[STEPS]
    assert value(final, "mindformers_train_weight_norm", job_name=JOB, rank="0") == \
        pytest.approx(at_end["weight_norm"], rel=1e-9)
    for state in ("adam_m", "adam_v"):
        assert value(final, "mindformers_train_optimizer_state_norm", param=WQ0, state=state) == \
            pytest.approx(at_end[f"{state}_norm/{WQ0}"], rel=1e-9)
    assert value(final, "mindformers_train_throughput_linearity") == \
        pytest.approx(at_end["throughput_linearity"], rel=1e-9)
    assert value(final, "mindformers_train_device_local_loss", loss="lm") == \
        pytest.approx(at_end["device_accum_local_lm_loss"], rel=1e-6)
    assert value(final, "mindformers_train_weight_stable_rank", param=WQ0) == \
        pytest.approx(native[STEPS][f"weight_stable_rank/{WQ0}"], rel=1e-6)
    assert value(final, "mindformers_train_local_norm", param=WQ0) > 0
    assert value(final, "mindformers_train_iteration_time_seconds") > 0


def test_native_target_filter_is_honoured(run):
    _, snapshots, _, _ = run
    final = snapshots[-1]
    for name in ("mindformers_train_optimizer_state_norm", "mindformers_train_local_norm",
                 "mindformers_train_weight_stable_rank"):
        params = {dict(labels)["param"] for (n, labels) in final if n == name}
        assert params, name
        assert all(p.startswith("model.layers.0.") or p == "model.norm_out.weight"
                   for p in params), (name, params)
    stable = {dict(labels)["param"] for (n, labels) in final
              if n == "mindformers_train_weight_stable_rank"}
    assert stable == {WQ0}  # stable_rank_config.target, which mindformers skips in stand-alone runs


def test_monitor_file_has_the_record_steps(run):
    tmp_path, _, _, _ = run
    lines = (tmp_path / "monitor_logs" / "train_monitor_0.log").read_text().splitlines()
    assert [line.split(",")[0] for line in lines] == ["[Monitor] step: 10", "[Monitor] step: 20"]


# ---------------------------------------------------------------- the log tools on its output
def test_mindformers_output_dir_reads_info_log_and_monitor_file_side_by_side(run):
    """The run's directory holds mfotel's monitor file and mindformers' info.log: the log
    tools find both by content and summarise each as its own source."""
    workdir = run[0]
    info = workdir / "output" / "log" / "rank_0" / "info.log"
    monitor = workdir / "monitor_logs" / "train_monitor_0.log"
    # independent readers of the two files
    mf_throughput = [float(m) for m in re.findall(r"([\d.]+) samples/s/p", info.read_text())]
    mf_steps = re.findall(r"step:\[\s*(\d+)/\s*\d+\], loss", info.read_text())
    monitor_lines = monitor.read_text().splitlines()
    mfotel_throughput = [float(re.search(r"throughput: ([-+.\deE]+)", line).group(1))
                         for line in monitor_lines]
    assert len(mf_steps) == len(mf_throughput) == STEPS and len(monitor_lines) == 2

    found = discover(workdir)
    assert found.kinds[monitor] == "monitor" and found.kinds[info] == "mindformers-info"
    out = workdir / "summary.md"
    assert logs_main(["summary", str(workdir), "-o", str(out), "-q"]) == 0
    text = out.read_text()
    rows = {row[1]: row for row in table_rows(text)}
    assert set(rows) == {"mfotel-text", "mindformers-info"}
    assert rows["mfotel-text"][2:4] == ["2", "10..20"]
    assert rows["mindformers-info"][2:4] == ["20", "1..20"]
    assert float(rows["mfotel-text"][-1]) == pytest.approx(mean(mfotel_throughput), rel=1e-5)
    assert float(rows["mindformers-info"][-1]) == pytest.approx(mean(mf_throughput), rel=1e-5)
    assert "per device (`samples/s/p`)" in text and "over the record interval" in text


def test_mindformers_output_dir_plots_both_sources(run):
    from mfotel.logs import plot
    from mfotel.logs.parse import discover_runs, iter_rows
    workdir = run[0]
    figure = plot.build_figure(plot.collect(iter_rows(discover_runs([workdir]))))
    name = workdir.name
    labels = {t.get_text() for t in figure.legends[0].get_texts()}
    assert labels == {f"{name} (mfotel-text)", f"{name} (mindformers-info)"}
    loss = [ax for ax in figure.axes if ax.get_title() == "loss"][0]
    points = {line.get_gid(): len(line.get_xdata()) for line in loss.lines
              if (line.get_gid() or "").endswith("/raw")}
    assert points == {f"{name}/0/mfotel-text/loss/raw": 2,
                      f"{name}/0/mindformers-info/loss/raw": 20}
    out = plot.save(figure, workdir / "curves.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def mean(values: list[float]) -> float:
    return sum(values) / len(values)
