"""The log tools on the directories real runs leave behind: the README's demo run
(`--file-path monitor_logs/m.log`) and a mindformers output directory, where mfotel's monitor
file and mindformers' info.log are both read and told apart."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mfotel.logs.cli import main as logs_main
from mfotel.logs.parse import discover
from tests.support.paths import ROOT

EXAMPLE = ROOT / "examples" / "mindformers"

pytestmark = pytest.mark.slow


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The installed `mfotel` command, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "mfotel", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


def table_rows(markdown: str) -> list[list[str]]:
    """Cells of the table lines below the header of a `mfotel summary` table."""
    lines = [line for line in markdown.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[1:]]


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


@pytest.fixture(scope="module")
def mindformers_run(tmp_path_factory) -> Path:
    """The tiny Llama example (20 steps, MFLossMonitor every step) with its OTelMonitor entry
    writing monitor_logs/train_monitor_0.log every 10 steps; /metrics off."""
    assert importlib.util.find_spec("mindformers"), 'pip install -e ".[mindformers]"'
    workdir = tmp_path_factory.mktemp("mindformers-logs")
    config = yaml.safe_load((EXAMPLE / "tiny_llama_cpu.yaml").read_text())
    for entry in config["callbacks"]:
        if entry["type"] == "OTelMonitor":
            entry["prometheus"] = {"port": 0}
            entry["output"]["console"] = False
    path = workdir / "tiny_llama.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    env = {k: v for k, v in os.environ.items() if k not in ("LOG_MF_PATH", "LOCAL_DEFAULT_PATH")}
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    env["MFOTEL_INSTRUMENT_DIR"] = str(workdir / "boot")
    env.setdefault("GLOG_v", "3")
    done = subprocess.run([str(Path(bin_dir, "mfotel-instrument")), sys.executable,
                           str(EXAMPLE / "run_tiny_llama.py"), "--config", str(path)],
                          cwd=workdir, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]
    return workdir


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def test_mindformers_output_dir_reads_info_log_and_monitor_file_side_by_side(
        mindformers_run: Path) -> None:
    info = mindformers_run / "output" / "log" / "rank_0" / "info.log"
    monitor = mindformers_run / "monitor_logs" / "train_monitor_0.log"
    # independent readers of the two files
    mf_throughput = [float(m) for m in re.findall(r"([\d.]+) samples/s/p", info.read_text())]
    mf_steps = re.findall(r"step:\[\s*(\d+)/\s*\d+\], loss", info.read_text())
    monitor_lines = monitor.read_text().splitlines()
    mfotel_throughput = [float(re.search(r"throughput: ([-+.\deE]+)", line).group(1))
                         for line in monitor_lines]
    assert len(mf_steps) == len(mf_throughput) == 20 and len(monitor_lines) == 2

    run = discover(mindformers_run)
    assert run.kinds[monitor] == "monitor" and run.kinds[info] == "mindformers-info"
    out = mindformers_run / "summary.md"
    assert logs_main(["summary", str(mindformers_run), "-o", str(out), "-q"]) == 0
    text = out.read_text()
    rows = {row[1]: row for row in table_rows(text)}
    assert set(rows) == {"mfotel-text", "mindformers-info"}
    assert rows["mfotel-text"][2:4] == ["2", "10..20"]
    assert rows["mindformers-info"][2:4] == ["20", "1..20"]
    assert float(rows["mfotel-text"][-1]) == pytest.approx(mean(mfotel_throughput), rel=1e-5)
    assert float(rows["mindformers-info"][-1]) == pytest.approx(mean(mf_throughput), rel=1e-5)
    assert "per device (`samples/s/p`)" in text and "over the record interval" in text


def test_mindformers_output_dir_plots_both_sources(mindformers_run: Path) -> None:
    from mfotel.logs import plot
    from mfotel.logs.parse import discover_runs, iter_rows
    figure = plot.build_figure(plot.collect(iter_rows(discover_runs([mindformers_run]))))
    name = mindformers_run.name
    labels = {t.get_text() for t in figure.legends[0].get_texts()}
    assert labels == {f"{name} (mfotel-text)", f"{name} (mindformers-info)"}
    loss = [ax for ax in figure.axes if ax.get_title() == "loss"][0]
    points = {line.get_gid(): len(line.get_xdata()) for line in loss.lines
              if (line.get_gid() or "").endswith("/raw")}
    assert points == {f"{name}/0/mfotel-text/loss/raw": 2,
                      f"{name}/0/mindformers-info/loss/raw": 20}
    out = plot.save(figure, mindformers_run / "curves.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
