"""The files training reads after every step (control.json, schedule.json) can never block it.

A FIFO at the control path used to freeze training in open(). Every case runs under a
watchdog: if a read blocks, the watchdog opens the FIFO's other end to release it and the test
fails saying so, instead of hanging.
"""
from __future__ import annotations

import json
import logging
import os
import socket
from functools import partial
from pathlib import Path

import pytest

from mfotel.actions.control import (
    CONTROL_FILE,
    CONTROL_MAX_BYTES,
    SCHEDULE_FILE,
    FileWatch,
    Request,
    main,
    new_request,
    write_request,
)
from mfotel.actions.engine import ActionEngine
from mfotel.config import parse_config
from tests.support.hangs import bounded, release_fifo

WATCHDOG_SECONDS = 30


def make_fifo(path: Path) -> None:
    os.mkfifo(path)


def make_directory(path: Path) -> None:
    path.mkdir()


def make_socket(path: Path) -> None:
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(path))   # the socket file stays after the socket is closed
    sock.close()


def make_symlink_to_fifo(path: Path) -> None:
    os.mkfifo(path.with_name("elsewhere.fifo"))
    path.symlink_to(path.with_name("elsewhere.fifo"))


def make_symlink_to_device(path: Path) -> None:
    path.symlink_to("/dev/zero")   # endless: a reader without a type check never returns


def make_huge_file(path: Path) -> None:
    path.write_text(json.dumps({"id": "x", "action": "stop", "reason": "r" * CONTROL_MAX_BYTES}))


NOT_READABLE = {
    "fifo": (make_fifo, "is a FIFO (named pipe), not a regular file"),
    "directory": (make_directory, "is a directory, not a regular file"),
    "unix socket": (make_socket, "is a socket, not a regular file"),
    "symlink to a fifo": (make_symlink_to_fifo, "is a FIFO (named pipe)"),
    "symlink to /dev/zero": (make_symlink_to_device, "is a character device"),
    "oversized file": (make_huge_file, f"is larger than {CONTROL_MAX_BYTES} bytes"),
}


@pytest.mark.parametrize("kind", NOT_READABLE)
def test_the_control_reader_never_blocks_and_reports_each_problem_once(tmp_path, kind):
    path = tmp_path / CONTROL_FILE
    make, words = NOT_READABLE[kind]
    make(path)
    watch = FileWatch(path, CONTROL_MAX_BYTES)
    with pytest.raises(ValueError) as info:
        bounded(watch.poll, WATCHDOG_SECONDS, release_fifo(path))
    assert str(path) in str(info.value) and words in str(info.value)
    assert "Fix: remove it" in str(info.value)
    assert bounded(watch.poll, WATCHDOG_SECONDS, release_fifo(path)) == (False, None)  # once
    if path.is_dir() and not path.is_symlink():
        path.rmdir()
    else:
        path.unlink()
    write_request(tmp_path, Request("after", "stop"))     # a regular file works again
    changed, data = watch.poll()
    assert changed and data["id"] == "after"


def engines(tmp_path: Path, world: int = 1) -> tuple[list[ActionEngine], list[str]]:
    """`world` started engines of one job, and the stages their on_error saw."""
    cfg = parse_config({"actions": {"control_dir": str(tmp_path / "{job_name}")}}).actions
    errors: list[str] = []
    found = [ActionEngine(cfg, "job", rank, world, on_error=errors.append)
             for rank in range(world)]
    for engine in found:
        engine.start()
    return found, errors


def test_a_fifo_at_control_json_is_counted_once_and_a_later_request_applies(tmp_path, caplog):
    (tmp_path / "job").mkdir()
    make_fifo(tmp_path / "job" / CONTROL_FILE)
    with caplog.at_level(logging.WARNING, logger="mfotel"):
        # rank 0 looks for a stale request at start: the FIFO
        (engine,), errors = engines(tmp_path)
        for step in range(1, 20):
            applied = bounded(partial(engine.step_end, step, 1.0, True), WATCHDOG_SECONDS,
                              release_fifo(tmp_path / "job" / CONTROL_FILE))
            assert applied == []
    assert engine.errors == 1 and errors == ["control"]
    warnings = [r.getMessage() for r in caplog.records if "FIFO" in r.getMessage()]
    assert len(warnings) == 1 and 'mfotel_export_errors_total{stage="control"}' in warnings[0]
    assert main([str(tmp_path / "job"), "--stop"]) == 0     # replaces the FIFO atomically
    assert [r.action for r in engine.step_end(20, 1.0, True)] == ["stop"]


def test_a_fifo_at_schedule_json_does_not_block_the_other_ranks(tmp_path):
    (rank0, rank1), _ = engines(tmp_path, world=2)
    schedule = tmp_path / "job" / SCHEDULE_FILE
    schedule.unlink()
    make_fifo(schedule)
    for step in range(1, 10):
        assert bounded(partial(rank1.step_end, step, 1.0, True), WATCHDOG_SECONDS,
                       release_fifo(schedule)) == []
    assert rank1.errors == 1
    schedule.unlink()
    write_request(tmp_path / "job", new_request("stop"))
    rank0.step_end(10, 1.0, True)                 # rank 0 schedules the stop for step 13
    assert [r.step for r in rank1.step_end(13, 1.0, True)] == [13]


def test_a_schedule_that_cannot_be_written_is_counted_not_raised(tmp_path, caplog):
    (engine,), _ = engines(tmp_path)
    schedule = tmp_path / "job" / SCHEDULE_FILE
    schedule.unlink()
    schedule.mkdir()                               # os.replace cannot put a file there
    write_request(tmp_path / "job", new_request("stop"))
    with caplog.at_level(logging.WARNING, logger="mfotel"):
        applied = engine.step_end(1, 1.0, True)
    assert [r.action for r in applied] == ["stop"]   # a single rank applies it anyway
    assert engine.errors == 1 and "cannot write" in caplog.text


def test_control_show_does_not_block_on_a_fifo(tmp_path, capsys):
    make_fifo(tmp_path / CONTROL_FILE)
    assert bounded(lambda: main([str(tmp_path), "--show"]), WATCHDOG_SECONDS,
                   release_fifo(tmp_path / CONTROL_FILE)) == 0
    assert "is a FIFO (named pipe), not a regular file" in capsys.readouterr().out


def test_a_request_with_line_breaks_in_its_reason_logs_one_line(tmp_path, caplog):
    (engine,), _ = engines(tmp_path)
    write_request(tmp_path / "job", new_request(
        "warn", reason="ok\nmfotel: step 9: stop (source control) on rank 0"))
    with caplog.at_level(logging.WARNING, logger="mfotel"):
        engine.step_end(1, 1.0, True)
    (line,) = [r.getMessage() for r in caplog.records if "warn (source control" in r.getMessage()]
    assert "\n" not in line and r"ok\nmfotel: step 9" in line
