"""One job over K Prometheus shards against one Prometheus, at one size: alert correctness,
notification delays, and each component's series, memory, CPU, rule evaluation time and
remote_write bytes (docs/scaling.md, section 7).

    .venv/bin/python benchmarks/sharded_sim.py --ranks 256 --shards 2 [--json out.json]

Runs `mfotel simulate --with-stack` twice at the same size and interval: once unsharded (one
Prometheus, one Alertmanager), once with `--shards K` (K Prometheus shards by target,
VictoriaMetrics, vmalert, two clustered Alertmanagers; one Alertmanager killed at the faults
and one shard once every incident paged). A thread samples every server of the run from
/proc and its own /metrics every 10 s; each figure is its last sample before the run
stopped (a killed server: before it was killed).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from prometheus_client.parser import text_string_to_metric_families

from mfotel.simulation.run import SIM_RULES, SimSettings, firing_alerts, run_simulation
from mfotel.simulation.scenario import Timing

#: The server's metrics kept, by name (summed over their series).
METRICS = ("prometheus_tsdb_head_series", "prometheus_remote_storage_bytes_total",
           "prometheus_rule_group_last_duration_seconds", "vm_rows_inserted_total",
           "vmalert_iteration_duration_seconds_sum", "vmalert_iteration_duration_seconds_count",
           "vm_new_timeseries_created_total", "alertmanager_notifications_total")
_LISTEN = re.compile(r"(?:--web\.listen-address=|-httpListenAddr=)127\.0\.0\.1:(\d+)")
_TICKS = os.sysconf("SC_CLK_TCK")


def _component(cmdline: str, workdir: str) -> str | None:
    rest = cmdline.split(workdir, 1)[1] if workdir in cmdline else ""
    match = re.match(r"/(shard-\d+|store|ruler|alertmanager-\d+|prometheus|alertmanager)\b",
                     rest)
    return match.group(1) if match else None


def _proc(pid: int) -> dict[str, float]:
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    status = Path(f"/proc/{pid}/status").read_text()
    kb = {k: float(v.split()[0]) for k, v in re.findall(r"^(VmRSS|VmHWM):\s+(.*)$", status, re.M)}
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    alive = uptime - int(stat[19]) / _TICKS
    cpu = (int(stat[11]) + int(stat[12])) / _TICKS
    return {"rss_mb": kb.get("VmRSS", 0) / 1024, "peak_rss_mb": kb.get("VmHWM", 0) / 1024,
            "cpu_seconds": cpu, "cpu_share": cpu / alive if alive > 0 else 0.0,
            "alive_seconds": alive}


def _metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in METRICS:
                found[sample.name] = found.get(sample.name, 0.0) + sample.value
    return found


class Sampler:
    """Every server started under `workdir`: its last /proc and /metrics figures."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = str(workdir)
        self.last: dict[str, dict[str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(10):
            self.sample()

    def sample(self) -> None:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                name = _component(cmdline, self.workdir)
                port = _LISTEN.search(cmdline)
                if name is None or port is None:
                    continue
                figures = {**_proc(int(entry.name)), **_metrics(int(port.group(1)))}
            except (OSError, ValueError, IndexError):
                continue
            self.last[name] = figures

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def run_one(ranks: int, shards: int, interval: float) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix=f"mfotel-bench-{shards}-"))
    settings = SimSettings(ranks=ranks, prefix="b", seed=1, timing=Timing(warmup_seconds=60.0),
                           rules=dict(SIM_RULES), with_stack=True, workdir=workdir,
                           interval=interval, shards=shards,
                           on_progress=lambda text: print(f"  {text}", file=sys.stderr))
    started = time.time()
    with Sampler(workdir) as sampler:
        settings.during_run = lambda sim, stack: sampler.sample()
        result = run_simulation(settings)
    topology = result.topology
    return {
        "ranks": ranks, "shards": shards, "interval": interval,
        "wall_seconds": round(time.time() - started, 1), "ok": result.ok,
        "incidents": [{"job": c.expected.job_name, "alert": c.expected.alertname,
                       "notifications": c.notifications, "ranks": list(c.ranks),
                       "delay": None if c.delay is None else round(c.delay, 1),
                       "deadline": round(c.expected.deadline, 1), "ok": c.ok}
                      for c in result.checks],
        "false_pages": len(result.unexpected), "after_stop": len(result.after_stop),
        "unexpected_alerts": [f"{a.alertname} job_name={a.labels.get('job_name')} "
                              f"rank={a.labels.get('rank', '-')}"
                              for n in [*result.unexpected, *result.after_stop]
                              for a in firing_alerts(n, "b")],
        "topology": None if topology is None else {
            "ok": topology.ok, "notifications": topology.notifications,
            "delay": topology.delay, "shard_ranks": topology.shard_ranks,
            "others": topology.others},
        "components": sampler.last,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=256)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--interval", type=float, default=5.0)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--sharded-only", action="store_true",
                        help="skip the run with one Prometheus")
    args = parser.parse_args(argv)
    runs = [] if args.sharded_only else [run_one(args.ranks, 0, args.interval)]
    runs.append(run_one(args.ranks, args.shards, args.interval))
    text = json.dumps(runs, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text)
    return 0 if all(r["ok"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
