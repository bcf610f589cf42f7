"""Monitor line formats (text as the seed writes it plus its time, strict JSON lines) and the
file sink's whole-line writes under a real full disk (RLIMIT_FSIZE in a child process). A real
training run through a full disk: tests/e2e/test_sinks_e2e.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from mfotel import sinks
from mfotel.logs.parse import ParseReport, parse_file, parse_lines
from mfotel.sinks import FileSink, format_json, format_line
from tests.support.lines import split_time

NOW = 1_764_671_400.123
def test_seed_line_format_then_the_time():
    line = format_line(50, {"loss": 2.345, "learning_rate": 1e-5, "grad_norm": 0.876}, now=NOW)
    head, at = split_time(line)
    assert head == "[Monitor] step: 50, loss: 2.345, learning_rate: 1.000000e-05, grad_norm: 0.876"
    assert at == NOW


def test_line_keeps_metric_order_skips_missing_and_shows_nan():
    line = format_line(7, {"grad_norm": float("inf"), "loss": float("nan"), "throughput": None},
                       now=NOW)
    assert split_time(line)[0] == "[Monitor] step: 7, grad_norm: inf, loss: nan"


@pytest.mark.parametrize("zone, offset", [("UTC0", "+00:00"), ("CST-8", "+08:00"),
                                          ("EST+5", "-05:00")])
def test_time_field_is_local_time_with_its_utc_offset(zone, offset):
    code = f"from mfotel.sinks import format_line; print(format_line(1, {{}}, now={NOW}))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "TZ": zone}, timeout=60, check=True)
    line = done.stdout.strip()
    assert line.endswith(offset) and split_time(line)[1] == NOW
    hours = int(offset[:3])
    assert line.split("T")[1][:2] == f"{(10 + hours) % 24:02d}"   # NOW is 10:30 UTC


RENAMED_FIELD = textwrap.dedent("""
    import json, sys
    from mfotel import sinks
    sinks.LINE_FIELDS["step_time"] = sinks.LineField("step_time_mean", unit="s")   # one row
    from mfotel.logs.parse import parse_lines
    line = sinks.format_line(3, {"loss": 1.5, "step_time": 0.25}, now=float(sys.argv[1]))
    old = "[Monitor] step: 2, loss: 1.5, step_time: 0.5"       # an older mfotel's line
    rows = [(r.step, r.step_time) for lines in ([old], [line]) for r in parse_lines(lines)]
    print(json.dumps([line, rows]))
""")


def test_a_changed_field_row_changes_the_line_and_the_parser_follows():
    """format_line is table-driven: renaming a field or adding a unit is one row of
    LINE_FIELDS; the log parser reads its keys from the table (older lines still parse)."""
    done = subprocess.run([sys.executable, "-c", RENAMED_FIELD, str(NOW)], capture_output=True,
                          text=True, timeout=60, check=True)
    line, rows = json.loads(done.stdout)
    assert split_time(line)[0] == "[Monitor] step: 3, loss: 1.5, step_time_mean: 0.25s"
    assert rows == [[2, 0.5], [3, 0.25]]


def test_json_line_is_strict_json_with_nonfinite_as_strings():
    text = format_json(3, 1, 2, "job", {"loss": float("nan"), "learning_rate": 0.001,
                                         "grad_norm": float("-inf")}, now=10.0)
    record = json.loads(text, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    assert record == {"time": 10.0, "job_name": "job", "rank": 2, "step": 3, "epoch": 1,
                      "loss": "nan", "learning_rate": 0.001, "grad_norm": "-inf"}


def test_file_sink_appends_whole_lines_unbuffered(tmp_path):
    path = tmp_path / "deep" / "m.log"
    sink = FileSink(path)
    sink.write("a")
    assert path.read_text() == "a\n"  # on disk before close
    sink.write("b")
    sink.close()
    assert FileSink(path) and path.read_text() == "a\nb\n"


# --- a full disk, then freed: RLIMIT_FSIZE in a child (SIGXFSZ ignored: EFBIG, short writes)

FULL_THEN_FREED = textwrap.dedent("""
    import json, os, resource, signal, sys
    from mfotel.sinks import FileSink
    path, limit, lines, free_after, no_truncate = sys.argv[1:6]
    if no_truncate == "1":
        def refuse(fd, length):          # a filesystem that refuses to shrink files
            raise OSError(1, "Operation not permitted")
        os.ftruncate = refuse
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(limit), resource.RLIM_INFINITY))
    sink = FileSink(path)
    outcome = []
    for index, line in enumerate(json.loads(lines)):
        if index == int(free_after):      # the disk is freed
            resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
        try:
            sink.write(line)
            outcome.append("ok")
        except OSError as exc:
            outcome.append(exc.strerror)
    sink.close()
    print(json.dumps(outcome))
""")


def write_through_full_disk(tmp_path, lines: list[str], limit: int, free_after: int,
                            no_truncate: bool = False) -> tuple[bytes, list[str]]:
    path = tmp_path / "m.log"
    done = subprocess.run([sys.executable, "-c", FULL_THEN_FREED, str(path), str(limit),
                           json.dumps(lines), str(free_after), "1" if no_truncate else "0"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return path.read_bytes(), json.loads(done.stdout)


LINES = [format_line(step, {"loss": 2.0 + step / 10, "learning_rate": 1e-3}, now=NOW + step)
         for step in range(1, 7)]


def test_disk_full_then_freed_leaves_only_whole_lines(tmp_path):
    size = len(LINES[0]) + 1
    # room for two lines and half of the third; lines 3 and 4 hit the full disk
    data, outcome = write_through_full_disk(tmp_path, LINES, limit=2 * size + size // 2,
                                            free_after=4)
    # each cut line is truncated away, so the next one is cut (and undone) too
    assert outcome[:2] == ["ok", "ok"] and outcome[4:] == ["ok", "ok"]
    assert all("cut short" in message for message in outcome[2:4])
    assert data == "".join(line + "\n" for line in LINES[:2] + LINES[4:]).encode()
    rows = list(parse_lines(data.splitlines(keepends=True), require_line_end=True))
    assert [row.step for row in rows] == [1, 2, 5, 6]


def test_cut_line_that_cannot_be_undone_is_ended_before_the_next_one(tmp_path):
    """When the cut bytes cannot be truncated away (here: ftruncate refused), the next line
    starts on a fresh line and the parser reports the cut one instead of reading its values."""
    size = len(LINES[0]) + 1
    cut = 2 * size + 30          # the third line is cut inside its loss value
    data, outcome = write_through_full_disk(tmp_path, LINES, limit=cut, free_after=4,
                                            no_truncate=True)
    whole = "".join(line + "\n" for line in LINES[:2]).encode()
    fragment = (LINES[2] + "\n").encode()[:30]
    assert data == whole + fragment + ("\n" + LINES[4] + "\n" + LINES[5] + "\n").encode()
    assert outcome == ["ok", "ok", outcome[2], "File too large", "ok", "ok"]
    path = tmp_path / "m.log"
    report = ParseReport()
    rows = list(parse_file(path, report=report))
    assert [row.step for row in rows] == [1, 2, 5, 6]
    assert [p.line for p in report.problems] == [3]


@pytest.mark.parametrize("cut_at", [20, 31, 45, 60, 75, 90, -8, -2])
def test_any_cut_of_a_stamped_line_is_reported_never_read(tmp_path, cut_at):
    """A line cut anywhere (inside the loss, the lr, the time) is a problem, not a value."""
    line = LINES[2]
    fragment = line[:cut_at]
    report = ParseReport()
    rows = list(parse_lines([LINES[0] + "\n", LINES[1] + "\n", fragment + "\n",
                             LINES[3] + "\n"], report=report, require_line_end=True))
    assert [row.step for row in rows] == [1, 2, 4]
    assert report.problem_count == 1 and report.problems[0].line == 3


FIFO_WRITER = textwrap.dedent("""
    import json, os, sys
    from mfotel.sinks import FileSink
    fifo = sys.argv[1]
    try:
        FileSink(fifo)
        print(json.dumps(["opened"]))
    except OSError as exc:
        print(json.dumps(["no reader", exc.errno, str(exc)]))
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)     # a reader that never reads
    sink = FileSink(fifo)
    for count in range(1, 100_000):
        try:
            sink.write("[Monitor] step: %d, loss: 1.0" % count)
        except OSError as exc:
            print(json.dumps(["full", exc.errno, count]))
            break
""")


def test_a_fifo_at_the_file_path_fails_writes_instead_of_stalling_training(tmp_path):
    """Without a reader the open fails; with a reader that never reads, the write that does
    not fit fails: neither blocks (the child would hang past the timeout)."""
    import errno
    fifo = tmp_path / "m.log"
    os.mkfifo(fifo)
    done = subprocess.run([sys.executable, "-c", FIFO_WRITER, str(fifo)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    first, second = [json.loads(line) for line in done.stdout.splitlines()]
    assert first[:2] == ["no reader", errno.ENXIO]
    assert str(fifo) in first[2] and "no process reads" in first[2] and "file_path" in first[2]
    assert second[:2] == ["full", errno.EAGAIN] and second[2] > 100


# ---------------------------------------------------------------- the line writer's thread
class SlowList:
    """A sink that takes its time and remembers each line (and the thread that wrote it)."""

    def __init__(self, delay: float = 0.0) -> None:
        import threading
        self.lines: list[str] = []
        self.threads: set[str] = set()
        self.delay, self._current = delay, threading.current_thread

    def write(self, line: str) -> None:
        import time
        time.sleep(self.delay)
        self.lines.append(line)
        self.threads.add(self._current().name)


def _steps(lines: list[str]) -> list[int]:
    return [int(line.split(",")[0].split(": ")[1]) for line in lines]


def test_line_writer_writes_every_line_in_order_off_the_submitting_thread(tmp_path):
    slow, path = SlowList(delay=0.0005), tmp_path / "m.log"
    writer = sinks.LineWriter([(slow, False), (FileSink(path), True)], rank=2, job_name="j")
    for step in range(1, 301):
        writer.submit(step, 1, {"loss": step / 10}, NOW + step)
    assert writer.flush(30)                       # returns once all 300 are written
    assert _steps(slow.lines) == list(range(1, 301))
    assert slow.threads == {"mfotel-lines"}
    head, at = split_time(slow.lines[0])
    assert head == "[Monitor] step: 1, loss: 0.1" and at == pytest.approx(NOW + 1, abs=1e-3)
    for step in range(301, 401):                  # after a flush, and then close
        writer.submit(step, 1, {"loss": 1.0}, NOW)
    writer.close()
    assert _steps(slow.lines) == list(range(1, 401))
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 401))
    assert {(r["rank"], r["job_name"]) for r in records} == {(2, "j")}


def test_record_fields_go_to_the_files_and_the_console_keeps_the_seed_line(tmp_path):
    """The time account's fields (submit's `record`) are the files' (text and JSON), which
    `mfotel goodput` reads back; the console's line is the seed's."""
    console, text, records = SlowList(), tmp_path / "m.log", tmp_path / "m.jsonl"
    writer = sinks.LineWriter([(console, False), (FileSink(text), False),
                               (FileSink(records), True)], rank=0, job_name="j")
    assert writer.keeps_records and not sinks.LineWriter([(console, False)], 0, "j").keeps_records
    writer.submit(5, 1, {"loss": 0.5}, NOW, {"account_steps": 5.0, "account_step": 1.25})
    writer.close()
    assert split_time(console.lines[0])[0] == "[Monitor] step: 5, loss: 0.5"
    assert split_time(text.read_text().strip())[0] == \
        "[Monitor] step: 5, loss: 0.5, account_steps: 5, account_step: 1.250 s"
    record = json.loads(records.read_text())
    assert (record["loss"], record["account_steps"], record["account_step"]) == (0.5, 5.0, 1.25)
    row = next(iter(parse_lines([text.read_text().strip()])))
    assert row.account == {"account_steps": 5.0, "account_step": 1.25}


def test_line_writer_reports_a_failing_sink_and_still_feeds_the_others():
    class Broken:
        def write(self, line: str) -> None:
            raise OSError(28, "No space left on device")
    errors, good = [], SlowList()
    writer = sinks.LineWriter([(Broken(), False), (good, False)], 0, "j", errors.append)
    for step in (1, 2, 3):
        writer.submit(step, 0, {"loss": 1.0}, NOW)
    writer.close()
    assert _steps(good.lines) == [1, 2, 3]
    assert [e.errno for e in errors] == [28, 28, 28]


def test_after_close_lines_are_written_by_the_caller():
    good = SlowList()
    writer = sinks.LineWriter([(good, False)], 0, "j")
    writer.close()
    writer.submit(7, 0, {"loss": 1.0}, NOW)
    assert _steps(good.lines) == [7] and good.threads == {"MainThread"}


def test_a_sink_that_stops_taking_lines_bounds_the_queue(monkeypatch):
    import threading
    release = threading.Event()

    class Stuck:
        def write(self, line: str) -> None:
            release.wait(30)           # a console pipe nobody reads
    errors: list[BaseException] = []
    monkeypatch.setattr(sinks.LineWriter, "MAX_PENDING", 10)
    writer = sinks.LineWriter([(Stuck(), False)], 0, "j", errors.append)
    for step in range(1, 51):
        writer.submit(step, 0, {"loss": 1.0}, NOW)
    assert 30 <= writer.dropped <= 40 and len(errors) == writer.dropped   # counted, not queued
    assert not writer.flush(0.2)                                           # bounded wait
    release.set()
    writer.close()
