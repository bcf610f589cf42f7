"""promtool, and the environment `promtool test rules` runs in here.

A rule test evaluates every rule group at every step of its span, so promtool allocates
hard; with Go's default GOGC (100) about a fifth of its CPU was garbage collection. GOGC=800
cut a run of every file of prometheus/tests from 38.9 to 30.5 CPU-seconds on 2 cores (peak
memory 225 MB instead of 67). The suite runs each test with only the rules it reads
(tests/support/promtool_split.py): a run of every test is then ~11 CPU-seconds, not ~50.
"""
from __future__ import annotations

import os

import pytest

from mfotel.localstack.servers import find_binary

GOGC = "800"
#: A hang guard, not a speed bound: a run of every file of prometheus/tests as written is ~50
#: CPU-s (40 s alone on 2 cores), and took 282 s and then more than 300 s in full suites.
TIMEOUT = 900


def promtool() -> str:
    """The promtool binary (the test fails, naming the package, where it is missing)."""
    path = find_binary(("promtool",))
    if path is None:
        pytest.fail("promtool not found on PATH; install it: apt-get install prometheus")
    return path


def promtool_env() -> dict[str, str]:
    """os.environ with promtool's GOGC."""
    return {**os.environ, "GOGC": GOGC}
