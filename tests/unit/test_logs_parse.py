"""mfotel.logs.parse: real captured monitor lines parse to the right rows; malformed ones are
reported with their line numbers; other log lines are ignored; files are streamed."""
from __future__ import annotations

import itertools
import json
import math
from datetime import datetime
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mfotel import sinks
from mfotel.logs.parse import (
    ParseReport,
    Row,
    discover,
    discover_runs,
    iter_rows,
    parse_file,
    parse_lines,
    rank_from_path,
    run_name,
)
from tests.support.paths import FIXTURES

FIXTURES = FIXTURES
LOGS = FIXTURES / "logs"
MF_INFO = FIXTURES / "mindformers" / "info.log"
MF_STDOUT = FIXTURES / "mindformers" / "stdout.log"
MF_FORMS = LOGS / "mindformers-forms" / "info.log"
DEMO_TEXT = LOGS / "demo-text" / "train_monitor.log"
DEMO_JSON = LOGS / "demo-json" / "train_monitor.jsonl"
DEMO_CONSOLE = LOGS / "demo-console.txt"


def local(text: str) -> float:
    """Unix time of a logger timestamp, read as local time (as the parser does)."""
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def parse(*lines: str) -> tuple[list[Row], ParseReport]:
    report = ParseReport()
    return list(parse_lines(lines, run="r", report=report)), report


NAN = float("nan")

# (fixture it was captured in, the line verbatim, fields the row must have)
REAL_LINES = [
    (DEMO_TEXT,
     "[Monitor] step: 1, loss: 18.2512, learning_rate: 1.000000e-02, grad_norm: 8.4507, "
     "throughput: 8.56052, step_time: 0.934523",
     dict(step=1, loss=18.2512, learning_rate=0.01, grad_norm=8.4507, throughput=8.56052,
          step_time=0.934523, time=None, epoch=None, source="mfotel-text")),
    (DEMO_TEXT,
     "[Monitor] step: 22, loss: nan, learning_rate: 2.140462e-03, grad_norm: nan, "
     "throughput: 3059.81, step_time: 0.00130654",
     dict(step=22, loss=NAN, learning_rate=2.140462e-03, grad_norm=NAN, throughput=3059.81)),
    (DEMO_JSON,
     '{"time": 1796208010.084, "job_name": "demo-json", "rank": 0, "step": 26, "epoch": 1, '
     '"loss": "nan", "learning_rate": 0.009999999776482582, "grad_norm": "nan", '
     '"throughput": 5445.4923233008585, "step_time": 0.0010911159999977826}',
     dict(step=26, epoch=1, time=1796208010.084, loss=NAN, learning_rate=0.009999999776482582,
          grad_norm=NAN, throughput=5445.4923233008585, step_time=0.0010911159999977826,
          source="mfotel-json")),
    # mindformers file format, non-sink `loss:[step/mean]`, lr, array global_norm; the progress
    # line after it carries the throughput
    (MF_INFO,
     "[INFO] 2026-12-02 10:37:56,405 [mindformers/core/callback/callback.py:747] "
     "print_output_info: { Epoch:[  1/  1], step:[   20/   20], loss:[4.542710/5.165012], "
     "per_step_time: 31ms, lr: 0.00054323307, overflow cond: False, loss_scale: 1024.0, "
     "global_norm: [1.2831094], train_throughput_per_npu: 0.003T",
     dict(step=20, epoch=1, loss=4.54271, learning_rate=0.00054323307, grad_norm=1.2831094,
          step_time=0.031, loss_scale=1024.0, overflow=False, throughput=None,
          time=local("2026-12-02 10:37:56,405"), source="mindformers-info")),
    # mindformers console format
    (MF_STDOUT,
     "2026-12-02 10:37:53,218 - mindformers/tmp/mf1/output/log[mindformers/core/callback/"
     "callback.py:747] - INFO - { Epoch:[  1/  1], step:[    1/   20], loss:[5.549227/5.549227], "
     "per_step_time: 6480ms, lr: 0.0, overflow cond: False, loss_scale: 1024.0, "
     "global_norm: [0.9928976], train_throughput_per_npu: 0.000T",
     dict(step=1, loss=5.549227, learning_rate=0.0, grad_norm=0.9928976, step_time=6.48,
          time=local("2026-12-02 10:37:53,218"))),
    # sink form `loss: x`, no lr, global_norm None
    (MF_FORMS,
     "[INFO] 2026-12-02 10:40:56,672 [mindformers/core/callback/callback.py:756] "
     "print_output_info: { Epoch:[  1/  2], step:[    1/   10], loss: 2.500000, "
     "per_step_time: 95ms, overflow cond: False, loss_scale: unavailable, global_norm: None",
     dict(step=1, loss=2.5, learning_rate=None, grad_norm=None, loss_scale=None, step_time=0.095)),
    # sink form with a NaN loss (`{nan:5.6f}` pads) and an Inf norm array
    (MF_FORMS,
     "[INFO] 2026-12-02 10:40:56,672 [mindformers/core/callback/callback.py:756] "
     "print_output_info: { Epoch:[  1/  2], step:[    2/   10], loss:   nan, "
     "per_step_time: 95ms, overflow cond: False, loss_scale: unavailable, global_norm: [inf]",
     dict(step=2, loss=NAN, grad_norm=math.inf, learning_rate=None)),
    # 0-d array norm, float lr
    (MF_FORMS,
     "[INFO] 2026-12-02 10:40:56,673 [mindformers/core/callback/callback.py:747] "
     "print_output_info: { Epoch:[  1/  2], step:[    3/   10], loss:[2.250000/2.250000], "
     "per_step_time: 95ms, lr: 1e-05, overflow cond: False, loss_scale: unavailable, "
     "global_norm: 0.75",
     dict(step=3, loss=2.25, learning_rate=1e-05, grad_norm=0.75)),
    # second epoch: global step = (epoch - 1) * steps_per_epoch + step
    (MF_FORMS,
     "[INFO] 2026-12-02 10:40:56,675 [mindformers/core/callback/callback.py:756] "
     "print_output_info: { Epoch:[  2/  2], step:[    1/   10], loss: 1.500000, "
     "per_step_time: 95ms, overflow cond: False, loss_scale: unavailable, global_norm: None",
     dict(step=11, epoch=2, loss=1.5)),
]


def same(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


@pytest.mark.parametrize("fixture, line, expected", REAL_LINES,
                         ids=[f"{f.parent.name}/{f.name}:{e['step']}" for f, _, e in REAL_LINES])
def test_real_line_parses_to_expected_row(fixture: Path, line: str, expected: dict) -> None:
    assert line in fixture.read_text(encoding="utf-8").splitlines(), "not a captured line"
    rows, report = parse(line)
    assert report.problem_count == 0, report.describe()
    assert len(rows) == 1
    for key, value in expected.items():
        assert same(getattr(rows[0], key), value), (key, getattr(rows[0], key), value)


# (line, words the reported reason must contain)
MALFORMED = [
    ("[Monitor] step: 52, loss: 2.3x", "not a number"),
    ("[Monitor] loss: 2.345, learning_rate: 1.000000e-05", "no step"),
    ("[Monitor] step: five, loss: 2.345", "mfotel-text"),
    ("[Monitor] step: 5 loss 2.3", "mfotel-text"),
    ('{"time": 1796208000.951, "job_name": "demo-json", "rank": 0, "step": 1, "epoch": 1, "lo',
     "invalid JSON"),
    ('{"time": 1796208000.951, "loss": 2.5}', "no integer step"),
    ('{"step": 3, "loss": "two"}', "loss"),
    ('{"step": 3, "loss": [1]}', "loss"),
    ("[INFO] 2026-12-02 10:37:53,218 [mindformers/core/callback/callback.py:747] print_output_info:"
     " { Epoch:[  1/  1], step:[    1/   20], loss:[5.54xx/5.5], per_step_time: 6480ms",
     "loss"),
    ("[INFO] 2026-12-02 10:37:53,218 [mindformers/core/callback/callback.py:747] print_output_info:"
     " { Epoch:[  1/  1], step:[    1/   20], loss: 5.5, per_step_time: 6480s",
     "per_step_time"),
    ("[INFO] 2026-12-02 10:37:53,218 [mindformers/core/callback/callback.py:747] print_output_info:"
     " { Epoch:[  1/  1], step:[    1/", "Epoch"),
    ("[INFO] 2026-12-02 10:37:53,218 [mindformers/core/callback/callback.py:764] print_output_info:"
     "    5.0% |██      | 0.30860 samples/s/p  0:02:03 }", "without a step line"),
]


@pytest.mark.parametrize("line, reason", MALFORMED)
def test_malformed_monitor_line_is_reported_with_its_line_number(line: str, reason: str) -> None:
    good = "[Monitor] step: 1, loss: 18.2512"
    rows, report = parse(good, "some other log line", line, good.replace("1,", "2,", 1))
    assert [row.step for row in rows] == [1, 2]
    assert report.problem_count == 1
    problem = report.problems[0]
    assert problem.line == 3
    assert reason in problem.reason
    assert "<lines>:3:" in report.describe()


def test_irrelevant_lines_are_ignored_without_problems() -> None:
    rows, report = parse(
        "mfotel demo: 30 steps, metrics on http://127.0.0.1:0/metrics (job_name=mfotel-demo)",
        "[INFO] 2026-12-02 10:37:53,243 [mindformers/core/callback/callback.py:1496] _to_log: "
        "Epoch:[  1/  1], step:[    1/   20] adam_m_norm/model.layers.0.attention.wq.weight: "
        "5.797353514935821e-05",
        "local_norm:",
        "[4.6577963e-01 3.3609354e-07 3.3746929e-07 1.6058287e-02 1.3632399e-02",
        '{"level": "info", "msg": "some structured log line"}',
        "",
    )
    assert rows == [] and report.problem_count == 0


def test_mindformers_info_log_gives_one_row_per_step_with_throughput() -> None:
    report = ParseReport()
    rows = list(parse_file(MF_INFO, report=report))
    assert report.problem_count == 0, report.describe()
    assert [row.step for row in rows] == list(range(1, 21))
    assert all(row.throughput is not None and row.throughput > 0 for row in rows)
    assert rows[0].throughput == 0.3086 and rows[-1].throughput == 63.33702
    assert all(b.time >= a.time for a, b in itertools.pairwise(rows))
    assert rows[0].run == "mindformers" and rows[0].rank == 0
    assert rows[0].line == 10 and rows[-1].line == 661


def test_mindformers_console_log_gives_the_same_values_as_info_log() -> None:
    fields = ("step", "epoch", "time", "loss", "learning_rate", "grad_norm", "throughput",
              "step_time", "loss_scale")
    from_file = [[getattr(r, f) for f in fields] for r in parse_file(MF_INFO)]
    from_console = [[getattr(r, f) for f in fields] for r in parse_file(MF_STDOUT)]
    assert from_file == from_console


def test_mindformers_forms_fixture_all_rows_and_throughput_attached() -> None:
    rows = list(parse_file(MF_FORMS))
    assert [(r.step, r.throughput) for r in rows] == [(1, 12.5), (2, 12.5), (3, 12.5),
                                                      (4, 12.5), (11, 12.5)]
    assert rows[3].learning_rate == pytest.approx(2e-05) and rows[3].grad_norm == 0.5
    assert rows[0].run == "mindformers-forms"


def test_demo_text_and_json_files_parse_completely() -> None:
    text_report, json_report = ParseReport(), ParseReport()
    text_rows = list(parse_file(DEMO_TEXT, report=text_report))
    json_rows = list(parse_file(DEMO_JSON, report=json_report))
    assert text_report.problem_count == json_report.problem_count == 0
    assert [r.step for r in text_rows] == [r.step for r in json_rows] == list(range(1, 31))
    assert [r.step for r in text_rows if math.isnan(r.loss)] == list(range(22, 31))
    assert [r.step for r in json_rows if math.isnan(r.loss)] == list(range(26, 31))
    assert json_rows[0].time == 1796208010.035 and text_rows[0].time is None
    # every JSON value back exactly as written
    for row, line in zip(json_rows, DEMO_JSON.read_text().splitlines(), strict=True):
        record = json.loads(line)
        for key in ("loss", "learning_rate", "grad_norm", "throughput", "step_time"):
            assert same(getattr(row, key), float(record[key]))


def test_console_capture_yields_the_monitor_lines_only() -> None:
    console = [(r.step, r.loss) for r in parse_file(DEMO_CONSOLE)]
    monitor = [(r.step, r.loss) for r in parse_file(DEMO_TEXT)]
    assert len(console) == 30
    assert [s for s, _ in console] == [s for s, _ in monitor]


def test_logger_prefix_timestamp_becomes_the_row_time() -> None:
    rows, _ = parse("2026-12-02 10:30:00,123 INFO mfotel [Monitor] step: 7, loss: 1.5")
    assert rows[0].time == pytest.approx(local("2026-12-02 10:30:00,123"))


def test_same_step_from_mfotel_and_mindformers_lines_stays_two_rows_with_their_sources() -> None:
    """A console capture holding both: each source's numbers stay its own (mfotel's
    throughput is per rank over the record interval, MFLossMonitor's per device per step)."""
    rows, report = parse(
        "[Monitor] step: 1, loss: 5.54923, grad_norm: 0.992898",
        REAL_LINES[4][1],                        # MFLossMonitor step 1 (console form)
        "2026-12-02 10:37:53,218 - mindformers/tmp/mf1/output/log[mindformers/core/callback/"
        "callback.py:764] - INFO -    5.0% |██      | 0.30860 samples/s/p  0:02:03 }")
    assert report.problem_count == 0
    by_source = {row.source: row for row in rows}
    assert sorted(by_source) == ["mfotel-text", "mindformers-info"] and len(rows) == 2
    mfotel, mindformers = by_source["mfotel-text"], by_source["mindformers-info"]
    assert (mfotel.step, mfotel.loss, mfotel.grad_norm) == (1, 5.54923, 0.992898)
    assert (mfotel.learning_rate, mfotel.throughput, mfotel.step_time) == (None, None, None)
    assert (mindformers.step, mindformers.loss, mindformers.grad_norm) == (1, 5.549227, 0.9928976)
    assert (mindformers.learning_rate, mindformers.throughput, mindformers.step_time) == \
        (0.0, 0.3086, 6.48)


def test_json_rank_field_wins_over_the_file_name(tmp_path: Path) -> None:
    path = tmp_path / "train_monitor_5.jsonl"
    path.write_text('{"rank": 3, "step": 1, "loss": 1.0}\n{"step": 2, "loss": 1.0}\n')
    assert [r.rank for r in parse_file(path)] == [3, 5]


@pytest.mark.parametrize("path, rank", [
    ("runs/a/train_monitor_3.log", 3), ("out/log/rank_2/info.log", 2),
    ("runs/a/train_monitor.log", 0), ("logs/rank7/monitor.jsonl", 7),
    ("msrun_log/worker_1.log", 1), ("runs/a/loss.log", 0)])
def test_rank_comes_from_the_file_name_or_rank_directory(path: str, rank: int) -> None:
    assert rank_from_path(Path(path)) == rank


@pytest.mark.parametrize("path, name", [
    ("/r/exp1/monitor_logs/train_monitor_0.log", "exp1"),
    ("/r/exp1/output/log/rank_0/info.log", "exp1"),
    ("/r/exp1/llama_sft.log", "llama_sft"),
    ("/r/exp2/train_monitor.jsonl", "exp2")])
def test_run_name_comes_from_the_directory_or_file(path: str, name: str) -> None:
    assert run_name(Path(path)) == name


def test_directory_run_reads_monitor_files_and_info_log_side_by_side(tmp_path: Path) -> None:
    run = tmp_path / "exp"
    (run / "monitor_logs").mkdir(parents=True)
    (run / "output/log/rank_0").mkdir(parents=True)
    for rank in (1, 0):
        (run / f"monitor_logs/train_monitor_{rank}.log").write_text(
            f"[Monitor] step: 1, loss: {rank}.5\n")
    (run / "output/log/rank_0/info.log").write_text(MF_INFO.read_text())
    found = discover(run)
    assert found.name == "exp"
    assert [p.name for p in found.files] == ["train_monitor_0.log", "train_monitor_1.log",
                                             "info.log"]
    assert [found.kinds[p] for p in found.files] == ["monitor", "monitor", "mindformers-info"]
    rows = list(iter_rows([found]))
    assert [(r.rank, r.source, r.loss) for r in rows[:2]] == [(0, "mfotel-text", 0.5),
                                                             (1, "mfotel-text", 1.5)]
    assert [(r.rank, r.source, r.step) for r in rows[2:]] == \
        [(0, "mindformers-info", step) for step in range(1, 21)]


def test_rotated_info_logs_are_read_oldest_first(tmp_path: Path) -> None:
    rank_dir = tmp_path / "exp/output/log/rank_0"
    rank_dir.mkdir(parents=True)
    lines = [line for line in MF_FORMS.read_text().splitlines(keepends=True)]
    steps = [i for i, line in enumerate(lines) if "{ Epoch:[" in line]
    # newest last: info.log.2 (oldest), info.log.1, info.log
    (rank_dir / "info.log.2").write_text("".join(lines[:steps[2]]))
    (rank_dir / "info.log.1").write_text("".join(lines[steps[2]:steps[4]]))
    (rank_dir / "info.log").write_text("".join(lines[steps[4]:]))
    assert [r.step for r in iter_rows([discover(tmp_path / "exp")])] == [1, 2, 3, 4, 11]


def test_duplicate_run_names_are_made_unique_and_names_can_be_given() -> None:
    runs = discover_runs([DEMO_TEXT, DEMO_TEXT, DEMO_JSON], names=["", "again"])
    assert [r.name for r in runs] == ["demo-text", "again", "demo-json"]
    runs = discover_runs([DEMO_TEXT, DEMO_TEXT])
    assert [r.name for r in runs] == ["demo-text", "demo-text-2"]


def test_missing_run_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no monitor logs"):
        discover(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such file"):
        discover(tmp_path / "nope")


def test_parser_streams_lines_lazily() -> None:
    """An endless source still yields its first rows: nothing reads the whole input."""
    endless = (f"[Monitor] step: {i}, loss: 1.0\n".encode() for i in itertools.count(1))
    first = list(itertools.islice(parse_lines(endless), 3))
    assert [r.step for r in first] == [1, 2, 3]


def test_truncated_last_line_of_a_crashed_run_is_reported(tmp_path: Path) -> None:
    text = DEMO_JSON.read_text()
    path = tmp_path / "train_monitor.jsonl"
    path.write_text(text[: len(text) - 60])          # the writer died mid-line
    report = ParseReport()
    rows = list(parse_file(path, report=report))
    assert len(rows) == 29
    assert report.problem_count == 1 and report.problems[0].line == 30


def test_problems_are_all_counted_but_only_the_first_are_kept() -> None:
    report = ParseReport(max_problems=5)
    list(parse_lines([f"[Monitor] step: {i}, loss: x" for i in range(50)], report=report))
    assert report.problem_count == 50 and len(report.problems) == 5
    assert "and 45 more" in report.describe(limit=5)


finite_or_not = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=64),
                          st.sampled_from([math.nan, math.inf, -math.inf]))
values = st.fixed_dictionaries({}, optional={name: finite_or_not for name in
                                             ("loss", "learning_rate", "grad_norm",
                                              "throughput", "step_time")})


@settings(max_examples=200, deadline=None)
@given(step=st.integers(0, 10**9), values=values)
def test_lines_written_by_mfotel_sinks_parse_back(step: int, values: dict) -> None:
    text_rows, report = parse(sinks.format_line(step, values),
                              sinks.format_json(step + 1, 1, 2, "job", values, now=1.5))
    assert report.problem_count == 0
    text_row, json_row = text_rows
    assert (text_row.step, json_row.step, json_row.rank, json_row.time) == (step, step + 1, 2, 1.5)
    for name, value in values.items():
        assert same(getattr(json_row, name), value)
        assert same(getattr(text_row, name), float(sinks.format_value(name, value)))


# --- lines cut short: never read as values ---------------------------------------------------

def stamped(step: int, loss: float) -> str:
    return sinks.format_line(step, {"loss": loss, "learning_rate": 1e-3}, now=1.7e9 + step)


def test_stamped_text_line_carries_its_time() -> None:
    rows, report = parse(stamped(5, 2.5))
    assert report.problem_count == 0
    assert (rows[0].step, rows[0].loss, rows[0].time) == (5, 2.5, 1.7e9 + 5)


def test_unstamped_line_among_stamped_ones_is_reported_as_cut() -> None:
    """The torn line of a full disk: `loss: 0` of `loss: 0.123`; never a real 0."""
    torn = stamped(3, 0.123)[: stamped(3, 0.123).index("0.123") + 1]
    assert torn.endswith("loss: 0")
    rows, report = parse(stamped(1, 2.0), stamped(2, 1.0), torn, stamped(4, 0.5))
    assert [row.step for row in rows] == [1, 2, 4]
    assert [(p.line, "cut short" in p.reason) for p in report.problems] == [(3, True)]


def test_a_cut_first_line_is_reported_once_stamped_lines_follow() -> None:
    torn = stamped(1, 0.123)[:30]
    rows, report = parse(torn, stamped(2, 1.0), stamped(3, 0.5))
    assert [row.step for row in rows] == [2, 3]
    assert [p.line for p in report.problems] == [1]


def test_unterminated_last_line_of_a_file_is_cut(tmp_path: Path) -> None:
    path = tmp_path / "old.log"
    path.write_text("[Monitor] step: 1, loss: 2.5\n[Monitor] step: 2, loss: 1.2\n"
                    "[Monitor] step: 3, loss: 0")          # the writer died mid-line
    report = ParseReport()
    assert [row.step for row in parse_file(path, report=report)] == [1, 2]
    assert report.problems[0].line == 3 and "no line end" in report.problems[0].reason


def test_lines_glued_by_a_cut_write_are_reported() -> None:
    glued = "[Monitor] step: 3, loss: 0[Monitor] step: 4, loss: 2.5"
    rows, report = parse("[Monitor] step: 2, loss: 1.5", glued, "[Monitor] step: 5, loss: 2.0")
    assert [row.step for row in rows] == [2, 5]
    assert "glued" in report.problems[0].reason and report.problems[0].line == 2


def test_cut_time_field_is_reported() -> None:
    line = stamped(2, 1.0)
    rows, report = parse(stamped(1, 2.0), line[:-4], line[:-10])
    assert [row.step for row in rows] == [1]
    assert [p.line for p in report.problems] == [2, 3]
    assert all("time" in p.reason for p in report.problems)


# --- hostile input: clear problems, bounded memory -------------------------------------------

@pytest.mark.parametrize("record, reason", [
    ('{"step": 1, "loss": 1.0, "time": NaN}', "not a unix time"),
    ('{"step": 1, "loss": 1.0, "time": Infinity}', "not a unix time"),
    ('{"step": 1, "loss": 1.0, "time": 1e300}', "not a unix time"),
    ('{"step": 1, "loss": 1.0, "time": -5}', "not a unix time"),
    ('{"step": 1, "loss": 1.0, "time": "yesterday"}', "not unix seconds"),
    ('{"step": 1, "loss": 1.0, "time": true}', "not unix seconds"),
    ('{"step": 1, "loss": 1e999999}', ""),                      # inf: a value, not an error
    ('{"step": 1152921504606846976, "loss": 1.0}', "step"),
    ('{"step": -1, "loss": 1.0}', "step"),
    ('{"step": 1, "rank": -3, "loss": 1.0}', "rank"),
    ('{"step": 1, "loss": 1.0, "epoch": 1.5}', "epoch"),
    ('{"step": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
    ('{"step": 1, "loss": ' + "[" * 100_000, "invalid JSON"),
    ("[Monitor] step: 99999999999999999999999999, loss: 1.0", "step"),
    ("[Monitor] step: ², loss: 1.0", "step"),
    ("[INFO] { Epoch:[  1/  1], step:[    1/99999999999], loss: 2.5", ""),
    ("[INFO] { Epoch:[999999999999/  1], step:[    1/999999999999], loss: 2.5", "step"),
])
def test_hostile_values_are_reported_not_raised(record: str, reason: str) -> None:
    rows, report = parse(record)
    if reason:
        assert rows == [] and report.problem_count == 1
        assert reason in report.problems[0].reason and report.problems[0].line == 1
    else:
        assert report.problem_count == 0 and len(rows) == 1


class ReadRecorder:
    """A real file whose reads are measured: the largest block the parser asked for."""

    def __init__(self, handle) -> None:
        self.handle, self.largest = handle, 0

    def readline(self, size: int = -1) -> bytes:
        assert size > 0, "an unbounded readline could hold a whole huge line"
        data = self.handle.readline(size)
        self.largest = max(self.largest, len(data))
        return data


def test_overlong_line_is_reported_with_its_number_and_memory_stays_bounded(tmp_path: Path) -> None:
    from mfotel.logs.parse import MAX_LINE_BYTES, read_lines
    path = tmp_path / "train_monitor.log"
    with open(path, "wb") as out:
        out.write(b"[Monitor] step: 1, loss: 2.5\n")
        out.write(b"[Monitor] step: 2, loss: " + b"9" * (5 * MAX_LINE_BYTES) + b"\n")
        out.write(b"[Monitor] step: 3, loss: 1.5\n")
        out.write(b"x" * (3 * MAX_LINE_BYTES))                 # no newline at all
    report = ParseReport()
    assert [row.step for row in parse_file(path, report=report)] == [1, 3]
    assert [p.line for p in report.problems] == [2, 4]
    assert "longer than" in report.problems[0].reason
    assert str(5 * MAX_LINE_BYTES + 26) in report.problems[0].reason
    with open(path, "rb") as handle:
        recorder = ReadRecorder(handle)
        sizes = [len(line) for line in read_lines(recorder)]
    assert recorder.largest <= MAX_LINE_BYTES + 2 and max(sizes) <= MAX_LINE_BYTES + 2
    assert len(sizes) == 4


# --- discovery by content --------------------------------------------------------------------

def copy_lines(source: Path, target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(source.read_bytes())
    return target


def test_directory_discovery_finds_monitor_files_by_content_whatever_their_name(tmp_path) -> None:
    """The README's `--file-path monitor_logs/m.log` and a JSON file named `metrics.out`."""
    run = tmp_path / "exp"
    text = copy_lines(DEMO_TEXT, run / "monitor_logs" / "m.log")
    jsonl = copy_lines(DEMO_JSON, run / "metrics.out")
    (run / "train.yaml").write_text("monitor_config:\n  step_interval: 1\n")
    (run / "notes.txt").write_text("loss went down nicely, see the [plots]\n")
    (run / "targets.json").write_text('[{"targets": ["127.0.0.1:9464"]}]\n')
    (run / "events.log").write_text('{"level": "info", "msg": "started"}\n' * 50)
    (run / "checkpoint").mkdir()
    (run / "checkpoint" / "net.ckpt").write_bytes(bytes(range(256)) * 64)
    (run / ".hidden").mkdir()
    copy_lines(DEMO_TEXT, run / ".hidden" / "m.log")
    found = discover(run)
    assert found.files == [jsonl, text]
    assert found.kinds == {jsonl: "monitor", text: "monitor"}
    assert len(list(iter_rows([found]))) == 60


def test_console_captures_are_read_only_when_there_is_no_monitor_file_or_info_log(tmp_path):
    run = tmp_path / "exp"
    capture = copy_lines(DEMO_CONSOLE, run / "msrun_log" / "worker_0.log")
    found = discover(run)
    assert found.files == [capture] and found.kinds[capture] == "console"
    assert [row.step for row in iter_rows([found])] == list(range(1, 31))
    monitor = copy_lines(DEMO_TEXT, run / "monitor_logs" / "train_monitor_0.log")
    found = discover(run)
    assert found.files == [monitor]      # the capture repeats the monitor file's lines
    # stdout of a run printing nothing but its monitor lines and the callback's note
    (run / "stdout.log").write_text(f"mfotel: rank 0 writes monitor lines to {monitor}\n"
                                    + DEMO_TEXT.read_text())
    assert discover(run).files == [monitor]


def test_an_info_log_of_another_program_is_not_a_mindformers_log(tmp_path) -> None:
    (tmp_path / "info.log").write_text("2026-01-01 INFO web server started\n")
    with pytest.raises(FileNotFoundError, match="none of the 1 file"):
        discover(tmp_path)


def test_no_monitor_logs_error_says_what_was_looked_for(tmp_path) -> None:
    (tmp_path / "a.log").write_text("hello\n")
    (tmp_path / "b.txt").write_text("[Monitor is not a monitor line\n")
    with pytest.raises(FileNotFoundError) as error:
        discover(tmp_path)
    message = str(error.value)
    assert str(tmp_path) in message and "2 file(s)" in message
    assert "[Monitor] lines" in message and "MFLossMonitor" in message


MF_STEP_LINE = next(line for line in MF_FORMS.read_text().splitlines() if "{ Epoch:[" in line)

# shape -> (lines of n characters, rows expected, problems expected)
HOSTILE_SHAPES = {
    "x...samples/s/p after a step line": (lambda n: [MF_STEP_LINE, "x" * n + "samples/s/p"], 1, 1),
    "a megabyte of digits as the loss": (lambda n: ["[Monitor] step: 1, loss: " + "9" * n], 0, 1),
    "digits before [Monitor]": (lambda n: ["1" * n + "[Monitor] step: 1, loss: 1.0"], 1, 0),
    "spaces inside { Epoch:[": (
        lambda n: ["{ Epoch:[" + " " * n + "1/ 1], step:[ 1/ 1], loss: 1"], 1, 0),
    "glued [Monitor] lines": (lambda n: ["[Monitor] step: 1, loss: 0" * (n // 26)], 0, 1),
    "unclosed JSON arrays": (lambda n: ['{"step": 1, "loss": ' + "[" * n], 0, 1),
}


@pytest.mark.parametrize("shape", HOSTILE_SHAPES)
def test_hostile_lines_up_to_the_length_limit_are_parsed_or_reported(shape: str) -> None:
    """Lines are bounded (MAX_LINE_BYTES) before any pattern sees them, and no pattern can
    backtrack: the old `(\\S+) samples/s/p` took 25 s on 80k characters. Time is measured by
    benchmarks/parse_speed.py (80k characters cost ~8x 10k, not 64x) and bounded per case by
    the fuzz test's deadline."""
    from mfotel.logs.parse import MAX_LINE_BYTES
    make, row_count, problem_count = HOSTILE_SHAPES[shape]
    rows, report = parse(*make(MAX_LINE_BYTES - 100))
    assert (len(rows), report.problem_count) == (row_count, problem_count), report.describe()
    assert all(len(p.text) <= 200 for p in report.problems)
