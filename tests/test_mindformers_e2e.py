"""The real mindformers Trainer on CPU, launched through `mfotel-instrument`, scraped while it runs.

Tiny Llama (examples/mindformers), 20 steps in graph mode, the issue's callback entry. What
/metrics shows must equal what MFLossMonitor and TrainingStateMonitor logged for the same steps.
"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
import urllib.error
from pathlib import Path
from typing import NamedTuple

import pytest
import yaml

from conftest import samples, scrape, value

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "mindformers"
STEPS = 20
JOB = "tiny-llama-e2e"
WQ0 = "model.layers.0.attention.wq.weight"

LOSS_LINE = re.compile(
    r"step:\[\s*(?P<step>\d+)/\s*\d+\], loss:\[(?P<loss>[-\d.]+)/[-\d.]+\], "
    r"per_step_time: \d+ms, lr: (?P<lr>[-\d.e]+), overflow cond: (?P<overflow>\w+), "
    r"loss_scale: (?P<scale>[-\d.e]+), global_norm: \[(?P<norm>[-\d.e]+)\]")
NATIVE_LINE = re.compile(r"_to_log: Epoch:\[\s*\d+/\s*\d+\], step:\[\s*(?P<step>\d+)/\s*\d+\] "
                         r"(?P<tag>\S+): (?P<value>\S+)$")

pytestmark = pytest.mark.slow


def issue_config(port: int) -> dict:
    """The example YAML with the issue's OTelMonitor entry, plus a loopback port and a linger."""
    config = yaml.safe_load((EXAMPLE / "tiny_llama_cpu.yaml").read_text())
    config["callbacks"] = [
        {"type": "MFLossMonitor"},
        {"type": "OTelMonitor", "step_interval": 10,
         "metrics": ["loss", "learning_rate", "grad_norm", "throughput", "step_time"],
         "output": {"console": True, "file": True,
                    "file_path": "./monitor_logs/train_monitor_{rank}.log"},
         "log_rank": 0, "job_name": JOB,
         "prometheus": {"host": "127.0.0.1", "port": port, "linger_seconds": 60}},
    ]
    config["train_dataset"]["data_loader"]["num_samples"] = STEPS * config["train_dataset"]["batch_size"]
    return config


def issue_yaml(tmp_path: Path, port: int) -> Path:
    return write_yaml(tmp_path / "tiny_llama_issue.yaml", issue_config(port))


def write_yaml(path: Path, config: dict) -> Path:
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


class Trained(NamedTuple):
    snapshots: list[dict]   # every scrape while it ran, the last one with status completed
    info_log: str           # output/log/rank_0/info.log (MFLossMonitor's lines)
    console: str
    seconds: float


def train(tmp_path: Path, config: Path, port: int, every: float = 0.05) -> Trained:
    """Run the example with `config` in `tmp_path` through `mfotel-instrument`; scrape /metrics
    every `every` seconds until the run reports completed, then stop it (it lingers)."""
    # not imported here (it writes ./output); a test dependency: fail, never skip
    assert importlib.util.find_spec("mindformers"), 'pip install -e ".[mindformers]"'
    env = {k: v for k, v in os.environ.items() if k not in ("LOG_MF_PATH", "LOCAL_DEFAULT_PATH")}
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    env["MFOTEL_INSTRUMENT_DIR"] = str(tmp_path / "boot")
    env.setdefault("GLOG_v", "3")
    command = [str(Path(bin_dir, "mfotel-instrument")), sys.executable,
               str(EXAMPLE / "run_tiny_llama.py"), "--config", str(config)]
    url = f"http://127.0.0.1:{port}/metrics"
    snapshots: list[dict] = []
    started = time.monotonic()
    with open(tmp_path / "console.log", "w") as console:
        process = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=console,
                                   stderr=subprocess.STDOUT)
        try:
            while time.monotonic() - started < 300:
                if process.poll() is not None:
                    break
                try:
                    body = samples(scrape(url))
                except (urllib.error.URLError, ConnectionError, TimeoutError):
                    time.sleep(0.2)
                    continue
                snapshots.append(body)
                if value(body, "mindformers_train_status") == 2:
                    break
                time.sleep(every)
        finally:
            seconds = time.monotonic() - started
            process.terminate()  # it lingers 60 s for scrapers; we have what we need
            process.wait(timeout=30)
    console_text = (tmp_path / "console.log").read_text(errors="replace")
    info_log = tmp_path / "output" / "log" / "rank_0" / "info.log"
    assert snapshots and info_log.exists(), console_text[-5000:]
    return Trained(snapshots, info_log.read_text(errors="replace"), console_text, seconds)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Train once; scrape /metrics every 50 ms until the run reports completed."""
    from mfotel.demo.stack import free_port
    tmp_path = tmp_path_factory.mktemp("mindformers-e2e")
    port = free_port()
    trained = train(tmp_path, issue_yaml(tmp_path, port), port)
    print(f"\nmindformers e2e: {STEPS} steps, {trained.seconds:.1f} s to completed, "
          f"{len(trained.snapshots)} scrapes")
    return tmp_path, trained.snapshots, trained.info_log, trained.console


def logged(info_log: str) -> tuple[dict[int, dict], dict[int, dict[str, float]]]:
    loss_lines = {int(m["step"]): m.groupdict() for m in map(LOSS_LINE.search, info_log.splitlines())
                  if m}
    native: dict[int, dict[str, float]] = {}
    for m in map(NATIVE_LINE.search, info_log.splitlines()):
        if m:
            native.setdefault(int(m["step"]), {})[m["tag"]] = float(m["value"])
    return loss_lines, native


def test_the_run_trains_every_step_and_is_scraped_while_running(run):
    _, snapshots, info_log, console = run
    loss_lines, _ = logged(info_log)
    assert sorted(loss_lines) == list(range(1, STEPS + 1)), console[-3000:]
    running = [s for s in snapshots if value(s, "mindformers_train_status") == 1]
    assert running, "no scrape saw the run in progress"
    final = snapshots[-1]
    assert value(final, "mindformers_train_status") == 2
    assert value(final, "mindformers_train_step", job_name=JOB, rank="0") == STEPS
    assert value(final, "mindformers_train_steps_total") == STEPS


def test_seed_metrics_equal_what_mfloss_monitor_logged(run):
    _, snapshots, info_log, _ = run
    loss_lines, _ = logged(info_log)
    final, last = snapshots[-1], loss_lines[STEPS]
    assert value(final, "mindformers_train_loss") == pytest.approx(float(last["loss"]), abs=1e-6)
    assert value(final, "mindformers_train_learning_rate") == pytest.approx(float(last["lr"]), rel=1e-6)
    assert value(final, "mindformers_train_grad_norm") == pytest.approx(float(last["norm"]), rel=1e-6)
    assert value(final, "mindformers_train_loss_scale") == float(last["scale"])
    assert value(final, "mindformers_train_overflow_total") == sum(
        line["overflow"] == "True" for line in loss_lines.values())


def test_scrapes_during_the_run_hold_the_last_recorded_step(run):
    _, snapshots, info_log, _ = run
    loss_lines, _ = logged(info_log)
    for body in snapshots:
        step, loss = value(body, "mindformers_train_step"), value(body, "mindformers_train_loss")
        if step is None or loss is None:
            continue
        recorded = [r for r in range(10, STEPS + 1, 10) if r <= step]
        assert any(loss == pytest.approx(float(loss_lines[r]["loss"]), abs=1e-6) for r in recorded), \
            (step, loss)


def test_native_metrics_are_exposed_with_their_labels(run):
    _, snapshots, info_log, _ = run
    _, native = logged(info_log)
    final, at_end = snapshots[-1], native[STEPS]
    assert value(final, "mindformers_train_weight_norm", job_name=JOB, rank="0") == \
        pytest.approx(at_end["weight_norm"], rel=1e-9)
    for state in ("adam_m", "adam_v"):
        assert value(final, "mindformers_train_optimizer_state_norm", param=WQ0, state=state) == \
            pytest.approx(at_end[f"{state}_norm/{WQ0}"], rel=1e-9)
    assert value(final, "mindformers_train_throughput_linearity") == \
        pytest.approx(at_end["throughput_linearity"], rel=1e-9)
    assert value(final, "mindformers_train_device_local_loss", loss="lm") == \
        pytest.approx(at_end["device_accum_local_lm_loss"], rel=1e-6)
    assert value(final, "mindformers_train_weight_stable_rank", param=WQ0) == \
        pytest.approx(native[STEPS][f"weight_stable_rank/{WQ0}"], rel=1e-6)
    assert value(final, "mindformers_train_local_norm", param=WQ0) > 0
    assert value(final, "mindformers_train_iteration_time_seconds") > 0


def test_native_target_filter_is_honoured(run):
    _, snapshots, _, _ = run
    final = snapshots[-1]
    for name in ("mindformers_train_optimizer_state_norm", "mindformers_train_local_norm",
                 "mindformers_train_weight_stable_rank"):
        params = {dict(labels)["param"] for (n, labels) in final if n == name}
        assert params, name
        assert all(p.startswith("model.layers.0.") or p == "model.norm_out.weight" for p in params), \
            (name, params)
    stable = {dict(labels)["param"] for (n, labels) in final
              if n == "mindformers_train_weight_stable_rank"}
    assert stable == {WQ0}  # stable_rank_config.target, which mindformers skips in stand-alone runs


def test_monitor_file_has_the_record_steps(run):
    tmp_path, _, _, _ = run
    lines = (tmp_path / "monitor_logs" / "train_monitor_0.log").read_text().splitlines()
    assert [line.split(",")[0] for line in lines] == ["[Monitor] step: 10", "[Monitor] step: 20"]
