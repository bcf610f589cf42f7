"""A pytest plugin: each test's CPU time, its own process's and that of the processes it
started and reaped (servers, training jobs, promtool), one JSON object a line in the file
`MFOTEL_CPU_PER_TEST` (benchmarks/suite_cpu.py loads it and sums it up).

    MFOTEL_CPU_PER_TEST=/tmp/tests.jsonl PYTEST_ADDOPTS="-p tests.support.cpu_per_test" make test

A module's servers stop at its last test's teardown: their CPU counts there. A process that
outlives its test (reaped later, or orphaned) counts where it is reaped, or nowhere.
"""
from __future__ import annotations

import json
import os
import resource
import time
from collections.abc import Generator

import pytest

OUT_ENV = "MFOTEL_CPU_PER_TEST"


def _cpu() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, reaped.ru_utime + reaped.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None
                            ) -> Generator[None, None, None]:
    out = os.environ.get(OUT_ENV)
    own, reaped = _cpu()
    began = time.monotonic()
    yield
    if not out:
        return
    own_after, reaped_after = _cpu()
    row = {"test": item.nodeid, "wall": time.monotonic() - began, "own": own_after - own,
           "children": reaped_after - reaped, "worker": os.environ.get("PYTEST_XDIST_WORKER")}
    with open(out, "a", encoding="utf-8") as file:   # one short line: appends do not interleave
        file.write(json.dumps(row) + "\n")
