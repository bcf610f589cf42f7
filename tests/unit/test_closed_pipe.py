"""Every command ends quietly when its reader goes away (`mfotel check f.yaml | head -3`):
exit status 141 (or 0), never a BrokenPipeError traceback. Each runs as a user runs it, a
subprocess writing into a real pipe whose reading end is closed early."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mfotel.cli import build_parser
from mfotel.closed_pipe import EXIT_CLOSED_PIPE, quiet_on_closed_pipe
from tests.support.paths import FIXTURES, ROOT

BIN = Path(sys.executable).parent
LOGS = FIXTURES / "logs"
NOISE = ("Traceback", "BrokenPipeError", "Exception ignored")


def through_closed_pipe(argv: list[str], cwd: Path, stream: str = "stdout",
                        timeout: float = 120) -> tuple[int, str]:
    """Run `argv` with `stream` (stdout or stderr) writing into a pipe whose reader has already
    gone; (exit status, what it wrote on the other stream)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    other = subprocess.PIPE
    streams = {"stdout": write_end, "stderr": other} if stream == "stdout" else \
        {"stdout": other, "stderr": write_end}
    try:
        done = subprocess.run(argv, cwd=cwd, timeout=timeout, text=True, **streams)
    finally:
        os.close(write_end)
    return done.returncode, (done.stderr if stream == "stdout" else done.stdout) or ""


def assert_quiet(status: int, text: str, argv: list[str]) -> None:
    assert status in (0, EXIT_CLOSED_PIPE), (argv, status, text[-2000:])
    assert not any(word in text for word in NOISE), (argv, text[-2000:])


def mfotel(*args: str) -> list[str]:
    return [str(BIN / "mfotel"), *args]


def subcommands() -> list[str]:
    parser = build_parser()
    action = next(a for a in parser._subparsers._group_actions)   # type: ignore[union-attr]
    return sorted(action.choices)


def test_every_subcommand_is_listed():
    assert {"check", "schema", "demo", "rules", "assets", "alerts-receiver", "plot", "export",
            "backfill", "summary", "control", "targets", "simulate"} <= set(subcommands())


@pytest.mark.parametrize("command", subcommands())
def test_help_of_every_subcommand_through_a_closed_pipe(command, tmp_path):
    argv = mfotel(command, "--help")
    assert_quiet(*through_closed_pipe(argv, tmp_path), argv)


def _big_json_log(directory: Path) -> Path:
    """A JSON monitor log whose CSV export is far larger than a pipe's buffer (64 KiB)."""
    run = directory / "big-run"
    run.mkdir()
    with open(run / "train_monitor.jsonl", "w") as out:
        for step in range(1, 5001):
            out.write(json.dumps({"time": 1796208000.0 + step, "job_name": "big", "rank": 0,
                                  "step": step, "loss": 1.0 / step, "learning_rate": 1e-3,
                                  "grad_norm": 0.5, "step_time": 0.01}) + "\n")
    return run


COMMANDS = {
    "version": ["--version"],
    "help": ["--help"],
    "check": ["check", str(ROOT / "examples" / "monitor_config.yaml")],
    "schema": ["schema"],
    "rules": ["rules", "--out", "rules"],
    "dashboards": ["dashboards", "--out", "dashboards"],
    "alertmanager-config": ["alertmanager-config", "--out", "am"],
    "assets": ["assets", "--out", "all"],
    "targets": ["targets", "--hosts", "a,b", "--ranks-per-node", "2", "--port", "9464"],
    "control": ["control", "jobdir", "--stop"],
    "summary": ["summary", str(LOGS / "demo-json")],
    "export": ["export", str(LOGS / "demo-json"), "--csv", "-"],
    "plot": ["plot", str(LOGS / "demo-json"), "-o", "curves.png"],
    "backfill": ["backfill", str(LOGS / "demo-json"), "--out", "backfill"],
}


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_output_of_every_command_through_a_closed_pipe(name, tmp_path):
    (tmp_path / "jobdir").mkdir()
    argv = mfotel(*COMMANDS[name])
    status, stderr = through_closed_pipe(argv, tmp_path)
    assert_quiet(status, stderr, argv)
    if name in ("check", "schema", "summary", "export", "targets"):
        assert status == EXIT_CLOSED_PIPE, (argv, stderr)    # they did write to stdout


@pytest.mark.parametrize("name", ["check-error", "backfill", "alerts-receiver"])
def test_a_closed_stderr_is_quiet_too(name, tmp_path):
    """`mfotel check bad.yaml 2>&1 | head -1`: the errors go to stderr, which is closed."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("monitor_config:\n  metrics: [loss, gradnorm]\n")
    argv = mfotel(*{"check-error": ["check", str(bad)],
                    "backfill": ["backfill", str(LOGS / "demo-json"), "--out", "b"],
                    # it says where it listens on stderr before serving: ends right there
                    "alerts-receiver": ["alerts-receiver", "--port", "0"]}[name])
    status, stdout = through_closed_pipe(argv, tmp_path, stream="stderr", timeout=60)
    assert status == EXIT_CLOSED_PIPE, (argv, status, stdout)
    assert not any(word in stdout for word in NOISE)


def test_a_reader_that_reads_a_little_then_leaves(tmp_path):
    """`mfotel export RUN --csv - | head -c 16`: the reader goes away in the middle."""
    argv = mfotel("export", str(_big_json_log(tmp_path)), "--csv", "-")
    with subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        head = proc.stdout.read(16)
        proc.stdout.close()
        stderr = proc.stderr.read().decode()
        status = proc.wait(timeout=120)
    assert head.startswith(b"run,")
    assert status == EXIT_CLOSED_PIPE and not any(word in stderr for word in NOISE), stderr


def test_log_tools_module_entry_point(tmp_path):
    argv = [sys.executable, "-m", "mfotel.logs.cli", "summary", str(LOGS / "demo-json")]
    status, stderr = through_closed_pipe(argv, tmp_path)
    assert status == EXIT_CLOSED_PIPE and not any(word in stderr for word in NOISE), stderr


@pytest.mark.parametrize("args", [["--help"], []])
def test_mfotel_instrument_own_output(args, tmp_path):
    """Its usage (on --help, exit 0; without a command, exit 2) through a closed pipe."""
    argv = [str(BIN / "mfotel-instrument"), *args]
    status, stderr = through_closed_pipe(argv, tmp_path)
    assert status in (0, 2, EXIT_CLOSED_PIPE) and not any(word in stderr for word in NOISE), \
        (status, stderr)


@pytest.mark.slow
def test_demo_through_a_closed_pipe(tmp_path):
    """The demo prints its addresses first: with nobody reading, it ends there, quietly."""
    argv = mfotel("demo", "--steps", "3", "--port", "0", "--step-sleep", "0")
    status, stderr = through_closed_pipe(argv, tmp_path, timeout=300)
    assert status == EXIT_CLOSED_PIPE and not any(word in stderr for word in NOISE), stderr


def test_a_broken_pipe_of_a_socket_is_not_hidden():
    """Only a closed stdout/stderr is quiet: a client hanging up on a server is an error."""
    @quiet_on_closed_pipe
    def serve() -> int:
        raise BrokenPipeError("peer went away")
    with pytest.raises(BrokenPipeError):
        serve()


def test_the_wrapper_returns_what_the_command_returns():
    assert quiet_on_closed_pipe(lambda: 3)() == 3
