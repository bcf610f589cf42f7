"""What the goodput rules cost Prometheus at 1024 simulated ranks, across a restart.

    .venv/bin/python benchmarks/goodput_cost.py [--ranks 1024] [--observe 300] [--json out.json]

One job of `--ranks` simulated ranks (mfotel/simulation: the real rank exporter each, 8 per
node on loopback addresses, worker processes of 256), a step a second, a checkpoint every 50
steps; every rank SIGKILLed after the warm-up and restarted 20 s later with the same run id,
resuming after its last checkpoint (mfotel/simulation/attempts.py). Two Prometheus servers
scrape the same targets with the shipped config and intervals (15 s; the goodput group every
1m): one with the shipped rules, one with the shipped rules but the goodput group. Every 5 s
the benchmark reads both servers' /api/v1/rules and keeps each group evaluation once (by its
`lastEvaluation`): its `evaluationTime`. Printed: each group's median and largest evaluation
time with the goodput group, the goodput group's per rank, the sum of the groups' medians of
each server, and each server's CPU seconds per minute over the observed window (after the
first evaluations); the goodput records at the end (attempts, recomputed steps, shares). The
figures are wall times on whatever machine runs it: nothing is asserted.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mfotel.alerting import goodput
from mfotel.alerting.rules import RulesConfig, render_rules
from mfotel.localstack.alerting import shipped_files
from mfotel.localstack.servers import Prometheus, http_get_json
from mfotel.simulation.attempts import only_jobs, restart_job, resume_step
from mfotel.simulation.run import SimSettings, Simulation
from mfotel.simulation.scenario import Timing

GOODPUT_GROUP = "mindformers-goodput.rules"


def rule_files(out: Path, with_goodput: bool) -> list[Path]:
    """The shipped rule files in `out`, without the goodput group unless `with_goodput`."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in render_rules(RulesConfig()).items():
        if not with_goodput:
            doc = yaml.safe_load(text)
            doc["groups"] = [g for g in doc["groups"] if g["name"] != GOODPUT_GROUP]
            text = yaml.safe_dump(doc, sort_keys=False)
        (out / name).write_text(text)
        paths.append(out / name)
    return paths


def start_prometheus(workdir: Path, file_sd: Path, with_goodput: bool) -> Prometheus:
    from mfotel.simulation.stack import prometheus_config
    rules = rule_files(workdir / "rules", with_goodput)
    config = prometheus_config(shipped_files()["prometheus"], file_sd, None, None,
                               [p.name for p in rules])
    return Prometheus(config, rule_files=rules, workdir=workdir).start()


class Evaluations:
    """Each rule group evaluation of a Prometheus once: {group: {lastEvaluation: seconds}}."""

    def __init__(self, prometheus: Prometheus) -> None:
        self.prometheus = prometheus
        self.groups: dict[str, dict[str, float]] = {}
        self.cpu: list[tuple[float, float]] = []   # (unix time, process_cpu_seconds_total)

    def sample(self, since: float) -> None:
        """Keep the evaluations that began after unix time `since`, and the CPU counter."""
        data = http_get_json(f"{self.prometheus.url}/api/v1/rules", timeout=30)["data"]
        for group in data["groups"]:
            stamp = group["lastEvaluation"]
            if _unix(stamp) > since:
                self.groups.setdefault(group["name"], {})[stamp] = group["evaluationTime"]
        self.cpu.append((time.time(), _cpu_seconds(self.prometheus)))

    def medians(self) -> dict[str, tuple[float, float, int]]:
        """group -> (median s, largest s, evaluations)."""
        return {name: (statistics.median(v.values()), max(v.values()), len(v))
                for name, v in sorted(self.groups.items()) if v}

    def cpu_per_minute(self) -> float:
        (t0, c0), (t1, c1) = self.cpu[0], self.cpu[-1]
        return 60 * (c1 - c0) / (t1 - t0)


def _unix(stamp: str) -> float:
    from datetime import datetime
    # RFC 3339 with nanoseconds: keep microseconds
    head, _, rest = stamp.partition(".")
    fraction = "".join(ch for ch in rest if ch.isdigit())[:6]
    return datetime.fromisoformat(f"{head}.{fraction or '0'}+00:00").timestamp()


def _cpu_seconds(prometheus: Prometheus) -> float:
    import urllib.request
    with urllib.request.urlopen(f"{prometheus.url}/metrics", timeout=30) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("process_cpu_seconds_total "):
                return float(line.split()[1])
    raise RuntimeError("Prometheus reports no process_cpu_seconds_total")


def goodput_now(prometheus: Prometheus, job: str) -> dict[str, Any]:
    run = f'job_name="{job}"'
    found: dict[str, Any] = {}
    for name, expr in (("attempts", f"sum_over_time({goodput.ATTEMPTS}{{{run}}}[1h])"),
                       ("recomputed_steps", f"{goodput.RECOMPUTED_TOTAL}{{{run}}}"),
                       ("wall_seconds", f"{goodput.WALL}{{{run}}}")):
        rows = prometheus.query(expr)
        found[name] = float(rows[0]["value"][1]) if rows else None
    found["shares"] = {r["metric"]["category"]: round(float(r["value"][1]), 4)
                       for r in prometheus.query(f"{goodput.SHARE_RUN}{{{run}}}")}
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--warmup", type=float, default=120.0,
                        help="seconds of training before the kill")
    parser.add_argument("--observe", type=float, default=300.0,
                        help="seconds measured after the restart")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args()
    timing = Timing(step_seconds=1.0, startup_seconds=10.0, warmup_seconds=args.warmup,
                    linger_seconds=5.0, checkpoint_steps=50, restart_pause_seconds=20.0)
    began = time.time()
    with tempfile.TemporaryDirectory(prefix="mfotel-goodput-cost-") as tmp:
        workdir = Path(tmp)
        settings = SimSettings(ranks=args.ranks, prefix="gc", timing=timing, workdir=workdir,
                               interval=15.0)
        sim = Simulation(settings, workdir, lambda labels: 0.0)
        job = restart_job([], nodes=args.ranks // settings.ranks_per_node,
                          ranks_per_node=settings.ranks_per_node, prefix="gc")
        only_jobs(sim, [job])
        file_sd = sim.file_sd_dir / "*.json"
        servers = {"with goodput": start_prometheus(workdir / "with", file_sd, True),
                   "without goodput": start_prometheus(workdir / "without", file_sd, False)}
        try:
            sim.start()
            print(f"{args.ranks} ranks serving after {time.time() - began:.0f} s", flush=True)
            start = sim.go()
            restarted = start + timing.fault_at + timing.restart_pause_seconds
            # measured from the first minute of training on (the first scrapes settled)
            since = start + 60
            evaluations = {name: Evaluations(p) for name, p in servers.items()}
            end = restarted + args.observe
            while time.time() < end:
                time.sleep(5)
                for evaluation in evaluations.values():
                    if time.time() > since:
                        evaluation.sample(since)
            last = int(timing.warmup_seconds // timing.step_seconds)
            report = {"ranks": args.ranks, "run_seconds": round(time.time() - start),
                      "servers": {}, "goodput": goodput_now(servers["with goodput"], job.name),
                      # what the script did (the records know it up to each rank's last scrape
                      # that a goodput evaluation read)
                      "scripted": {"killed_after_step": last,
                                   "resumed_after_step": resume_step(last, timing),
                                   "pause_seconds": timing.restart_pause_seconds}}
            for name, evaluation in evaluations.items():
                report["servers"][name] = {
                    "groups": {g: {"median_s": m, "max_s": x, "evaluations": n}
                               for g, (m, x, n) in evaluation.medians().items()},
                    "cpu_seconds_per_minute": evaluation.cpu_per_minute()}
        finally:
            sim.stop(timeout=120)
            for prometheus in servers.values():
                prometheus.stop()
    _print(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


def _print(report: dict[str, Any]) -> None:
    ranks = report["ranks"]
    with_gp, without = (report["servers"][k] for k in ("with goodput", "without goodput"))
    print(f"\n{ranks} ranks, {report['run_seconds']} s of run (a restart in it)")
    print(f"{'group (with goodput)':<34} {'median ms':>10} {'max ms':>9} {'evals':>6}")
    for group, g in with_gp["groups"].items():
        print(f"{group:<34} {g['median_s'] * 1e3:>10.1f} {g['max_s'] * 1e3:>9.1f} "
              f"{g['evaluations']:>6}")
    gp = with_gp["groups"].get(GOODPUT_GROUP)
    if gp:
        print(f"goodput group per rank: median {gp['median_s'] / ranks * 1e6:.1f} us, "
              f"largest {gp['max_s'] / ranks * 1e6:.1f} us per evaluation (once a minute)")
    for name, server in report["servers"].items():
        total = sum(g["median_s"] for g in server["groups"].values())
        print(f"{name:<16} sum of the groups' medians {total * 1e3:8.1f} ms, "
              f"CPU {server['cpu_seconds_per_minute']:.2f} s per minute")
    extra = with_gp["cpu_seconds_per_minute"] - without["cpu_seconds_per_minute"]
    print(f"CPU with the goodput group minus without: {extra:+.2f} s per minute "
          f"({extra / ranks * 1e3:+.2f} ms per rank per minute)")
    print(f"goodput records at the end: {json.dumps(report['goodput'])}")
    print(f"scripted: {json.dumps(report['scripted'])}")


if __name__ == "__main__":
    sys.exit(main())
