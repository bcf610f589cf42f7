"""A large job against a real Prometheus: series, memory, rule evaluation time, dashboard query
latency and alert correctness at several cluster sizes, in one run.

    .venv/bin/python benchmarks/cluster_sim.py [--sizes 64 256 1024] [--health-at 1024]

Each size runs `mfotel simulate --with-stack` (mfotel/cluster/simulation): N simulated ranks,
each the real mfotel exposition on its own port, in worker processes of 256 ranks; the shipped
Prometheus config (file_sd job, rules generated with the simulation's shortened `for:`s) and
the shipped Alertmanager config (only the webhook URL changed). At the largest size every
dashboard panel's query is timed against that Prometheus. Ratios are against the smallest
size of the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mfotel.cluster.simulation.run import SimSettings, Simulation, run_simulation  # noqa: E402
from mfotel.cluster.simulation.stack import SimStack  # noqa: E402
from mfotel.dashboards.queries import ALL, dashboard_queries, substitute  # noqa: E402
from mfotel.demo.stack import http_get_json  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DASHBOARDS = ROOT / "grafana" / "dashboards"
#: Grafana's step for the dashboards' default range (now-3h) on a ~1000 px panel, at the
#: data source's usual minimum interval: 3h / 1000 = 10.8 s -> 15 s.
GRAFANA_STEP = 15.0


def _count_series(body: str) -> int:
    return sum(1 for line in body.splitlines() if line and not line.startswith("#"))


def _scrape(url: str) -> str:
    import urllib.request
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def rank_urls(sim: Simulation, job: str, ranks: tuple[int, ...]) -> list[str]:
    urls = []
    for spec in sim.specs:
        if spec.job == job and spec.rank in ranks:
            host, port = sim.address(spec.node)
            urls.append(f"http://{host}:{port + spec.local_rank}/metrics")
    return urls


def _query_seconds(base: str, path: str, params: dict[str, str], repeats: int = 3) -> tuple[float, int]:
    """Median wall seconds of an HTTP API query, and the number of series it returns."""
    url = f"{base}/api/v1/{path}?{urllib.parse.urlencode(params)}"
    times, count = [], 0
    for _ in range(repeats):
        started = time.perf_counter()
        data = http_get_json(url, timeout=60)
        times.append(time.perf_counter() - started)
        if data.get("status") != "success":
            raise RuntimeError(f"{params['query']!r}: {data}")
        count = len(data["data"]["result"])
    return statistics.median(times), count


def time_dashboards(base: str, start: float, end: float, job: str) -> list[dict[str, Any]]:
    """Every panel query of the checked-in dashboards, for all jobs and for one job: instant
    queries as instant queries, the others as range queries over [start, end] at Grafana's
    step."""
    rows = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        for query in dashboard_queries(json.loads(path.read_text())):
            if query.origin == "variable":
                continue
            row: dict[str, Any] = {"dashboard": query.dashboard, "panel": query.title,
                                   "instant": query.instant}
            for scope, jobs in (("all", ALL), ("job", [job])):
                expr = substitute(query.expr, {"job_name": jobs, "rank": ALL},
                                  rate_interval="1m", interval=f"{GRAFANA_STEP:g}s", range_="3h")
                if query.instant:
                    seconds, series = _query_seconds(base, "query", {"query": expr, "time": f"{end:.3f}"})
                else:
                    seconds, series = _query_seconds(base, "query_range", {
                        "query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}",
                        "step": f"{GRAFANA_STEP:g}"})
                row[f"{scope}_seconds"], row[f"{scope}_series"] = seconds, series
            rows.append(row)
    return rows


def measure(size: int, cardinality: str, dashboards: bool, interval: float) -> dict[str, Any]:
    found: dict[str, Any] = {"ranks": size, "cardinality": cardinality}

    def during(sim: Simulation, stack: SimStack | None) -> None:
        assert stack is not None and stack.prometheus is not None
        prom = stack.prometheus
        main = sim.jobs[0].name
        bodies = [_scrape(url) for url in rank_urls(sim, main, (0, 1))]
        found["series_rank0"], found["series_rank1"] = map(_count_series, bodies)
        found["bytes_rank0"] = len(bodies[0].encode())
        exposed = prom.query('sum(scrape_samples_scraped{job="mindformers-file-sd"})')
        found["series_exposed_total"] = float(exposed[0]["value"][1]) if exposed else 0
        for name, expr in (("scrape_seconds_avg", "avg(scrape_duration_seconds)"),
                           ("scrape_seconds_max", "max(scrape_duration_seconds)"),
                           ("targets_up", 'sum(up{job="mindformers-file-sd"})')):
            result = prom.query(expr)
            found[name] = float(result[0]["value"][1]) if result else None
        if dashboards:
            found["dashboards"] = time_dashboards(prom.url, sim.start_time, time.time(), main)

    settings = SimSettings(ranks=size, cardinality=cardinality, with_stack=True,
                           interval=interval, during_run=during,
                           on_progress=lambda text: print(f"  [{size} {cardinality}] {text}",
                                                          file=sys.stderr, flush=True))
    started = time.monotonic()
    result = run_simulation(settings)
    found["wall_seconds"] = time.monotonic() - started
    found["prometheus"] = result.prometheus
    found["pages"] = {"expected": len(result.checks),
                      "once_in_time": sum(c.ok for c in result.checks),
                      "missed": sum(c.firings == 0 for c in result.checks),
                      "false": len(result.unexpected),
                      "max_delay_over_deadline": max(
                          (c.delay / c.expected.deadline for c in result.checks if c.delay), default=0)}
    found["worker_rss_bytes"] = sum(w["peak_rss_bytes"] for w in result.workers)
    found["worker_cpu_seconds"] = sum(w["cpu_seconds"] for w in result.workers)
    found["export_errors"] = sum(w["export_errors"] for w in result.workers)
    found["ok"] = result.ok
    return found


def _mb(value: float) -> str:
    return f"{value / 2**20:.0f} MB"


def report(runs: list[dict[str, Any]]) -> None:
    base = runs[0]
    print("\n## Series and Prometheus at each size (one run each)\n")
    print("| ranks | level | series/rank (rank 0 / 1) | exposed total | head series | "
          "Prometheus RSS (peak) | RSS/head series | rule groups, sum of median (max) | "
          "scrape avg/max | pages once in time | missed | false |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for run in runs:
        p = run["prometheus"]
        groups = {k: v for k, v in p.items() if k.startswith("rule_group:")}
        maxima = {k: v for k, v in p.items() if k.startswith("rule_group_max:")}
        rss = p.get("process_resident_memory_bytes", 0)
        pages = run["pages"]
        print(f"| {run['ranks']} | {run['cardinality']} | {run['series_rank0']} / "
              f"{run['series_rank1']} | {run['series_exposed_total']:.0f} | "
              f"{p.get('prometheus_tsdb_head_series', 0):.0f} | {_mb(rss)} "
              f"({_mb(p.get('peak_rss_bytes', 0))}) | "
              f"{rss / max(p.get('prometheus_tsdb_head_series', 1), 1) / 1024:.1f} KB | "
              f"{1000 * sum(groups.values()):.0f} ms ({1000 * sum(maxima.values()):.0f} ms) | "
              f"{1000 * (run['scrape_seconds_avg'] or 0):.1f}/"
              f"{1000 * (run['scrape_seconds_max'] or 0):.0f} ms | "
              f"{pages['once_in_time']}/{pages['expected']} | {pages['missed']} | {pages['false']} |")
    print("\nRatios against the first row: ")
    for run in runs[1:]:
        p, b = run["prometheus"], base["prometheus"]
        rules = lambda q: sum(v for k, v in q.items() if k.startswith("rule_group:"))  # noqa: E731
        print(f"- {run['ranks']} {run['cardinality']}: ranks x{run['ranks'] / base['ranks']:.0f}, "
              f"head series x{p['prometheus_tsdb_head_series'] / b['prometheus_tsdb_head_series']:.1f}, "
              f"RSS x{p['process_resident_memory_bytes'] / b['process_resident_memory_bytes']:.1f}, "
              f"rule evaluation x{rules(p) / rules(b):.1f}")
    print("\n## Rule groups (median of the last samples, ms)\n")
    names = sorted({k.split(":", 1)[1] for run in runs for k in run["prometheus"]
                    if k.startswith("rule_group:")})
    print("| group | " + " | ".join(f"{r['ranks']} {r['cardinality']}" for r in runs) + " |")
    print("|---|" + "---|" * len(runs))
    for name in names:
        print(f"| {name} | " + " | ".join(
            f"{1000 * r['prometheus'].get('rule_group:' + name, 0):.1f} "
            f"({1000 * r['prometheus'].get('rule_group_max:' + name, 0):.0f})" for r in runs) + " |")
    print("\n## The simulator itself\n")
    for run in runs:
        print(f"- {run['ranks']} ranks: {_mb(run['worker_rss_bytes'])} peak RSS in its workers "
              f"({run['worker_rss_bytes'] / run['ranks'] / 1024:.0f} KB per rank), "
              f"{run['worker_cpu_seconds']:.0f} CPU s over {run['wall_seconds']:.0f} s, "
              f"{run['export_errors']} export errors")
    for run in runs:
        if "dashboards" in run:
            print(f"\n## Dashboard queries at {run['ranks']} ranks ({run['cardinality']}): "
                  f"median of 3; range queries over the run's {run['wall_seconds'] / 60:.0f} "
                  f"minutes at a {GRAFANA_STEP:g} s step\n")
            print("| dashboard | panel | kind | all jobs: ms | series | one job: ms | series |")
            print("|---|---|---|---|---|---|---|")
            for row in sorted(run["dashboards"], key=lambda r: -r["all_seconds"]):
                print(f"| {row['dashboard'].replace('mfotel-', '')} | {row['panel']} | "
                      f"{'instant' if row['instant'] else 'range'} | "
                      f"{1000 * row['all_seconds']:.0f} | {row['all_series']} | "
                      f"{1000 * row['job_seconds']:.0f} | {row['job_series']} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--health-at", type=int, nargs="*", default=[1024],
                        help="sizes also run at cardinality health")
    parser.add_argument("--interval", type=float, default=5.0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    runs = []
    for size in args.sizes:
        runs.append(measure(size, "full", size == max(args.sizes), args.interval))
        if size in args.health_at:
            runs.append(measure(size, "health", False, args.interval))
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    print(f"(machine: {os.cpu_count()} cores, shared and loaded; scrape and evaluation every "
          f"{args.interval:g} s)")
    report(runs)
    return 0 if all(run["ok"] for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
