"""`make bench`: every benchmark in one run, each printing its table with in-run baselines."""
from __future__ import annotations

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
BENCHMARKS = [
    ("training-thread overhead per step", ["overhead.py", "--steps", "3000", "--repeats", "9"]),
    ("scrape cost and training while scraped", ["scrape.py"]),
    ("training while /metrics is attacked", ["endpoint_attack.py"]),
    ("memory over 1M steps", ["memory.py"]),
    ("log parsing speed", ["parse_speed.py"]),
    ("NaN step -> page, shipped alerting files", ["paging_latency.py"]),
    ("mfotel check wall time", ["check.py"]),
    ("training against the OTLP push interval and timeout", ["otlp_interval.py"]),
    ("live page: training with the page watched, its memory", ["live_page.py"]),
    ("64 to 1024 simulated ranks against a real Prometheus (~25 min)", ["cluster_sim.py"]),
]


def main() -> int:
    status = 0
    for title, argv in BENCHMARKS:
        print(f"\n# {title}", flush=True)
        done = subprocess.run([sys.executable, os.path.join(HERE, argv[0]), *argv[1:]],
                              cwd=HERE, stderr=subprocess.DEVNULL)
        status |= done.returncode
    return status


if __name__ == "__main__":
    sys.exit(main())
