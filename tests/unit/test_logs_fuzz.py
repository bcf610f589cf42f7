"""Hypothesis drives the log tools with generated files: real monitor lines (mfotel text and
JSON lines, mindformers info.log forms) cut, glued, mutated, mixed with noise, hostile numbers,
deep JSON and megabyte lines. No case may raise, hang (a deadline per case) or report a
problem without its file and line number; a cut stamped line is never read as a value."""
from __future__ import annotations

import io
import math
import tempfile
from datetime import timedelta
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mfotel import sinks
from mfotel.logs.backfill import BackfillError, write_openmetrics
from mfotel.logs.cli import main as logs_main
from mfotel.logs.export import write_csv
from mfotel.logs.parse import (
    MAX_LINE_BYTES,
    MAX_STEP,
    MAX_TIME,
    SOURCES,
    ParseReport,
    Row,
    discover_runs,
    parse_file,
    parse_lines,
)
from mfotel.logs.summary import summarize
from tests.support.paths import FIXTURES
from tests.support.waiting import settle

FIXTURES = FIXTURES
REAL_LINES = [line for path in (FIXTURES / "mindformers" / "info.log",
                                FIXTURES / "logs" / "mindformers-forms" / "info.log",
                                FIXTURES / "logs" / "demo-json" / "train_monitor.jsonl",
                                FIXTURES / "logs" / "demo-text" / "train_monitor.log",
                                FIXTURES / "logs" / "demo-console.txt")
              for line in path.read_text(encoding="utf-8").splitlines()[:80]]
MARKERS = ["[Monitor] ", "[Monitor] step: 1, loss: ", "{ Epoch:[  1/  2], step:[    3/   10], ",
           '{"step": 3, "loss": ', " samples/s/p", "samples/s/p", ", time: ", "loss:[", "{"]

# A case may parse a megabyte line. The deadline only detects hangs (quadratic work at 1 MB
# takes minutes; a case takes seconds), scaled with the machine's load; linear time is
# measured by benchmarks/parse_speed.py, not here.
HANG = timedelta(seconds=settle(10))
FUZZ = settings(max_examples=150, deadline=HANG, derandomize=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

values = st.floats(allow_nan=True, allow_infinity=True)
metric_values = st.dictionaries(st.sampled_from(["loss", "learning_rate", "grad_norm",
                                                 "throughput", "step_time"]), values)
steps = st.one_of(st.integers(0, 10 ** 6), st.integers(-10 ** 30, 10 ** 30))
times = st.floats(-1e12, 1e12)     # format_json's clock; hostile_json has non-finite times

mfotel_text = st.builds(lambda step, vals, now: sinks.format_line(step, vals, now=now),
                        st.integers(0, 10 ** 9), metric_values, st.floats(0, 4e9))
mfotel_json = st.builds(lambda step, epoch, rank, vals, now: sinks.format_json(
                            step, epoch, rank, "job", vals, now=now),
                        steps, steps, steps, metric_values, times)
hostile_json = st.one_of(
    st.builds(lambda depth: '{"step": 1, "loss": ' + "[" * depth + "]" * depth + "}",
              st.integers(1, 200_000)),
    st.builds(lambda key, raw: '{"step": 1, "' + key + '": ' + raw + "}",
              st.sampled_from(["time", "loss", "rank", "epoch", "step_time"]),
              st.sampled_from(["NaN", "Infinity", "-Infinity", "1e300", "-1", "true", "null",
                               '"x"', "[1]", "{}", "1" * 5000, "1e999999"])))
megabyte_line = st.builds(lambda head, fill, size, tail: head + fill * size + tail,
                          st.sampled_from(MARKERS + [""]),
                          st.sampled_from(["x", " ", "9", "[", "{", ":", ",", "/", "é"]),
                          st.integers(10_000, MAX_LINE_BYTES + 10_000),
                          st.sampled_from(MARKERS + [""]))
noise = st.text(st.characters(blacklist_categories=("Cs",)), max_size=200)


def mutate(line: str, data: st.DataObject) -> str:
    kind = data.draw(st.sampled_from(["keep", "cut", "insert", "glue", "replace"]))
    if kind == "keep" or not line:
        return line
    at = data.draw(st.integers(0, len(line)))
    if kind == "cut":
        return line[:at]
    if kind == "insert":
        return line[:at] + data.draw(st.sampled_from(MARKERS + ["nan", "-", ",", ": ", "\x00",
                                                             "ÿ", "1e400", "\t"])) + line[at:]
    if kind == "glue":
        return line[:at] + data.draw(st.sampled_from(REAL_LINES))
    return line[:at] + data.draw(noise) + line[at + data.draw(st.integers(0, 20)):]


@st.composite
def log_files(draw: st.DrawFn) -> list[str]:
    sources = st.one_of(st.sampled_from(REAL_LINES), mfotel_text, mfotel_json, hostile_json,
                        noise)
    lines = [mutate(line, draw(st.data())) for line in draw(st.lists(sources, max_size=25))]
    if draw(st.booleans()):
        lines.insert(draw(st.integers(0, len(lines))), draw(megabyte_line))
    return lines


def write(directory: Path, lines: list[str], final_newline: bool, name: str) -> Path:
    path = directory / name
    text = "\n".join(lines) + ("\n" if final_newline and lines else "")
    path.write_bytes(text.encode("utf-8", "surrogatepass"))
    return path


def check_rows(rows: list[Row], report: ParseReport, path: Path, line_count: int) -> None:
    for row in rows:
        assert row.source in SOURCES
        assert isinstance(row.step, int) and 0 <= row.step <= MAX_STEP
        assert isinstance(row.rank, int) and row.rank >= 0
        assert row.time is None or (math.isfinite(row.time) and 0 <= row.time <= MAX_TIME)
        for name in ("loss", "learning_rate", "grad_norm", "throughput", "step_time",
                     "loss_scale"):
            assert getattr(row, name) is None or isinstance(getattr(row, name), float)
        assert 1 <= row.line <= line_count and row.path == str(path)
    for problem in report.problems:
        assert problem.path == str(path) and 1 <= problem.line <= line_count
        assert str(problem).startswith(f"{path}:{problem.line}: ") and problem.reason


@FUZZ
@given(lines=log_files(), final_newline=st.booleans(),
       name=st.sampled_from(["train_monitor_0.log", "info.log", "m.jsonl", "worker_3.log"]))
def test_generated_logs_parse_without_exceptions_and_tools_accept_the_rows(
        lines: list[str], final_newline: bool, name: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        path = write(directory, lines, final_newline, name)
        report = ParseReport()
        rows = list(parse_file(path, report=report))
        line_count = max(1, path.read_bytes().count(b"\n") + 1)
        check_rows(rows, report, path, line_count)
        assert report.problem_count == len(report.problems)
        assert write_csv(rows, io.StringIO()) == len(rows)
        for summary in summarize(discover_runs([path])):
            assert sum(rank.rows for rank in summary.ranks.values()) == len(rows)
        try:
            stats = write_openmetrics(iter(rows), directory / "out" / "b.om", start=0.0)
            assert stats.rows + stats.skipped_out_of_order + sum(
                n for *_, n in stats.left_out) <= len(rows)
        except BackfillError as error:
            assert f"{path}:" in str(error)      # names the file and line of the bad row
        assert not list((directory / "out").glob(".backfill-*"))


@FUZZ
@given(lines=log_files(), command=st.sampled_from(["summary", "export", "backfill", "plot"]))
def test_generated_logs_through_the_cli_exit_0_or_1_never_raise(lines: list[str],
                                                               command: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        run = directory / "run"
        run.mkdir()
        write(run, lines, True, "train_monitor.log")
        out = directory / "out"
        extra = {"summary": ["-o", str(out / "s.md")], "export": ["--csv", str(out / "r.csv")],
                 "backfill": ["--out", str(out), "--start", "0"],
                 "plot": ["-o", str(out / "c.png"), "--dpi", "20"]}[command]
        assert logs_main([command, str(run), *extra, "-q"]) in (0, 1)


@settings(max_examples=300, deadline=HANG)
@given(steps_=st.lists(st.integers(0, 10 ** 6), min_size=3, max_size=8, unique=True),
       losses=st.lists(st.floats(-1e6, 1e6), min_size=8, max_size=8),
       cut=st.data())
def test_a_stamped_line_cut_anywhere_is_never_read(steps_: list[int], losses: list[float],
                                                  cut: st.DataObject) -> None:
    lines = [sinks.format_line(step, {"loss": loss, "learning_rate": 1e-4}, now=1.7e9 + step)
             for step, loss in zip(steps_, losses, strict=False)]  # 8 losses, 3..8 steps
    victim = cut.draw(st.integers(0, len(lines) - 1))
    lines[victim] = lines[victim][:cut.draw(st.integers(1, len(lines[victim]) - 1))]
    report = ParseReport()
    rows = list(parse_lines([line + "\n" for line in lines], report=report,
                            require_line_end=True))
    assert victim + 1 not in [row.line for row in rows]
    assert [row.step for row in rows] == [s for i, s in enumerate(steps_) if i != victim]
    assert [p.line for p in report.problems] == [victim + 1] or (
        report.problem_count == 0 and "[Monitor]" not in lines[victim])
