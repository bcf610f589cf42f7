"""Monitor line formats (text as the seed writes it plus its time, strict JSON lines) and the
file sink's whole-line writes under a real full disk (RLIMIT_FSIZE in a child process)."""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import textwrap
from datetime import datetime

import pytest

from mfotel import sinks
from mfotel.logs.parse import ParseReport, parse_file, parse_lines
from mfotel.sinks import FileSink, format_json, format_line

NOW = 1_764_671_400.123
ISO_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d\d:\d\d")


def split_time(line: str) -> tuple[str, float]:
    """(the line before its time field, the unix time the field says)."""
    head, sep, stamp = line.rpartition(", time: ")
    assert sep and ISO_TIME.fullmatch(stamp), line
    return head, datetime.fromisoformat(stamp).timestamp()


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


DISK_FULL_RUN = textwrap.dedent("""
    import json, resource, signal, sys
    from mindspore.train import Callback
    from mfotel.demo.training import run_demo
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.RLIM_INFINITY))

    class FreeTheDisk(Callback):
        def on_train_step_end(self, run_context):
            if run_context.original_args().cur_step_num == int(sys.argv[2]):
                resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)

    result = run_demo(steps=int(sys.argv[1]), port=0, metrics=["loss", "learning_rate"],
                      linger_seconds=0, lr_schedule="constant",
                      output={"console": False, "file": True, "file_path": "full/m.log"},
                      extra_callbacks=(FreeTheDisk(),))
    print(json.dumps({"losses": {str(k): v for k, v in result.losses.items()},
                      "errors": result.monitor.instruments.state.export_errors}))
""")


@pytest.mark.slow
def test_training_through_a_full_disk_writes_whole_lines_only(tmp_path):
    """A real run fills its 1 KiB "disk", which is freed at step 30: the file holds whole lines
    of the steps before and after, each with the step's real loss, and nothing else."""
    done = subprocess.run([sys.executable, "-c", DISK_FULL_RUN, "40", "30"], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    losses = {int(step): loss for step, loss in result["losses"].items()}
    data = (tmp_path / "full" / "m.log").read_bytes()
    text = data.decode()
    assert text.endswith("\n") and "\n\n" not in text
    lines = text.splitlines()
    steps = []
    for line in lines:
        head, at = split_time(line)
        step = int(head.split(",")[0].removeprefix("[Monitor] step: "))
        assert head == (f"[Monitor] step: {step}, loss: {sinks.format_value('loss', losses[step])}"
                        f", learning_rate: 1.000000e-02")
        assert math.isfinite(at)
        steps.append(step)
    before = [s for s in steps if s <= 30]
    assert before == list(range(1, len(before) + 1)) and 0 < len(before) < 30
    assert steps[len(before):] == list(range(31, 41))
    assert len(text[:sum(len(x) + 1 for x in lines[:len(before)])]) <= 1024
    assert result["errors"]["sink"] == 30 - len(before)
    report = ParseReport()
    assert [r.step for r in parse_file(tmp_path / "full" / "m.log", report=report)] == steps
    assert report.problem_count == 0


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
