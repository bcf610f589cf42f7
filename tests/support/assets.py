"""The files mfotel ships as assets, as the tests list them."""
from __future__ import annotations

from pathlib import Path

from mfotel.alerting import rules

RULE_FILES = sorted([rules.RECORDING_FILE, rules.ALERTS_FILE])
DASHBOARD_FILES = ["mfotel-cluster-health.json", "mfotel-parameter-health.json",
                   "mfotel-training-overview.json"]


def listing(directory: Path) -> list[str]:
    """Every file below `directory`, as sorted relative POSIX paths."""
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())
