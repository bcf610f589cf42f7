"""Parsing speed, linearity and memory of mfotel.logs.parse.

    python benchmarks/parse_speed.py [--lines 1000000] [--long-line-mb 200] [--dir /tmp]

1. Throughput on generated 1M-line monitor logs, written by mfotel's own writers
   (mfotel.sinks.format_line / format_json) and, for mindformers, by cycling the real captured
   info.log (tests/fixtures/mindformers) with renumbered steps, irrelevant lines included.
   Each file is parsed in a fresh child process that reports the time and its max RSS before
   and after parsing (the parser streams, so the difference stays flat whatever the size).
2. Linearity: parse time of 80k lines over 10k lines, and of one hostile line of 80k
   characters over one of 10k (a backtracking regex made the first of these 25 s at 80k);
   linear parsing gives ratios near 8, quadratic near 64.
3. Memory of a line of --long-line-mb MB without a newline (bounded reads: it is reported
   and skipped, never held).
"""
from __future__ import annotations

import argparse
import json
import math
import random
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mfotel.logs.parse import ParseReport, parse_file, parse_lines
from mfotel.sinks import format_json, format_line

ROOT = Path(__file__).resolve().parent.parent

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
            out.write(format_line(step, _values(step, rng), now=1.7e9 + step * 0.1) + "\n")


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
                out.write(_STEP.sub(lambda m, offset=offset:
                                    f"step:[{int(m.group(1)) + offset:5d}/{10**9:5d}]", line))
                written += 1
            cycle += 1


def child(path: Path) -> None:
    """Parse `path` in this fresh process; print lines, rows, seconds, RSS before/after MB
    and the reasons of the problems found."""
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    report = ParseReport()
    start = time.perf_counter()
    rows = sum(1 for _ in parse_file(path, report=report))
    seconds = time.perf_counter() - start
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps([report.lines, rows, seconds, rss_before, rss_after,
                      [problem.reason for problem in report.problems]]))


def _paired(small: Callable[[], object], large: Callable[[], object],
            rounds: int = 5) -> tuple[float, float, float]:
    """(s per small call, s per large call, large/small): medians over `rounds` rounds, each
    timing both back to back, each timing long enough (0.2 s) to rise above the noise of a
    loaded machine."""
    timers = [timeit.Timer(small), timeit.Timer(large)]
    numbers = [timer.autorange()[0] for timer in timers]
    pairs = [[timer.timeit(number) / number for timer, number in zip(timers, numbers, strict=True)]
             for _ in range(rounds)]
    return (statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs),
            statistics.median(p[1] / p[0] for p in pairs))


_MF_STEP_LINE = ("[INFO] 2026-12-02 10:37:53,218 [mindformers/core/callback/callback.py:747] "
                 "print_output_info: { Epoch:[  1/  1], step:[    1/   20], loss: 2.5, "
                 "per_step_time: 95ms")
#: Hostile lines of n characters: name -> (lines before it, the line).
HOSTILE: dict[str, Callable[[int], list[str]]] = {
    "x...samples/s/p": lambda n: [_MF_STEP_LINE, "x" * n + "samples/s/p"],
    "[Monitor] 999...": lambda n: ["[Monitor] step: 1, loss: " + "9" * n],
    "{\"step\": [[[...": lambda n: ['{"step": 1, "loss": ' + "[" * n],
    "{ Epoch:[ + spaces": lambda n: ["{ Epoch:[  1/  1], step:[" + " " * n],
    "digits then [Monitor]": lambda n: ["1" * n + "[Monitor] step: 1, loss: 1.0"],
    "[Monitor] lines glued": lambda n: ["[Monitor] step: 1, loss: 0" * (n // 26)],
}


def linearity(small: int = 10_000, large: int = 80_000) -> list[tuple[str, float, float, float]]:
    """(case, s at `small`, s at `large`, ratio): line counts, then hostile line lengths."""
    rng = random.Random(0)
    lines = {n: [format_line(step, _values(step, rng), now=1.7e9 + step) + "\n"
                 for step in range(1, n + 1)] for n in (small, large)}
    rows = [(f"{small // 1000}k vs {large // 1000}k lines",
             *_paired(*(lambda n=n: sum(1 for _ in parse_lines(lines[n])) for n in lines)))]
    for name, make in HOSTILE.items():
        rows.append((f"one line: {name}",
                     *_paired(*(lambda n=n, make=make: list(parse_lines(make(n)))
                                for n in (small, large)))))
    return rows


def measure(path: Path) -> tuple[int, int, float, float, float, list[str]]:
    """(lines, rows, seconds, max RSS MB before parsing, max RSS MB after, problems) from a
    child process."""
    out = subprocess.run([sys.executable, __file__, "--child", str(path)], check=True,
                         capture_output=True, text=True).stdout
    return tuple(json.loads(out.strip().splitlines()[-1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--dir", default=None, help="where to write the generated files")
    parser.add_argument("--long-line-mb", type=int, default=200,
                        help="size of the line without a newline (0: skip)")
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
            lines, rows, seconds, rss_before, rss_after, problems = measure(path)
            path.unlink()
            assert not problems, problems[:3]
            print(f"{label:<22}{lines:>10}{rows:>10}{size_mb:>9.1f}{seconds:>9.2f}"
                  f"{lines / seconds:>11,.0f}{size_mb / seconds:>7.1f}"
                  f"{rss_before:>18.1f} / {rss_after:.1f}", flush=True)
        print(f"\n{'linearity (medians of 5 rounds)':<34}{'10k s':>10}{'80k s':>10}{'ratio':>8}"
              f"   (linear ~8, quadratic ~64)")
        for name, small, large, ratio in linearity():
            print(f"{name:<34}{small:>10.6f}{large:>10.6f}{ratio:>8.1f}", flush=True)
        if args.long_line_mb:
            path = Path(tmp) / "long.log"
            with open(path, "wb") as out:
                out.write(format_line(1, {"loss": 1.0}, now=1.7e9).encode() + b"\n")
                block = b"x" * (1 << 20)
                for _ in range(args.long_line_mb):
                    out.write(block)
            _, rows, seconds, rss_before, rss_after, problems = measure(path)
            path.unlink()
            assert rows == 1 and len(problems) == 1, problems
            reason = problems[0]
            print(f"\none {args.long_line_mb} MB line without a newline: {seconds:.2f} s, "
                  f"max RSS {rss_before:.1f} -> {rss_after:.1f} MB; reported as: {reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
