"""Run mfotel's commands as a user runs them: subprocesses of this interpreter."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mfotel.node import instrument
from tests.support.waiting import PYTHON_START_SECONDS, settle

#: The `mfotel-instrument` launcher.
INSTRUMENT = [sys.executable, "-m", "mfotel.node.instrument"]


def mfotel(*args: str, cwd: Path | str | None = None, timeout: float = 300,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m mfotel ARGS`; output captured as text."""
    return subprocess.run([sys.executable, "-m", "mfotel", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout, env=env)


def run(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    """`args` with its output captured; bounded as a process importing MindSpore and
    mindformers (5 + 8 s quiet) on this machine's load."""
    return subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=settle(PYTHON_START_SECONDS + 8))


def instrument_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """A clean environment whose `mfotel-instrument` bootstrap directory lives in tmp_path."""
    monkeypatch.setenv(instrument.ENV_DIR, str(tmp_path / "boot"))
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.setenv("LOG_MF_PATH", str(tmp_path / "mindformers-log"))
    return dict(os.environ)


def table_rows(markdown: str) -> list[list[str]]:
    """Cells of the table lines below the header of a `mfotel summary` table."""
    lines = [line for line in markdown.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[1:]]
