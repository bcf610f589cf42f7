"""Parsing speed and memory of mfotel.logs.parse on generated 1M-line monitor logs.

    python benchmarks/parse_speed.py [--lines 1000000] [--dir /tmp]

Files are written by mfotel's own writers (mfotel.sinks.format_line / format_json) and, for
mindformers, by cycling the real captured info.log (tests/fixtures/mindformers) with
renumbered steps, irrelevant lines included. Each file is parsed in a fresh child process
that reports the time and its max RSS before and after parsing (the parser streams, so the
difference stays flat whatever the file size). Prints a table.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import re
import resource
import sys
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mfotel.logs.parse import ParseReport, parse_file  # noqa: E402
from mfotel.sinks import format_json, format_line  # noqa: E402

MF_FIXTURE = ROOT / "tests" / "fixtures" / "mindformers" / "info.log"


def _values(step: int, rng: random.Random) -> dict[str, float]:
    loss = math.nan if step % 10007 == 0 else 2.0 + rng.random()
    return {"loss": loss, "learning_rate": 1e-4 * (1 + math.cos(step / 1e5)),
            "grad_norm": rng.random() * 3, "throughput": 1000 + rng.random() * 50,
            "step_time": 0.1 + rng.random() * 0.01}


def write_text(path: Path, lines: int) -> None:
    rng = random.Random(0)
    with open(path, "w", encoding="utf-8") as out:
        for step in range(1, lines + 1):
            out.write(format_line(step, _values(step, rng)) + "\n")


def write_json(path: Path, lines: int) -> None:
    rng = random.Random(0)
    with open(path, "w", encoding="utf-8") as out:
        for step in range(1, lines + 1):
            out.write(format_json(step, 1, 0, "bench", _values(step, rng),
                                  now=1.7e9 + step * 0.1) + "\n")


_STEP = re.compile(r"step:\[\s*(\d+)/\s*(\d+)\]")


def write_mindformers(path: Path, lines: int) -> None:
    """The real info.log's training section repeated, steps renumbered to keep increasing."""
    block = MF_FIXTURE.read_text(encoding="utf-8").splitlines(keepends=True)
    written, cycle = 0, 0
    with open(path, "w", encoding="utf-8") as out:
        while written < lines:
            offset = cycle * 20
            for line in block:
                if written == lines:
                    break
                out.write(_STEP.sub(lambda m: f"step:[{int(m.group(1)) + offset:5d}/{10**9:5d}]",
                                    line))
                written += 1
            cycle += 1


def child(path: Path) -> None:
    """Parse `path` in this fresh process; print lines, rows, seconds, RSS before/after MB."""
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    report = ParseReport()
    start = time.perf_counter()
    rows = sum(1 for _ in parse_file(path, report=report))
    seconds = time.perf_counter() - start
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    assert report.problem_count == 0, report.describe()
    print(json.dumps([report.lines, rows, seconds, rss_before, rss_after]))


def measure(path: Path) -> tuple[int, int, float, float, float]:
    """(lines, rows, seconds, max RSS MB before parsing, max RSS MB after) from a child."""
    out = subprocess.run([sys.executable, __file__, "--child", str(path)], check=True,
                         capture_output=True, text=True).stdout
    return tuple(json.loads(out.strip().splitlines()[-1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--dir", default=None, help="where to write the generated files")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(Path(args.child))
        return 0
    formats: list[tuple[str, str, Callable[[Path, int], None]]] = [
        ("mfotel text", "train_monitor.log", write_text),
        ("mfotel JSON", "train_monitor.jsonl", write_json),
        ("mindformers info.log", "info.log", write_mindformers)]
    print(f"{'format':<22}{'lines':>10}{'rows':>10}{'file MB':>9}{'seconds':>9}"
          f"{'lines/s':>11}{'MB/s':>7}{'RSS MB before/after parse':>27}")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for label, name, writer in formats:
            path = Path(tmp) / name
            writer(path, args.lines)
            size_mb = path.stat().st_size / 2**20
            lines, rows, seconds, rss_before, rss_after = measure(path)
            path.unlink()
            print(f"{label:<22}{lines:>10}{rows:>10}{size_mb:>9.1f}{seconds:>9.2f}"
                  f"{lines / seconds:>11,.0f}{size_mb / seconds:>7.1f}"
                  f"{rss_before:>18.1f} / {rss_after:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
