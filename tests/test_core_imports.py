"""The core imports without MindSpore or mindformers (they are optional extras)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BLOCK = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("mindspore", "mindformers"):
            raise ImportError(f"{name} is blocked for this test")
sys.meta_path.insert(0, Block())
import mfotel, mfotel.cli, mfotel.config, mfotel.telemetry, mfotel.instruments, mfotel.logs.parse
import mfotel.alerting.rules, mfotel.actions.engine, mfotel.actions.control, mfotel.cluster.discovery, mfotel.alerting.receiver
import mfotel.ui
cfg = mfotel.parse_config({"step_interval": 5})
assert cfg.step_interval == 5
try:
    mfotel.OTelMonitor
except ImportError as exc:
    print("callback needs mindspore:", exc)
assert mfotel.cli.main(["rules", "--out", sys.argv[1], "--check"]) == 0
print("ok")
"""


def test_core_imports_without_mindspore():
    rules_dir = Path(__file__).resolve().parents[1] / "prometheus" / "rules"
    done = subprocess.run([sys.executable, "-c", BLOCK, str(rules_dir)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "ok"
    assert "callback needs mindspore: mindspore" in done.stdout


CORE = ("config", "contract", "extract", "instruments", "telemetry", "exposition", "sinks",
        "identity", "webconfig", "cells", "callback", "lifecycle")
OPTIONAL = ("cluster", "alerting", "actions", "logs", "integrations", "demo", "dashboards", "ui")


def test_core_never_imports_the_optional_parts():
    """Imports run one way: the optional subpackages are loaded only when configured."""
    code = ("import sys\n"
            + "".join(f"import mfotel.{name}\n" for name in CORE)
            + "loaded = sorted({m.split('.')[1] for m in sys.modules if m.startswith('mfotel.')})\n"
            + "print(' '.join(loaded))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = set(done.stdout.split())
    assert set(CORE) <= loaded
    assert not loaded & set(OPTIONAL), f"core imported optional parts: {loaded & set(OPTIONAL)}"


def test_a_run_configured_without_optional_parts_never_loads_them(tmp_path):
    """A real training run with the defaults (endpoint on, no file_sd, actions, OTLP or fast
    path) loads none of the optional subpackages but the demo that drives it and the live page
    (on by default: `prometheus.ui`)."""
    from mfotel.demo.stack import free_port
    code = ("import sys\n"
            "from mfotel.demo.training import run_demo\n"
            f"run_demo(steps=4, port={free_port()}, linger_seconds=0, output={{'console': False}})\n"
            "print(' '.join(sorted({m.split('.')[1] for m in sys.modules "
            "if m.startswith('mfotel.')})))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    loaded = set(done.stdout.split())
    assert "callback" in loaded
    assert "ui" in loaded
    assert not loaded & (set(OPTIONAL) - {"demo", "ui"}), loaded
