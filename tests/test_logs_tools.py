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
from mfotel.logs.export import COLUMNS, write_csv
from mfotel.logs.parse import ParseReport, discover_runs, iter_rows
from mfotel.logs.cli import main as logs_main
from mfotel.logs.summary import summarize

LOGS = Path(__file__).parent / "fixtures" / "logs"
DEMO_TEXT = LOGS / "demo-text"
DEMO_JSON = LOGS / "demo-json"
TWO_RANKS = LOGS / "two-ranks"
MF_INFO = Path(__file__).parent / "fixtures" / "mindformers" / "info.log"
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
    last_finite, expected = None, []
    for _, v in sorted(logged.items()):       # as live: the last finite value stays exposed
        last_finite = v["loss"] if math.isfinite(v["loss"]) else last_finite
        expected.append(last_finite)
    assert [s.value for s in loss] == expected
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
