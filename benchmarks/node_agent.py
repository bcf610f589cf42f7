"""The node agent's own cost: memory and CPU of `mfotel-instrument` following 8 ranks, scraped
every second, against the same launcher with its node endpoint off (`--node-port 0`), in the
same run; and what one scrape of the node endpoint costs.

    .venv/bin/python benchmarks/node_agent.py [--ranks 8] [--seconds 60] [--scrape-interval 1]

The ranks are the msrun-like small ranks of tests/support/scripts/node_agent_job.py (a
scheduler, a session per worker, `tail -f` helpers, forked helpers, each rank serving
/metrics): what the agent does (scanning the job's processes, a pidfd per rank, /proc
reads, a liveness probe of each rank every 5 s, scrapes) depends on the processes it
follows, not on what they compute.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mfotel.localstack.servers import free_port_block
from mfotel.node import procfs

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "tests" / "support" / "scripts" / "node_agent_job.py"


def status_kib(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return float(line.split()[1])
    return 0.0


def ranks_cpu(control: Path, ranks: int) -> float:
    total = 0.0
    for rank in range(ranks):
        stat = procfs.read_stat(int((control / f"pid-{rank}").read_text()))
        total += stat.cpu_seconds if stat else 0.0
    return total


def measure(agent: bool, ranks: int, seconds: float, interval: float) -> dict[str, float]:
    work = Path(tempfile.mkdtemp(prefix="mfotel-bench-agent-"))
    control = work / "control"
    control.mkdir()
    node_port = free_port_block(ranks + 1)
    config = work / "train.yaml"
    config.write_text("monitor_config:\n  prometheus: "
                      f"{{host: 127.0.0.1, port: {node_port + 1}}}\n")
    options = ["--config", str(config), "--node-linger", "0"]
    if not agent:
        options += ["--node-port", "0"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "mfotel.node.instrument", *options, sys.executable,
         str(JOB), "--ranks", str(ranks), "--port", str(node_port + 1), "--control", str(control)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{node_port}/metrics"
    try:
        deadline = time.monotonic() + 120
        while not all((control / f"pid-{r}").exists() for r in range(ranks)):
            if time.monotonic() > deadline:
                raise TimeoutError("the ranks did not start")
            time.sleep(0.2)
        if agent:  # every rank followed and probed once
            while True:
                try:
                    body = urllib.request.urlopen(url, timeout=5).read().decode()
                except OSError:
                    body = ""
                if body.count("mfotel_node_rank_endpoint_up{") == ranks:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError("the agent did not follow every rank")
                time.sleep(0.5)
        latencies: list[float] = []
        sizes: list[int] = []
        stop = threading.Event()

        def scrape() -> None:
            while not stop.wait(interval):
                started = time.perf_counter()
                try:
                    sizes.append(len(urllib.request.urlopen(url, timeout=5).read()))
                    latencies.append(time.perf_counter() - started)
                except OSError:
                    pass
        scraper = threading.Thread(target=scrape, daemon=True)
        first = procfs.read_stat(launcher.pid)
        first_ranks = ranks_cpu(control, ranks)
        started = time.monotonic()
        scraper.start()
        time.sleep(seconds)
        stop.set()
        scraper.join(10)
        elapsed = time.monotonic() - started
        last = procfs.read_stat(launcher.pid)
        assert first is not None and last is not None
        result = {"rss_mib": status_kib(launcher.pid, "VmRSS") / 1024,
                  "peak_rss_mib": status_kib(launcher.pid, "VmHWM") / 1024,
                  "threads": status_kib(launcher.pid, "Threads"),
                  "cpu_share": (last.cpu_seconds - first.cpu_seconds) / elapsed,
                  "ranks_cpu_share": (ranks_cpu(control, ranks) - first_ranks) / elapsed}
        if latencies:
            result.update(scrapes=len(latencies), scrape_ms=statistics.median(latencies) * 1e3,
                          scrape_max_ms=max(latencies) * 1e3, body_bytes=statistics.median(sizes))
        return result
    finally:
        (control / "done").write_text("")
        try:
            launcher.wait(timeout=60)
        except subprocess.TimeoutExpired:
            launcher.kill()
            launcher.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--scrape-interval", type=float, default=1.0)
    args = parser.parse_args()
    off = measure(False, args.ranks, args.seconds, args.scrape_interval)
    on = measure(True, args.ranks, args.seconds, args.scrape_interval)
    print(f"## mfotel-instrument with {args.ranks} ranks, {args.seconds:g} s, node endpoint "
          f"scraped every {args.scrape_interval:g} s\n")
    print("| launcher | RSS (MiB) | peak RSS (MiB) | threads | CPU (% of a core) | "
          "the ranks' CPU, all (% of a core) |")
    print("|---|---|---|---|---|---|")
    for name, row in (("node endpoint off (`--node-port 0`)", off), ("node agent on", on)):
        print(f"| {name} | {row['rss_mib']:.1f} | {row['peak_rss_mib']:.1f} | "
              f"{row['threads']:.0f} | {100 * row['cpu_share']:.2f} | "
              f"{100 * row['ranks_cpu_share']:.1f} |")
    print(f"\nthe agent's cost: +{on['rss_mib'] - off['rss_mib']:.1f} MiB RSS, "
          f"+{100 * (on['cpu_share'] - off['cpu_share']):.2f}% of a core")
    if "scrape_ms" in on:
        print(f"a scrape of the node endpoint ({args.ranks} ranks, {on['body_bytes']:.0f} bytes): "
              f"median {on['scrape_ms']:.2f} ms, max {on['scrape_max_ms']:.2f} ms over "
              f"{on['scrapes']:.0f} scrapes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
