"""The progress bar of long parses: drawn when stderr is a terminal (the real CLI in a child
process whose stderr is a pseudo-terminal), never in a pipe or with --quiet."""
from __future__ import annotations

import fcntl
import os
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from mfotel.sinks import format_line
from tests.support.paths import FIXTURES

pytestmark = pytest.mark.slow

LINES = 200_000     # parses in seconds: longer than the bar's 0.5 s delay, even on a fast machine


@pytest.fixture(scope="module")
def big_log(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("big") / "train_monitor.log"
    with open(path, "w", encoding="utf-8") as out:
        for step in range(1, LINES + 1):
            out.write(format_line(step, {"loss": 2.0 + 1.0 / step, "learning_rate": 1e-4,
                                         "throughput": 1000.0}, now=1.7e9 + step) + "\n")
    return path


def run_cli(args: list[str], tty: bool, cwd: Path) -> tuple[int, str]:
    """(exit code, everything written to stderr) of `python -m mfotel ARGS`, stderr being a
    pseudo-terminal (80x24) or a pipe."""
    command = [sys.executable, "-m", "mfotel", *args]
    env = {**os.environ, "COLUMNS": "80"}
    if not tty:
        done = subprocess.run(command, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=600)
        return done.returncode, done.stderr.decode("utf-8", "replace")
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    try:
        process = subprocess.Popen(command, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                   stdout=subprocess.DEVNULL, stderr=slave)
    finally:
        os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + 600
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                if process.poll() is not None:
                    break
                continue
            try:
                data = os.read(master, 65536)
            except OSError:          # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        code = process.wait(timeout=60)
    finally:
        os.close(master)
        if process.poll() is None:
            process.kill()
    return code, b"".join(chunks).decode("utf-8", "replace")


@pytest.mark.parametrize("command", [["summary", "{log}", "-o", "{out}/s.md"],
                                     ["backfill", "{log}", "--out", "{out}"]])
def test_progress_bar_on_a_terminal(big_log: Path, tmp_path: Path, command) -> None:
    args = [part.format(log=big_log, out=tmp_path) for part in command]
    code, terminal = run_cli(args, tty=True, cwd=tmp_path)
    assert code == 0, terminal[-2000:]
    assert "parsing:" in terminal and "\r" in terminal
    assert "%|" in terminal and "B/s" in terminal        # tqdm's bar: percentage and rate
    assert f"{LINES} rows from {LINES} lines" in terminal or "wrote" in terminal


def test_no_progress_bar_in_a_pipe_or_when_quiet(big_log: Path, tmp_path: Path) -> None:
    args = ["summary", str(big_log), "-o", str(tmp_path / "s.md")]
    code, piped = run_cli(args, tty=False, cwd=tmp_path)
    assert code == 0, piped[-2000:]
    assert "parsing:" not in piped and "\r" not in piped and "%|" not in piped
    assert f"{LINES} rows from {LINES} lines" in piped      # the notes still come
    code, quiet = run_cli([*args, "-q"], tty=True, cwd=tmp_path)
    assert code == 0 and "parsing:" not in quiet and "%|" not in quiet


def test_no_progress_bar_flashes_for_a_quick_parse_on_a_terminal(tmp_path: Path) -> None:
    small = FIXTURES / "logs" / "demo-text"
    code, terminal = run_cli(["summary", str(small), "-o", str(tmp_path / "s.md")], tty=True,
                             cwd=tmp_path)
    assert code == 0, terminal[-2000:]
    assert "parsing:" not in terminal and "%|" not in terminal
    assert "30 rows from 30 lines" in terminal
