"""What the goodput rules cost Prometheus at 1024 simulated ranks, across a restart.

    .venv/bin/python benchmarks/goodput_cost.py [--ranks 1024] [--observe 300] [--json out.json]

One job of `--ranks` simulated ranks (mfotel/simulation: the real rank exporter each, 8 per
node on loopback addresses, worker processes of 256), a step a second, a checkpoint every 50
steps; every rank SIGKILLed after the warm-up and restarted `--pause` s later with the same run id,
resuming after its last checkpoint (mfotel/simulation/attempts.py). Two Prometheus servers
scrape the same targets with the shipped config and intervals (15 s; the goodput group every
1m): one with the shipped rules, one with the shipped rules but the goodput group. Every 5 s
the benchmark reads both servers' /api/v1/rules and keeps each group evaluation once (by its
`lastEvaluation`): its `evaluationTime`. Printed: each group's median and largest evaluation
time with the goodput group, the goodput group's per rank, the sum of the groups' medians of
each server, and each server's CPU seconds per minute over the observed window (after the
first evaluations); the goodput records at the end (attempts, recomputed steps, shares) beside
the truth (`truth`: the script's timeline, each rank cut at its last scrape) and each category's
difference in percentage points. The timings are wall times on whatever machine runs it; the
exit status is 1 when a category's share is more than 2 points from the truth.
"""
from __future__ import annotations

import argparse
import json
import math
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


def goodput_now(prometheus: Prometheus, job: str, at: float) -> dict[str, Any]:
    run = f'job_name="{job}"'
    found: dict[str, Any] = {}
    for name, expr in (("attempts", f"sum_over_time({goodput.ATTEMPTS}{{{run}}}[1h])"),
                       ("recomputed_steps", f"{goodput.RECOMPUTED_TOTAL}{{{run}}}"),
                       ("wall_seconds", f"{goodput.WALL}{{{run}}}")):
        rows = prometheus.query(expr, at)
        found[name] = float(rows[0]["value"][1]) if rows else None
    found["shares"] = {r["metric"]["category"]: round(float(r["value"][1]), 4)
                       for r in prometheus.query(f"{goodput.SHARE_RUN}{{{run}}}", at)}
    return found


def truth(prometheus: Prometheus, job: str, timing: Timing, restarted: float,
          at: float) -> dict[str, Any]:
    """The run's account as the script made it, each rank cut at its last scrape (what a record
    can know), in seconds (the mean of the ranks) at unix time `at`, a goodput evaluation.
    A step's period is its step and `outside_seconds` (x1.16 on average) of input before it;
    an attempt's first step is its start-up's (as the time account counts it)."""
    ranks = f'{{job_name="{job}"}}'
    between, window = restarted - 0.5, f"[{int(timing.fault_at) + 60}s]"

    def by_rank(expr: str, when: float) -> dict[str, float]:
        return {r["metric"]["rank"]: float(r["value"][1]) for r in prometheus.query(expr, when)}
    steps_1 = by_rank(f"last_over_time(mindformers_train_step{ranks}{window})", between)
    events_1 = by_rank(
        f"last_over_time(mindformers_train_process_start_timestamp_seconds{ranks}{window})"
        f" + on (job_name, rank) sum by (job_name, rank) "
        f"(last_over_time(mindformers_train_time_seconds_total{ranks}{window}))", between)
    starts_1 = by_rank(f"last_over_time(mindformers_train_process_start_timestamp_seconds"
                       f"{ranks}{window})", between)
    steps_2 = by_rank(f"mindformers_train_step{ranks}", at)
    starts_2 = by_rank(f"mindformers_train_process_start_timestamp_seconds{ranks}", at)
    high_water = min(steps_1.values())
    checkpoint = resume_step(int(timing.warmup_seconds // timing.step_seconds), timing)
    outside = timing.outside_seconds * 1.16 / timing.step_seconds   # E|N(0, 0.2)| = 0.16
    seconds = dict.fromkeys(("goodput", "recomputed", "startup", "input", "downtime"), 0.0)
    for rank, s1 in steps_1.items():
        s2 = steps_2.get(rank, checkpoint)
        steps = (s1 - 1) + max(s2 - checkpoint - 1, 0)   # the first step of each is start-up
        redone = max(min(s2, high_water) - checkpoint - 1, 0)
        seconds["goodput"] += (steps - redone) * timing.step_seconds * (1 - outside)
        seconds["recomputed"] += redone * timing.step_seconds * (1 - outside)
        seconds["input"] += steps * timing.step_seconds * outside
        seconds["startup"] += 2 * timing.step_seconds + timing.startup_seconds
        seconds["downtime"] += starts_2[rank] - events_1[rank]
    count = len(steps_1)
    return {"seconds": {k: v / count for k, v in seconds.items()}, "ranks": count,
            "wall_seconds": at - min(starts_1.values()),
            "recomputed_steps": max(high_water - checkpoint, 0)}


def compare(recorded: dict[str, Any], true: dict[str, Any]) -> dict[str, Any]:
    """Each category's share of the wall clock, recorded and true, and the difference (pp)."""
    wall = true["wall_seconds"]
    rows = {name: {"recorded": recorded["shares"].get(name), "truth": value / wall}
            for name, value in true["seconds"].items()}
    for row in rows.values():
        row["pp"] = None if row["recorded"] is None else 100 * (row["recorded"] - row["truth"])
    worst = max((abs(r["pp"]) for r in rows.values() if r["pp"] is not None), default=math.inf)
    return {"categories": rows, "worst_pp": worst,
            "agree": worst <= 2 and len(rows) == sum(r["pp"] is not None for r in rows.values())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--warmup", type=float, default=120.0,
                        help="seconds of training before the kill")
    parser.add_argument("--observe", type=float, default=300.0,
                        help="seconds measured after the restart")
    parser.add_argument("--pause", type=float, default=90.0,
                        help="seconds from the kill to the new processes' start (under the "
                             "goodput group's minute and a scrape, the records know the killed "
                             "attempt only to their last evaluation: docs/metrics.md, Limits)")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args()
    timing = Timing(step_seconds=1.0, startup_seconds=10.0, warmup_seconds=args.warmup,
                    linger_seconds=5.0, checkpoint_steps=50, restart_pause_seconds=args.pause)
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
            with_gp = servers["with goodput"]
            (stamp,) = with_gp.query(f'timestamp({goodput.WALL}{{job_name="{job.name}"}})')
            at = float(stamp["value"][1])
            recorded = goodput_now(with_gp, job.name, at)
            true = truth(with_gp, job.name, timing, restarted, at)
            report = {"ranks": args.ranks, "run_seconds": round(time.time() - start),
                      "servers": {}, "goodput": recorded, "truth": true,
                      "agreement": compare(recorded, true),
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
    return 0 if report["agreement"]["agree"] else 1


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
    agreement = report["agreement"]
    print(f"\n{'category':<12} {'recorded':>9} {'truth':>9} {'pp':>7}")
    for name, row in agreement["categories"].items():
        shown = "-" if row["recorded"] is None else f"{row['recorded']:.4f}"
        pp = "-" if row["pp"] is None else f"{row['pp']:+.2f}"
        print(f"{name:<12} {shown:>9} {row['truth']:>9.4f} {pp:>7}")
    print(f"recomputed steps: recorded {report['goodput']['recomputed_steps']}, "
          f"truth {report['truth']['recomputed_steps']}; wall: recorded "
          f"{report['goodput']['wall_seconds']}, truth {report['truth']['wall_seconds']:.1f}")
    print(("AGREE" if agreement["agree"] else "DISAGREE") +
          f": every category within {agreement['worst_pp']:.2f} pp of the truth (limit 2)")


if __name__ == "__main__":
    sys.exit(main())
