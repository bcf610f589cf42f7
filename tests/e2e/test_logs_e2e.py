"""The log tools on the directory a real run leaves behind: the README's demo run
(`--file-path monitor_logs/m.log`). A mindformers output directory, where mfotel's monitor
file and mindformers' info.log are both read and told apart: tests/e2e/test_mindformers_e2e.py
(on its run)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cli import table_rows

pytestmark = pytest.mark.slow


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The installed `mfotel` command, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "mfotel", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300)




def test_readme_demo_run_is_found_by_content_and_summarised(tmp_path: Path) -> None:
    """README: `mfotel demo ... --file-path monitor_logs/m.log`, then `mfotel summary DIR`."""
    demo = cli("demo", "--steps", "40", "--step-interval", "5", "--port", "0",
               "--file-path", "monitor_logs/m.log", cwd=tmp_path)
    assert demo.returncode == 0, demo.stderr[-3000:]
    log = tmp_path / "monitor_logs" / "m.log"
    logged = [line for line in log.read_text().splitlines()]
    assert len(logged) == 8
    summary = cli("summary", str(tmp_path), cwd=tmp_path)
    assert summary.returncode == 0, summary.stderr
    (row,) = table_rows(summary.stdout)
    assert row[:4] == ["0", "mfotel-text", "8", "5..40"]
    first_loss = re.search(r"loss: ([^,]+),", logged[0]).group(1)
    last_loss = re.search(r"loss: ([^,]+),", logged[-1]).group(1)
    assert row[4:6] == [first_loss, last_loss]
    assert f"`{log}` (monitor)" in summary.stdout
