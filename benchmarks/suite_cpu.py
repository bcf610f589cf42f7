"""Where the test suite's CPU goes: runs a command (by default the README's `make test`) while
sampling every process's CPU time from /proc every half second, then prints the CPU-seconds
by program (promtool, Prometheus, the xdist workers, each training script, ...), and, from
tests/support/cpu_per_test.py, by test module and the costliest tests.

    .venv/bin/python benchmarks/suite_cpu.py                 # make test, ~13 min on 2 cores
    .venv/bin/python benchmarks/suite_cpu.py -- .venv/bin/python -m pytest -q tests/unit

A process seen at the first sample counts from then on (the machine's own daemons are in the
total only with what they spent during the run: run it on an otherwise idle machine). Linux
only.

The same suite took 1,270 to 2,670 CPU-s on this kind of host from one hour to the next, so
the run is measured against the host too: the CPU-s of importing MindSpore (the unit of work
of the suite's ~200 MindSpore processes), median of 3 before and 3 after the command, and the
suite's total in those units. From the tests' rows it also prints the two floors of the wall
time: the CPU over the cores, and the whole-job tests' walls over the number that may run at
once (tests/support/scheduling.py).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.cpu_per_test import OUT_ENV  # noqa: E402
from tests.support.scheduling import WHOLE_JOB, whole_job_cap  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def program(pid: str) -> str | None:
    """A process's program: the script or module a Python process runs, else the binary."""
    try:
        argv = [a.decode(errors="replace") for a in
                Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
    except OSError:
        return None
    if not argv:
        return None
    name = os.path.basename(argv[0])
    if not name.startswith("python"):
        return name
    if "-m" in argv[1:-1]:
        return f"python -m {argv[argv.index('-m') + 1]}"
    if "-c" in argv[1:-1]:
        return "python -c (xdist workers, inline scripts)"
    scripts = [a for a in argv[1:] if not a.startswith("-")]
    return f"python {os.path.basename(scripts[0])}" if scripts else "python"


class Sampler(threading.Thread):
    """Each process's CPU seconds, keyed by (pid, start time), until stopped."""

    def __init__(self, every: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.every, self.stopped = every, threading.Event()
        self.seen: dict[tuple[str, str], list] = {}   # key -> [program, first, last]

    def sample(self, first: bool) -> None:
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            cpu = (int(fields[11]) + int(fields[12])) / TICKS
            key = (pid, fields[19])
            if key in self.seen:
                self.seen[key][2] = cpu
            else:
                self.seen[key] = [program(pid), cpu if first else 0.0, cpu]

    def run(self) -> None:
        first = True
        while not self.stopped.is_set():
            self.sample(first)
            first = False
            self.stopped.wait(self.every)

    def by_program(self) -> dict[str, tuple[float, int]]:
        totals: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
        for name, first, last in self.seen.values():
            if last > first:
                totals[name or "?"][0] += last - first
                totals[name or "?"][1] += 1
        return {name: (cpu, n) for name, (cpu, n) in totals.items()}


def reference_seconds(runs: int = 3) -> float | None:
    """Median CPU-s (user + system) of `python -c "import mindspore"` in the project's .venv
    (None without it): how fast this host is now, in the suite's own unit of work."""
    python = ROOT / ".venv" / "bin" / "python"
    if not python.exists():
        return None
    spent = []
    for _ in range(runs):
        before = os.times()
        done = subprocess.run([str(python), "-c", "import mindspore"], capture_output=True)
        after = os.times()
        if done.returncode != 0:
            return None
        spent.append(after.children_user - before.children_user
                     + after.children_system - before.children_system)
    return sorted(spent)[len(spent) // 2]


def whole_job_floor(rows: list[dict], workers: int) -> tuple[float, int]:
    """Seconds the whole-job tests need at the least (their walls over how many may run at
    once with `workers` workers), and that number."""
    cap = whole_job_cap(workers)
    walls = sum(row["wall"] for row in rows if row["test"].split("::")[0] in WHOLE_JOB)
    return walls / cap, cap


def by_module(rows: list[dict]) -> dict[str, float]:
    totals: dict[str, float] = collections.defaultdict(float)
    for row in rows:
        totals[row["test"].split("::")[0]] += row["own"] + row["children"]
    return totals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=25, help="rows of each table")
    parser.add_argument("--rows", type=Path, default=None,
                        help="also write each test's CPU (JSON lines) to this file")
    parser.add_argument("command", nargs="*", default=["make", "test"])
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tests_file = Path(tmp) / "tests.jsonl"
        env = {**os.environ, OUT_ENV: str(tests_file), "PYTEST_ADDOPTS": " ".join(
            filter(None, [os.environ.get("PYTEST_ADDOPTS"), "-p tests.support.cpu_per_test"]))}
        reference_before = reference_seconds()
        sampler = Sampler()
        sampler.start()
        began = time.monotonic()
        status = subprocess.run(args.command, cwd=ROOT, env=env).returncode
        wall = time.monotonic() - began
        sampler.stopped.set()
        sampler.join()
        reference_after = reference_seconds()
        rows = [json.loads(line) for line in tests_file.read_text().splitlines()] \
            if tests_file.exists() else []
        if args.rows and tests_file.exists():
            args.rows.write_text(tests_file.read_text())
    programs = sorted(sampler.by_program().items(), key=lambda kv: -kv[1][0])
    total = sum(cpu for _, (cpu, _) in programs)
    cores = os.cpu_count() or 1
    print(f"\n# {' '.join(args.command)}: exit {status}, {wall:.0f} s wall, {total:.0f} CPU-s "
          f"({total / wall:.2f} cores of {cores})")
    measured = [r for r in (reference_before, reference_after) if r]
    if measured:   # before: None in a fresh clone (the command installs the .venv)
        unit = sum(measured) / len(measured)
        said = ", ".join(f"{r:.2f} CPU-s {when}" for r, when in
                         ((reference_before, "before"), (reference_after, "after")) if r)
        print(f"# the host: importing MindSpore took {said}; the run was {total / unit:.0f} "
              "such imports")
    if rows:
        workers = len({row.get("worker") for row in rows}) or 1
        floor, cap = whole_job_floor(rows, workers)
        print(f"# floors of the wall: the CPU over {cores} cores {total / cores:.0f} s; the "
              f"whole-job tests, {cap} at once with {workers} workers, {floor:.0f} s")
    print(f"\n{'CPU-s':>8} {'share':>6} {'procs':>6}  program")
    for name, (cpu, n) in programs[:args.top]:
        print(f"{cpu:8.1f} {cpu / total:6.1%} {n:6d}  {name}")
    if rows:
        print(f"\n{'CPU-s':>8}  test module (own + reaped children)")
        for module, cpu in sorted(by_module(rows).items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"{cpu:8.1f}  {module}")
        print(f"\n{'CPU-s':>8} {'wall':>7}  test")
        for row in sorted(rows, key=lambda r: -(r["own"] + r["children"]))[:args.top]:
            print(f"{row['own'] + row['children']:8.1f} {row['wall']:7.1f}  {row['test']}")
    return status


if __name__ == "__main__":
    sys.exit(main())
