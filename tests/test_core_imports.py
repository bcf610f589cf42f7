"""The core imports without MindSpore or mindformers (they are optional extras)."""
from __future__ import annotations

import subprocess
import sys

BLOCK = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("mindspore", "mindformers"):
            raise ImportError(f"{name} is blocked for this test")
sys.meta_path.insert(0, Block())
import mfotel, mfotel.cli, mfotel.config, mfotel.telemetry, mfotel.instruments, mfotel.logs
import mfotel.rules, mfotel.actions, mfotel.control, mfotel.discovery, mfotel.alerts_receiver
cfg = mfotel.parse_config({"step_interval": 5})
assert cfg.step_interval == 5
try:
    mfotel.OTelMonitor
except ImportError as exc:
    print("callback needs mindspore:", exc)
assert mfotel.cli.main(["rules", "--check"]) == 0
print("ok")
"""


def test_core_imports_without_mindspore():
    done = subprocess.run([sys.executable, "-c", BLOCK], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "ok"
    assert "callback needs mindspore: mindspore" in done.stdout
