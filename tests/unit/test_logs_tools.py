"""plot, export, summary and backfill (OpenMetrics text) over real captured monitor logs."""
from __future__ import annotations

import csv
import io
import json
import math
import shutil
from pathlib import Path

import pytest

from mfotel import contract
from mfotel.logs.backfill import BackfillError, write_openmetrics
from mfotel.logs.cli import main as logs_main
from mfotel.logs.export import COLUMNS, write_csv
from mfotel.logs.parse import ParseReport, discover_runs, iter_rows, parse_lines
from mfotel.logs.summary import summarize
from tests.support.paths import FIXTURES

LOGS = FIXTURES / "logs"
DEMO_TEXT = LOGS / "demo-text"
DEMO_JSON = LOGS / "demo-json"
TWO_RANKS = LOGS / "two-ranks"
MF_INFO = FIXTURES / "mindformers" / "info.log"
METRICS = ("loss", "learning_rate", "grad_norm", "throughput", "step_time")


# Independent readers of the two mfotel formats: the expectations do not come from mfotel.logs.
def read_text_log(path: Path) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for line in path.read_text().splitlines():
        fields = dict(part.split(": ") for part in line.removeprefix("[Monitor] ").split(", "))
        out[int(fields.pop("step"))] = {k: float(v) for k, v in fields.items()}
    return out


def read_json_log(path: Path) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        out[record["step"]] = {k: float(record[k]) for k in METRICS if k in record}
    return out


EXPECTED = {"demo-text": read_text_log(DEMO_TEXT / "train_monitor.log"),
            "demo-json": read_json_log(DEMO_JSON / "train_monitor.jsonl")}


def lines_by_gid(figure) -> dict[str, object]:
    return {line.get_gid(): line for ax in figure.axes for line in ax.lines if line.get_gid()}


# --- plot ------------------------------------------------------------------------------------

def test_plot_of_two_runs_draws_exactly_the_logged_values(tmp_path: Path) -> None:
    from mfotel.logs import plot
    series = plot.collect(iter_rows(discover_runs([DEMO_TEXT, DEMO_JSON])))
    figure = plot.build_figure(series)
    out = plot.save(figure, tmp_path / "curves.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 30_000
    drawn = lines_by_gid(figure)
    for run, logged in EXPECTED.items():
        for metric in ("loss", "learning_rate", "grad_norm", "throughput"):
            finite = [(s, v[metric]) for s, v in sorted(logged.items()) if math.isfinite(v[metric])]
            line = drawn[f"{run}/0/mfotel-{run[5:]}/{metric}/raw"]
            assert list(line.get_xdata()) == [s for s, _ in finite]
            assert list(line.get_ydata()) == [v for _, v in finite]
            bad = [s for s, v in sorted(logged.items()) if not math.isfinite(v[metric])]
            marker = drawn.get(f"{run}/0/mfotel-{run[5:]}/{metric}/nonfinite")
            assert (list(marker.get_xdata()) if marker else []) == bad
    legend = figure.legends[0]
    assert {t.get_text() for t in legend.get_texts()} == {"demo-text", "demo-json", "NaN/Inf"}
    # the first non-finite loss step of each run is marked across all five panels
    first_bad = {run: min(s for s, v in logged.items() if math.isnan(v["loss"]))
                 for run, logged in EXPECTED.items()}
    for ax in figure.axes:
        vlines = {line.get_xdata()[0] for line in ax.lines if line.get_linestyle() == ":"}
        assert vlines == set(first_bad.values())


def test_plot_cli_writes_svg_by_extension_with_smoothing_and_log_scale(tmp_path: Path) -> None:
    out = tmp_path / "curves.svg"
    assert logs_main(["plot", str(DEMO_TEXT), str(TWO_RANKS), str(MF_INFO), "-o", str(out),
                      "--smooth", "0.8", "--log-scale", "-q"]) == 0
    text = out.read_text()
    assert text.lstrip().startswith("<?xml") and "<svg" in text and len(text) > 30_000


def test_values_beyond_a_log_axis_keep_their_panel_linear(tmp_path: Path) -> None:
    """A loss of 3e281 (found by tests/unit/test_logs_fuzz.py) spans more decades than a log
    axis can label: the panel stays linear and the plot is written."""
    from mfotel.logs import plot
    run = tmp_path / "run"
    run.mkdir()
    (run / "m.log").write_text(
        '{"time": 1.0, "job_name": "job", "rank": 0, "step": 1, "loss": 3.1e281}\n'
        '{"time": 2.0, "job_name": "job", "rank": 0, "step": 2, "loss": 2.5}\n')
    figure = plot.build_figure(plot.collect(iter_rows(discover_runs([run]))), log_scale=True)
    assert {ax.get_yscale() for ax in figure.axes if ax.get_title() == "loss"} == {"linear"}
    assert logs_main(["plot", str(run), "-o", str(tmp_path / "c.png"), "-q"]) == 0


def test_ema_skips_nonfinite_values() -> None:
    from mfotel.logs.plot import ema
    smoothed = ema([1.0, 3.0, math.nan, 5.0], 0.5)
    assert smoothed[:2] == [1.0, 2.0] and math.isnan(smoothed[2]) and smoothed[3] == 3.5


def test_plot_of_nothing_is_an_error(tmp_path: Path, capsys) -> None:
    empty = tmp_path / "train_monitor.log"
    empty.write_text("no monitor lines here\n")
    assert logs_main(["plot", str(empty), "-o", str(tmp_path / "x.png"), "-q"]) == 1
    assert "no training steps" in capsys.readouterr().err


# --- export ----------------------------------------------------------------------------------

def test_csv_holds_one_tidy_line_per_step_with_exact_values(tmp_path: Path) -> None:
    out = tmp_path / "out.csv"
    assert logs_main(["export", str(DEMO_TEXT), str(DEMO_JSON), "--csv", str(out), "-q"]) == 0
    with open(out, newline="") as handle:
        records = list(csv.DictReader(handle))
    assert tuple(records[0]) == COLUMNS
    assert [(r["run"], int(r["step"])) for r in records] == (
        [("demo-text", s) for s in range(1, 31)] + [("demo-json", s) for s in range(1, 31)])
    for record in records:
        logged = EXPECTED[record["run"]][int(record["step"])]
        for metric in METRICS:
            got, want = float(record[metric]), logged[metric]
            assert got == want or (math.isnan(got) and math.isnan(want))
        assert record["rank"] == "0" and record["loss_scale"] == ""
    assert records[0]["time"] == "" and float(records[30]["time"]) == 1796208010.035
    assert records[21]["loss"] == "nan"


def test_csv_of_mindformers_log_carries_epoch_time_and_loss_scale() -> None:
    buffer = io.StringIO()
    assert write_csv(iter_rows(discover_runs([MF_INFO])), buffer) == 20
    records = list(csv.DictReader(io.StringIO(buffer.getvalue())))
    assert records[0]["epoch"] == "1" and records[0]["loss_scale"] == "1024.0"
    assert records[0]["time"] != "" and records[-1]["throughput"] == "63.33702"


# --- summary ---------------------------------------------------------------------------------

def test_summary_values_of_a_run_with_a_nan(tmp_path: Path) -> None:
    run = tmp_path / "exp-nan"
    shutil.copytree(DEMO_TEXT, run)
    (run / "train_config.yaml").write_text("monitor_config:\n  step_interval: 1\n")
    (summary,) = summarize(discover_runs([run]))
    assert summary.config == run / "train_config.yaml"
    assert list(summary.ranks) == [(0, "mfotel-text")]
    rank = summary.ranks[0, "mfotel-text"]
    logged = EXPECTED["demo-text"]
    finite = {s: v["loss"] for s, v in logged.items() if math.isfinite(v["loss"])}
    throughputs = [v["throughput"] for v in logged.values()]
    assert (rank.rows, rank.first_step, rank.last_step) == (30, 1, 30)
    assert rank.first_loss == logged[1]["loss"] and math.isnan(rank.last_loss)
    assert (rank.min_loss_step, rank.min_loss) == min(finite.items(), key=lambda kv: kv[1])
    assert rank.first_nonfinite_step == 22 and rank.before_step == 21
    assert rank.lr_before == logged[21]["learning_rate"]
    assert rank.grad_norm_before == logged[21]["grad_norm"]
    assert rank.mean_throughput == pytest.approx(sum(throughputs) / len(throughputs))


def test_summary_cli_prints_a_markdown_table_per_run(capsys) -> None:
    assert logs_main(["summary", str(DEMO_JSON), str(TWO_RANKS), "-q"]) == 0
    text = capsys.readouterr().out
    assert text.count("\n## ") + text.startswith("## ") == 2
    assert ("| 0 | mfotel-json | 30 | 1..30 | 18.2512 | nan | 1.71008 (9) | "
            "26 (loss=nan+grad_norm=nan) |") in text
    assert "| 1 | mfotel-text | 6 | 2..12 |" in text


def test_strict_turns_unparseable_lines_into_exit_1(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "train_monitor.log"
    bad.write_text((DEMO_TEXT / "train_monitor.log").read_text() + "[Monitor] step: 31, loss: n?\n")
    assert logs_main(["summary", str(bad), "-q"]) == 0
    assert f"{bad}:31: mfotel-text" in capsys.readouterr().err
    assert logs_main(["summary", str(bad), "-q", "--strict"]) == 1


# --- backfill: the OpenMetrics text (promtool and Prometheus in test_backfill_e2e.py) -----------

HISTOGRAM = contract.spec("step_duration").prometheus_name


def parse_openmetrics(text: str):
    """Families via prometheus_client's strict OpenMetrics parser, histogram left out: that
    parser drops bucket samples of a histogram's second and later timestamps (it treats them
    as duplicates); promtool reads them (test_backfill_e2e.py)."""
    from prometheus_client.openmetrics.parser import text_string_to_metric_families
    kept = "".join(line for line in text.splitlines(keepends=True) if HISTOGRAM not in line)
    return list(text_string_to_metric_families(kept))


def histogram_samples(text: str) -> list[tuple[str, dict[str, str], float, float]]:
    """(sample name, labels, value, timestamp) of the step-time histogram lines."""
    out = []
    for line in text.splitlines():
        if line.startswith(HISTOGRAM):
            head, value, stamp = line.rsplit(" ", 2)
            name, _, label_text = head.partition("{")
            labels = dict(item.split("=", 1) for item in label_text.rstrip("}").split(","))
            out.append((name, {k: v.strip('"') for k, v in labels.items()}, float(value),
                        float(stamp)))
    return out


def test_openmetrics_uses_the_live_names_and_labels(tmp_path: Path) -> None:
    stats = write_openmetrics(iter_rows(discover_runs([DEMO_JSON])), tmp_path / "b.om",
                              job_names={"demo-json": "past-run"})
    text = (tmp_path / "b.om").read_text()
    assert text.endswith("# EOF\n") and stats.rows == 30
    families = {f.name: f for f in parse_openmetrics(text)}     # strict OpenMetrics parser
    names = {s.prometheus_name for s in contract.CONTRACT}
    assert set(families) <= names
    for family in families.values():
        for sample in family.samples:
            assert sample.labels["job_name"] == "past-run" and sample.labels["rank"] == "0"
            assert set(sample.labels) - set(contract.COMMON_LABELS) <= {"metric", "le"}
    logged = EXPECTED["demo-json"]
    loss = families["mindformers_train_loss"].samples
    # as live: the loss as it is, NaN included (NaN != NaN: compare the texts)
    assert [repr(s.value) for s in loss] == [repr(v["loss"]) for _, v in sorted(logged.items())]
    assert sum(math.isnan(s.value) for s in loss) == 5
    assert "mindformers_train_loss{job_name=\"past-run\",rank=\"0\"} NaN " in text
    assert float(loss[0].timestamp) == 1796208010.035
    finite_flag = [s.value for s in families["mindformers_train_loss_finite"].samples]
    assert finite_flag == [0.0 if math.isnan(v["loss"]) else 1.0 for _, v in sorted(logged.items())]
    nonfinite = [s for s in families["mindformers_train_nonfinite"].samples
                 if s.labels["metric"] == "loss"]
    assert nonfinite[0].name == "mindformers_train_nonfinite_total"
    assert [s.value for s in nonfinite][-6:] == [0, 1, 2, 3, 4, 5]
    first = families["mindformers_train_first_nonfinite_step"].samples
    assert {s.value for s in first} == {26} and len(first) == 5
    histogram = histogram_samples(text)
    assert {labels["job_name"] for _, labels, _, _ in histogram} == {"past-run"}
    counts = [value for name, _, value, _ in histogram if name.endswith("_count")]
    assert counts == list(range(1, 31))
    sums = [value for name, _, value, _ in histogram if name.endswith("_sum")]
    assert sums[-1] == pytest.approx(sum(v["step_time"] for v in logged.values()))
    les = [labels["le"] for name, labels, _, _ in histogram if name.endswith("_bucket")][:16]
    assert les == [repr(b) for b in contract.STEP_TIME_BUCKETS] + ["+Inf"]
    assert "# TYPE mindformers_train_step_duration_seconds histogram" in text


def test_rows_without_time_need_a_start(tmp_path: Path) -> None:
    with pytest.raises(BackfillError, match="--start"):
        write_openmetrics(iter_rows(discover_runs([DEMO_TEXT])), tmp_path / "b.om")
    assert not list(tmp_path.glob(".backfill-*")), "temporary files left behind"
    write_openmetrics(iter_rows(discover_runs([DEMO_TEXT])), tmp_path / "b.om",
                      start=1_700_000_000.0, step_seconds=2.5)
    families = {f.name: f for f in parse_openmetrics((tmp_path / "b.om").read_text())}
    steps = families["mindformers_train_step"].samples
    assert [(s.value, float(s.timestamp)) for s in steps[:2]] == [(1.0, 1_700_000_002.5),
                                                           (2.0, 1_700_000_005.0)]


def test_backfill_cli_names_ranks_and_job(tmp_path: Path, capsys) -> None:
    assert logs_main(["backfill", str(TWO_RANKS), "--out", str(tmp_path), "--job-name", "old",
                      "--start", "2026-01-01T00:00:00Z", "-q"]) == 0
    families = {f.name: f for f in parse_openmetrics((tmp_path / "backfill.om").read_text())}
    labels = {(s.labels["job_name"], s.labels["rank"])
              for s in families["mindformers_train_loss"].samples}
    assert labels == {("old", "0"), ("old", "1")}
    assert "promtool tsdb create-blocks-from openmetrics" in capsys.readouterr().err
    assert logs_main(["backfill", str(TWO_RANKS), str(DEMO_JSON), "--out", str(tmp_path),
                      "--job-name", "only-one", "-q"]) == 1


def test_out_of_order_rows_are_skipped_not_sent_to_promtool(tmp_path: Path) -> None:
    log = tmp_path / "train_monitor.jsonl"
    log.write_text("".join(f'{{"time": {t}, "step": {s}, "loss": 1.0}}\n'
                           for s, t in enumerate((10.0, 10.0, 9.0, 11.0), 1)))
    stats = write_openmetrics(iter_rows(discover_runs([log])), tmp_path / "b.om")
    assert (stats.rows, stats.skipped_out_of_order) == (2, 2)


def test_parse_report_counts_files_lines_rows() -> None:
    report = ParseReport()
    rows = list(iter_rows(discover_runs([DEMO_TEXT, TWO_RANKS]), report=report))
    assert (report.files, report.lines, report.rows) == (3, 42, 42) and len(rows) == 42


def test_progress_callback_sees_every_byte_of_the_files() -> None:
    seen: list[int] = []
    runs = discover_runs([TWO_RANKS, MF_INFO])
    list(iter_rows(runs, progress=seen.append))
    assert sum(seen) == sum(run.total_bytes() for run in runs)


def test_progress_bar_only_on_a_tty_and_not_when_quiet(monkeypatch) -> None:
    from mfotel.logs import cli as logs_cli
    runs = discover_runs([DEMO_TEXT])

    class FakeTTY(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr("sys.stderr", io.StringIO())
    with logs_cli._progress(runs, quiet=False) as update:
        assert update is None
    monkeypatch.setattr("sys.stderr", FakeTTY())
    with logs_cli._progress(runs, quiet=True) as update:
        assert update is None
    import tqdm  # noqa: F401 - a dev dependency: its absence must fail, not skip
    with logs_cli._progress(runs, quiet=False) as update:
        assert callable(update)
        list(iter_rows(runs, progress=update))


# --- plot: the figure's properties, through matplotlib's objects -----------------------------

def figure_of(*runs, **options):
    from mfotel.logs import plot
    return plot.build_figure(plot.collect(iter_rows(discover_runs(list(runs)))), **options)


def panel(figure, title: str):
    (ax,) = [ax for ax in figure.axes if ax.get_title() == title]
    return ax


def series_lines(ax) -> list:
    return [line for line in ax.lines if (line.get_gid() or "").endswith("/raw")]


PANEL_TITLES = ["loss", "learning rate", "grad norm", "throughput (samples/s)", "step time (s)"]


def test_loss_and_step_time_axes_are_logarithmic_when_they_span_a_decade() -> None:
    spans = figure_of(DEMO_TEXT)     # loss 34.8 .. 1.73; step time 0.93 (compiling) .. 0.0013
    assert [ax.get_title() for ax in spans.axes] == PANEL_TITLES
    assert [ax.get_yscale() for ax in spans.axes] == ["log", "linear", "linear", "linear", "log"]
    log_labels = [t.get_text() for t in panel(spans, "loss").get_yticklabels()]
    assert "10" in log_labels and not any("times" in t or "^" in t for t in log_labels)
    narrow = figure_of(MF_INFO)                  # 5.55 .. 4.54
    assert panel(narrow, "loss").get_yscale() == "linear"
    assert panel(figure_of(DEMO_TEXT, auto_log=False), "loss").get_yscale() == "linear"


def test_log_scale_makes_every_panel_logarithmic_throughput_too() -> None:
    figure = figure_of(DEMO_TEXT, MF_INFO, log_scale=True)
    assert [ax.get_yscale() for ax in figure.axes] == ["log"] * 5


def test_step_time_panel_draws_the_logged_step_times() -> None:
    ax = panel(figure_of(DEMO_TEXT), "step time (s)")
    (line,) = series_lines(ax)
    logged = EXPECTED["demo-text"]
    assert list(line.get_xdata()) == sorted(logged)
    assert list(line.get_ydata()) == [logged[s]["step_time"] for s in sorted(logged)]
    assert ax.get_xlabel() == "step"


def test_equal_curves_get_distinct_styles_so_both_stay_visible() -> None:
    figure = figure_of(DEMO_TEXT, DEMO_TEXT, DEMO_TEXT)
    for ax in figure.axes:
        lines = series_lines(ax)
        assert len(lines) == 3
        assert len({tuple(line.get_ydata()) for line in lines}) == 1      # the same data
        styles = {(line.get_color(), line.get_linestyle(), line.get_linewidth())
                  for line in lines}
        assert len(styles) == 3
        widths = [line.get_linewidth() for line in lines]
        assert widths == sorted(widths, reverse=True)      # later ones thinner, on top


def test_sparse_series_get_markers_and_dense_ones_do_not(tmp_path: Path) -> None:
    dense = tmp_path / "dense" / "train_monitor.log"
    dense.parent.mkdir()
    dense.write_text("".join(f"[Monitor] step: {s}, loss: {10 / s}\n" for s in range(1, 201)))
    figure = figure_of(TWO_RANKS, dense)             # 6 logged steps per rank vs 200
    markers = {line.get_gid().split("/")[0] + "/" + line.get_gid().split("/")[1]:
               line.get_marker() for line in series_lines(panel(figure, "loss"))}
    assert markers["two-ranks/0"] not in ("None", "", None)
    assert markers["two-ranks/1"] not in ("None", "", None)
    assert markers["two-ranks/0"] != markers["two-ranks/1"]
    assert markers["dense/0"] in ("None", "")


def test_step_ticks_are_whole_steps(tmp_path: Path) -> None:
    log = tmp_path / "short" / "train_monitor.log"
    log.parent.mkdir()
    log.write_text("[Monitor] step: 1, loss: 3.0\n[Monitor] step: 2, loss: 2.0\n"
                   "[Monitor] step: 3, loss: 1.5\n")
    figure = figure_of(log)
    figure.canvas.draw()
    for ax in figure.axes:
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks


def test_labels_name_rank_and_source_only_when_a_run_has_several(tmp_path: Path) -> None:
    run = tmp_path / "exp"
    (run / "output/log/rank_0").mkdir(parents=True)
    (run / "output/log/rank_0/info.log").write_bytes(MF_INFO.read_bytes())
    (run / "monitor_logs").mkdir()
    (run / "monitor_logs/train_monitor_0.log").write_text(
        "[Monitor] step: 10, loss: 5.0\n[Monitor] step: 20, loss: 4.6\n")
    figure = figure_of(run, TWO_RANKS)
    labels = {text.get_text() for text in figure.legends[0].get_texts()}
    assert labels == {"exp (mfotel-text)", "exp (mindformers-info)", "two-ranks rank 0",
                      "two-ranks rank 1"}


# --- clear errors for bad outputs and times ---------------------------------------------------

def test_plot_to_an_unknown_format_is_an_error_before_any_parsing(tmp_path: Path, capsys) -> None:
    out = tmp_path / "x.exe"
    assert logs_main(["plot", str(tmp_path / "no-such-run"), "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert "cannot write '.exe' images" in err and ".png" in err and ".svg" in err
    assert "Traceback" not in err and not out.exists()


@pytest.mark.parametrize("command", [
    ["plot", "-o", "{blocker}/curves.png"],
    ["export", "--csv", "{blocker}/rows.csv"],
    ["export", "--csv", "{directory}"],
    ["summary", "-o", "{directory}"],
    ["backfill", "--out", "{blocker}/out"],
])
def test_unwritable_outputs_are_one_line_errors(tmp_path: Path, capsys, command) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    args = [part.format(blocker=blocker, directory=tmp_path) for part in command]
    assert logs_main([args[0], str(DEMO_JSON), *args[1:], "-q"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("mfotel: error: ") and str(tmp_path) in err[-1]
    assert not any("Traceback" in line for line in err)


@pytest.mark.parametrize("start", ["1e300", "nan", "-inf", "-5", "10000-01-01T00:00:00"])
def test_backfill_start_outside_the_calendar_is_a_usage_error(tmp_path, capsys, start) -> None:
    with pytest.raises(SystemExit) as exit_:
        logs_main(["backfill", str(DEMO_TEXT), "--out", str(tmp_path), f"--start={start}"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--start" in err and ("outside the years" in err or "ISO 8601" in err)


def test_backfill_times_that_overflow_name_the_line(tmp_path: Path, capsys) -> None:
    assert logs_main(["backfill", str(DEMO_TEXT), "--out", str(tmp_path), "--start", "0",
                      "--step-seconds", "1e300", "-q"]) == 1
    err = capsys.readouterr().err
    assert f"{DEMO_TEXT / 'train_monitor.log'}:1: step 1 would be at time 1e+300" in err
    assert not list(tmp_path.glob(".backfill-*")) and "Traceback" not in err


# --- stamped lines and sources in backfill -----------------------------------------------------

def test_backfill_of_stamped_text_lines_needs_no_start(tmp_path: Path) -> None:
    from mfotel.sinks import format_line
    log = tmp_path / "run" / "train_monitor.log"
    log.parent.mkdir()
    times = {step: 1_764_671_400.0 + 7.5 * step for step in range(1, 6)}
    log.write_text("".join(format_line(step, {"loss": 1.0 / 2 ** step}, now=at) + "\n"
                           for step, at in times.items()))
    assert logs_main(["backfill", str(log.parent), "--out", str(tmp_path / "out"), "-q"]) == 0
    families = {f.name: f for f in parse_openmetrics((tmp_path / "out/backfill.om").read_text())}
    loss = families["mindformers_train_loss"].samples
    assert [(s.value, float(s.timestamp)) for s in loss] == \
        [(1.0 / 2 ** step, at) for step, at in times.items()]


def test_backfill_takes_one_source_per_rank_and_names_the_one_left_out(tmp_path, capsys) -> None:
    run = tmp_path / "exp"
    (run / "output/log/rank_0").mkdir(parents=True)
    (run / "output/log/rank_0/info.log").write_bytes(MF_INFO.read_bytes())
    (run / "monitor_logs").mkdir()
    (run / "monitor_logs/train_monitor_0.jsonl").write_text(
        '{"time": 1796207870.0, "step": 10, "loss": 5.0}\n'
        '{"time": 1796207876.0, "step": 20, "loss": 4.6}\n')
    assert logs_main(["backfill", str(run), "--out", str(tmp_path / "a"), "-q"]) == 0
    err = capsys.readouterr().err
    assert ("job_name exp rank 0: backfilled from mfotel-json; left out its 20 "
            "mindformers-info step(s)") in err
    families = {f.name: f for f in parse_openmetrics((tmp_path / "a/backfill.om").read_text())}
    assert [s.value for s in families["mindformers_train_loss"].samples] == [5.0, 4.6]
    assert logs_main(["backfill", str(run), "--out", str(tmp_path / "b"), "-q",
                      "--source", "mindformers-info"]) == 0
    families = {f.name: f for f in parse_openmetrics((tmp_path / "b/backfill.om").read_text())}
    assert len(families["mindformers_train_loss"].samples) == 20
    assert families["mindformers_train_loss"].samples[-1].value == 4.54271


def test_backfill_labels_every_source_of_a_run_with_its_json_lines_job_name(
        tmp_path, capsys) -> None:
    """mfotel's JSON lines name their job: the rows of the run's info.log (which name none)
    join that job, so the one-source-per-rank choice still applies; --job-name still wins."""
    run = tmp_path / "monitor_logs"
    (run / "output/log/rank_0").mkdir(parents=True)
    (run / "output/log/rank_0/info.log").write_bytes(MF_INFO.read_bytes())
    (run / "train_monitor_0.jsonl").write_text(
        '{"time": 1796207870.0, "job_name": "eco-quickstart", "rank": 0, "step": 10, "loss": 5}\n'
        '{"time": 1796207876.0, "job_name": "eco-quickstart", "rank": 0, "step": 20, "loss": 4}\n')
    assert logs_main(["backfill", str(run), "--out", str(tmp_path / "a"), "-q"]) == 0
    err = capsys.readouterr().err
    assert "run monitor_logs: job_name eco-quickstart (the job_name its JSON lines carry)" in err
    assert ("job_name eco-quickstart rank 0: backfilled from mfotel-json; left out its 20 "
            "mindformers-info step(s)") in err
    families = {f.name: f for f in parse_openmetrics((tmp_path / "a/backfill.om").read_text())}
    assert {s.labels["job_name"] for f in families.values() for s in f.samples} == \
        {"eco-quickstart"}
    assert logs_main(["backfill", str(run), "--out", str(tmp_path / "b"), "-q",
                      "--job-name", "chosen"]) == 0
    assert "run monitor_logs: job_name chosen (given by --job-name)" in capsys.readouterr().err
    families = {f.name: f for f in parse_openmetrics((tmp_path / "b/backfill.om").read_text())}
    assert {s.labels["job_name"] for f in families.values() for s in f.samples} == {"chosen"}


def test_json_lines_with_a_bad_job_name_are_reported(tmp_path: Path) -> None:
    report = ParseReport()
    rows = list(parse_lines(['{"step": 1, "loss": 1.0, "job_name": "a"}',
                             '{"step": 2, "loss": 1.0, "job_name": 7}',
                             '{"step": 3, "loss": 1.0, "job_name": ""}'], report=report))
    assert [(r.step, r.job_name) for r in rows] == [(1, "a")]
    assert report.problem_count == 2


def test_csv_says_which_source_each_line_comes_from(tmp_path: Path) -> None:
    run = tmp_path / "exp"
    (run / "output/log/rank_0").mkdir(parents=True)
    (run / "output/log/rank_0/info.log").write_bytes(MF_INFO.read_bytes())
    (run / "train_monitor_0.log").write_text("[Monitor] step: 10, loss: 5.0, throughput: 7.2\n")
    buffer = io.StringIO()
    write_csv(iter_rows(discover_runs([run])), buffer)
    records = list(csv.DictReader(io.StringIO(buffer.getvalue())))
    ten = [(r["source"], r["throughput"]) for r in records if r["step"] == "10"]
    assert sorted(ten) == [("mfotel-text", "7.2"), ("mindformers-info", "37.44062")]
