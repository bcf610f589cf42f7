"""A large job against a real Prometheus: series, memory, rule evaluation time, dashboard query
latency and alert correctness at several cluster sizes, in one run.

    .venv/bin/python benchmarks/cluster_sim.py [--sizes 64 256 1024] [--health-at 1024]

Each size runs `mfotel simulate --with-stack` (mfotel/simulation): N simulated ranks,
each the real mfotel exposition on its own port, in worker processes of 256 ranks; the shipped
Prometheus config (file_sd job) twice, both at the shipped 15 s: one with rules generated with
the simulation's shortened `for:`s, alerting through the shipped Alertmanager config (only
the webhook URL changed) for the alert checks, one with the shipped rules, measured (memory,
series, rule evaluation, CPU). At the largest size every dashboard panel's query is timed
against the second one. Ratios are against the smallest size of the same run. With
`--node-agents-at N`, size N runs again with a node agent per node (one target per 8 ranks, as
`mfotel-instrument` serves it): what scraping the node endpoints costs Prometheus.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mfotel.dashboards.queries import ALL, dashboard_queries, substitute
from mfotel.localstack.servers import http_get_json
from mfotel.simulation.run import SimSettings, Simulation, run_simulation
from mfotel.simulation.scenario import plan_jobs
from mfotel.simulation.stack import Notification, SimStack

ROOT = Path(__file__).resolve().parent.parent
DASHBOARDS = ROOT / "grafana" / "dashboards"
#: A dashboard panel over the default range (now-3h) asks for about 720 points (Grafana's
#: step for 3h on a ~1000 px panel is 10.8 s, raised to a 15 s minimum interval). The run has
#: minutes of data, so the range queries ask for 720 points across what there is: each point
#: costs what it would in a 3-hour panel (its [1m] windows hold the same samples).
POINTS = 720


def _count_series(body: str) -> int:
    return sum(1 for line in body.splitlines() if line and not line.startswith("#"))


def rank_urls(sim: Simulation, job: str, ranks: tuple[int, ...]) -> list[str]:
    urls = []
    for spec in sim.specs:
        if spec.job == job and spec.rank in ranks:
            host, port = sim.address(spec.node)
            urls.append(f"http://{host}:{port + spec.local_rank}/metrics")
    return urls


def _query_seconds(base: str, path: str, params: dict[str, str],
                   repeats: int = 3) -> tuple[float | None, int | None]:
    """Median wall seconds of an HTTP API query and the number of series it returns; a query
    over 5 s runs once; (None, None) when Prometheus gives up (its 2-minute query timeout)."""
    url = f"{base}/api/v1/{path}?{urllib.parse.urlencode(params)}"
    times, count = [], 0
    for _ in range(repeats):
        started = time.perf_counter()
        try:
            data = http_get_json(url, timeout=180)
        except OSError:         # 503: the query timed out inside Prometheus
            return None, None
        times.append(time.perf_counter() - started)
        if data.get("status") != "success":
            raise RuntimeError(f"{params['query']!r}: {data}")
        count = len(data["data"]["result"])
        if times[-1] > 5:
            break
    return statistics.median(times), count


def time_dashboards(base: str, start: float, end: float) -> list[dict[str, Any]]:
    """Every panel and annotation query of the checked-in dashboards over every job and rank:
    instant queries at `end`, the others as POINTS-point range queries over [start, end]."""
    rows = []
    step = (end - start) / POINTS
    for path in sorted(DASHBOARDS.glob("*.json")):
        for query in dashboard_queries(json.loads(path.read_text())):
            if query.origin == "variable":
                continue
            row: dict[str, Any] = {"dashboard": query.dashboard, "panel": query.title,
                                   "instant": query.instant, "expr": query.expr}
            for scope, jobs in (("all", ALL),):   # every job: the largest query a user can make
                expr = substitute(query.expr, {"job_name": jobs, "run_id": ALL, "rank": ALL},
                                  rate_interval="1m", interval="15s", range_="3h")
                if query.instant:
                    params = {"query": expr, "time": f"{end:.3f}"}
                    seconds, series = _query_seconds(base, "query", params)
                else:
                    params = {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}",
                              "step": f"{step:.3f}"}
                    seconds, series = _query_seconds(base, "query_range", params)
                row[f"{scope}_seconds"], row[f"{scope}_series"] = seconds, series
            rows.append(row)
    return rows


def _scalar(prom: Any, expr: str) -> float | None:
    result = prom.query(expr)
    return float(result[0]["value"][1]) if result else None


def measure(size: int, cardinality: str, dashboards: bool, interval: float,
            hold_seconds: float = 0.0, node_agents: bool = False) -> dict[str, Any]:
    found: dict[str, Any] = {"ranks": size, "cardinality": cardinality, "errors": [],
                             "series_rank0": 0, "series_rank1": 0, "node_agents": node_agents}

    def during(sim: Simulation, stack: SimStack | None) -> None:
        """Measurements before the ranks stop; a failed one is reported, not fatal."""
        assert stack is not None and stack.prometheus is not None
        prom = stack.shipped or stack.prometheus
        main = sim.jobs[0].name
        try:
            bodies = [_scrape(url) for url in rank_urls(sim, main, (0, 1))]
            found["series_rank0"], found["series_rank1"] = map(_count_series, bodies)
        except OSError as error:
            found["errors"].append(f"scraping ranks 0 and 1: {error}")
        for key, expr in (
                ("series_exposed_total", 'sum(scrape_samples_scraped{job="mindformers-file-sd"})'),
                ("scrape_seconds_avg", "avg(scrape_duration_seconds)"),
                ("scrape_seconds_max", "max_over_time(max(scrape_duration_seconds)[10m:15s])"),
                ("targets_down_max",
                 'max_over_time(sum(1 - up{job="mindformers-file-sd"})[10m:15s])'),
                *(NODE_QUERIES if node_agents else ())):
            try:
                found[key] = _scalar(prom, expr)
            except (OSError, RuntimeError) as error:
                found["errors"].append(f"{expr}: {error}")
        if dashboards:
            try:
                found["dashboards"] = time_dashboards(prom.url, sim.start_time, time.time())
            except (OSError, RuntimeError, KeyError, ValueError) as error:
                found["errors"].append(f"dashboard queries: {error!r}")

    settings = SimSettings(ranks=size, cardinality=cardinality, with_stack=True,
                           shipped_cost=True, interval=interval, during_run=during,
                           extra_seconds=hold_seconds, node_agents=node_agents,
                           on_progress=lambda text: print(f"  [{size} {cardinality}] {text}",
                                                          file=sys.stderr, flush=True))
    started = time.monotonic()
    result = run_simulation(settings)
    found["wall_seconds"] = time.monotonic() - started
    found["run_seconds"] = result.fault_time - result.start_time + (
        max((c.expected.deadline for c in result.checks), default=0))
    found["checks_prometheus"] = result.prometheus
    found["prometheus"] = result.shipped_prometheus
    found["pages"] = {"expected": len(result.checks),
                      "once_in_time": sum(c.ok for c in result.checks),
                      "missed": sum(c.notifications == 0 for c in result.checks),
                      "false": len(result.unexpected),
                      "after_stop": len(result.after_stop),
                      "delays": {f"{c.expected.alertname} {c.expected.job_name}": round(c.delay, 1)
                                 for c in result.checks if c.delay is not None},
                      "incidents": [{"job": c.expected.job_name, "alert": c.expected.alertname,
                                     "expected_ranks": list(c.expected.ranks),
                                     "named": list(c.ranks), "alertnames": list(c.alertnames),
                                     "notifications": c.notifications, "delay": c.delay,
                                     "deadline": c.expected.deadline, "bytes": c.bytes,
                                     "ok": c.ok} for c in result.checks],
                      # what paged falsely, and what paged after the ranks were stopped
                      "false_alerts": _alerts(result.unexpected, result.start_time),
                      "after_stop_alerts": _alerts(result.after_stop, result.start_time)}
    found["trend"] = result.extra.get("trend", [])
    found["workers"] = len(result.workers)
    found["worker_rss_bytes"] = sum(w["peak_rss_bytes"] for w in result.workers)
    found["worker_rank_rss_bytes"] = sum(w["peak_rss_bytes"] - w["base_rss_bytes"]
                                         for w in result.workers)
    found["worker_cpu_seconds"] = sum(w["cpu_seconds"] for w in result.workers)
    found["export_errors"] = sum(w["export_errors"] for w in result.workers)
    found["ok"] = result.ok
    return found


def _alerts(notifications: list[Notification], start: float) -> list[dict[str, Any]]:
    """The firing alerts of `notifications`: name, job, rank, seconds after the start."""
    return [{"alertname": a.alertname, "job_name": a.labels.get("job_name", ""),
             "rank": a.labels.get("rank", ""), "at": round(n.received_at - start, 1)}
            for n in notifications for a in n.alerts if a.firing]


#: What the node targets cost the shipped-rules Prometheus, beside the ranks' targets.
_NODE, _RANK = 'mfotel_target="node"', 'job="mindformers-file-sd", mfotel_target=""'
NODE_QUERIES = (
    ("node_targets", f"count(up{{{_NODE}}})"),
    ("node_scrape_seconds_avg", f"avg(scrape_duration_seconds{{{_NODE}}})"),
    ("node_scrape_seconds_max", f"max_over_time(max(scrape_duration_seconds{{{_NODE}}})[10m:15s])"),
    ("node_samples_avg", f"avg(scrape_samples_scraped{{{_NODE}}})"),
    ("node_samples_total", f"sum(scrape_samples_scraped{{{_NODE}}})"),
    ("rank_scrape_seconds_avg", f"avg(scrape_duration_seconds{{{_RANK}}})"),
    ("rank_samples_total", f"sum(scrape_samples_scraped{{{_RANK}}})"),
)


def report_node_agents(runs: list[dict[str, Any]]) -> None:
    """The node-agent run against the run of the same size without."""
    for run in [r for r in runs if r.get("node_agents")]:
        base = next((r for r in runs if (r["ranks"], r["cardinality"]) ==
                     (run["ranks"], run["cardinality"]) and not r.get("node_agents")), None)
        p = run["prometheus"]
        print(f"\n## Node agents at {run['ranks']} ranks ({run['cardinality']}): one node target "
              "per 8 ranks\n")
        print(f"- {run.get('node_targets') or 0:.0f} node targets, "
              f"{run.get('node_samples_avg') or 0:.0f} samples each "
              f"({run.get('node_samples_total') or 0:.0f} in all, beside "
              f"{run.get('rank_samples_total') or 0:.0f} from the ranks' targets)")
        ms = {key: 1000 * (run.get(key) or 0) for key in (
            "node_scrape_seconds_avg", "node_scrape_seconds_max", "rank_scrape_seconds_avg")}
        print(f"- scrape duration of a node target: avg {ms['node_scrape_seconds_avg']:.1f} ms, "
              f"max {ms['node_scrape_seconds_max']:.0f} ms (a rank target: avg "
              f"{ms['rank_scrape_seconds_avg']:.1f} ms)")
        group = "group:mindformers-node.alerts"
        print(f"- rule group mindformers-node.alerts: {1000 * p.get(group, 0):.1f} ms "
              f"({1000 * p.get('max_' + group, 0):.0f} ms max); every group: "
              f"{1000 * _evaluation(p):.0f} ms")
        if base is not None:
            b = base["prometheus"]
            before, after = b["prometheus_tsdb_head_series"], p["prometheus_tsdb_head_series"]
            print(f"- against the same size without agents: head series {before:.0f} -> "
                  f"{after:.0f} (x{after / before:.2f}), "
                  f"RSS {_mb(b['process_resident_memory_bytes'])} -> "
                  f"{_mb(p['process_resident_memory_bytes'])}, Prometheus CPU "
                  f"{100 * b.get('cpu_share', 0):.0f}% -> {100 * p.get('cpu_share', 0):.0f}% of a "
                  f"core, rule evaluation {1000 * _evaluation(b):.0f} -> "
                  f"{1000 * _evaluation(p):.0f} ms")
        print(f"- pages: {run['pages']['once_in_time']}/{run['pages']['expected']} once in time, "
              f"{run['pages']['missed']} missed, {run['pages']['false']} false; delays "
              f"{run['pages']['delays']}")


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read().decode()


def _mb(value: float) -> str:
    return f"{value / 2**20:.0f} MB"


def _evaluation(p: dict[str, float], prefix: str = "group:") -> float:
    return sum(v for k, v in p.items() if k.startswith(prefix))


def report(runs: list[dict[str, Any]]) -> None:
    base = runs[0]
    print("\n## Series, Prometheus memory and rule evaluation at each size\n")
    print("Prometheus with the shipped prometheus.yml (15 s) and rules; alert checks on a second "
          "one at the simulation's interval with shortened `for:`s.\n")
    print("| ranks | level | series/rank (rank 0 / 1) | exposed | head series | RSS (peak) | "
          "RSS per head series | rule evaluation, all groups: median (max) | Prometheus CPU | "
          "scrape avg/max | incidents paged once, in time | missed | false |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for run in runs:
        p, pages = run["prometheus"], run["pages"]
        rss = p.get("process_resident_memory_bytes", 0)
        head = p.get("prometheus_tsdb_head_series", 1)
        print(f"| {run['ranks']} | {run['cardinality']} | {run['series_rank0']} / "
              f"{run['series_rank1']} | {run['series_exposed_total']:.0f} | {head:.0f} | "
              f"{_mb(rss)} ({_mb(p.get('peak_rss_bytes', 0))}) | {rss / head / 1024:.1f} KB | "
              f"{1000 * _evaluation(p):.0f} ms ({1000 * _evaluation(p, 'max_group:'):.0f} ms) | "
              f"{100 * p.get('cpu_share', 0):.0f}% of a core | "
              f"{1000 * (run['scrape_seconds_avg'] or 0):.1f}/"
              f"{1000 * (run['scrape_seconds_max'] or 0):.0f} ms | "
              f"{pages['once_in_time']}/{pages['expected']} | {pages['missed']} | "
              f"{pages['false']} |")
    print("\n## Incidents: one notification each, naming the right rank\n")
    print("| ranks | level | incident | alert | ranks named (expected) | notifications | delay "
          "| deadline | webhook bytes |")
    print("|---|---|---|---|---|---|---|---|---|")
    for run in runs:
        for item in run["pages"]["incidents"]:
            named = ",".join(item["named"]) or "job"
            wanted = ",".join(item["expected_ranks"]) or "job"
            delay = "-" if item["delay"] is None else f"{item['delay']:.0f} s"
            print(f"| {run['ranks']} | {run['cardinality']} | {item['job']} | {item['alert']} | "
                  f"{named} ({wanted}) | {item['notifications']} | {delay} | "
                  f"{item['deadline']:.0f} s | {item['bytes']} |")
        print(f"| {run['ranks']} | {run['cardinality']} | false notifications: "
              f"{run['pages']['false']}, after stopping: {run['pages']['after_stop']} |"
              " | | | | | |")
        for kind in ("false_alerts", "after_stop_alerts"):
            for alert in run["pages"].get(kind, []):
                print(f"|  |  | {kind.replace('_', ' ')}: {alert['alertname']} "
                      f"job_name={alert['job_name']} rank={alert['rank'] or '-'} at "
                      f"+{alert['at']:.0f} s | | | | | | |")
    for run in runs:
        for error in run["errors"]:
            print(f"- {run['ranks']} {run['cardinality']}: measurement failed: {error}")
        ended = sum(job.world_size if job.fault in ("complete", "cancel") else 1
                    for job in plan_jobs(run["ranks"]) if job.fault in ("complete", "cancel",
                                                                        "rank_down"))
        if (run.get("targets_down_max") or 0) > ended:
            print(f"- {run['ranks']} {run['cardinality']}: up to {run['targets_down_max']:.0f} "
                  f"targets down at once, {ended} of them ranks that ended: scrapes timed out")
    print("\nRatios against the first row (and, per added rank: head series, RSS):")
    b = base["prometheus"]
    for run in runs[1:]:
        p = run["prometheus"]
        ranks = run["ranks"] - base["ranks"] or 1
        series = p["prometheus_tsdb_head_series"] - b["prometheus_tsdb_head_series"]
        rss = p["process_resident_memory_bytes"] - b["process_resident_memory_bytes"]
        head_ratio = p["prometheus_tsdb_head_series"] / b["prometheus_tsdb_head_series"]
        rss_ratio = p["process_resident_memory_bytes"] / b["process_resident_memory_bytes"]
        print(f"- {run['ranks']} {run['cardinality']}: ranks x{run['ranks'] / base['ranks']:.0f}, "
              f"head series x{head_ratio:.1f}, RSS x{rss_ratio:.1f}, "
              f"rule evaluation x{_evaluation(p) / _evaluation(b):.1f}; per added rank "
              f"{series / ranks:.0f} head series, {rss / ranks / 1024:.0f} KB")
    print("\n## Rule groups, shipped rules (median of the last samples, ms; max in brackets)\n")
    names = sorted({k.split(":", 1)[1] for run in runs for k in run["prometheus"]
                    if k.startswith("group:")})
    print("| group | " + " | ".join(f"{r['ranks']} {r['cardinality']}" for r in runs) + " |")
    print("|---|" + "---|" * len(runs))
    for name in names:
        print(f"| {name} | " + " | ".join(
            f"{1000 * r['prometheus'].get('group:' + name, 0):.1f} "
            f"({1000 * r['prometheus'].get('max_group:' + name, 0):.0f})" for r in runs) + " |")
    largest = max(runs, key=lambda r: (r["ranks"], r["cardinality"] == "full"))
    rules = sorted(((v, k.split(":", 3)[3]) for k, v in largest["prometheus"].items()
                    if k.startswith("rule:")), reverse=True)[:10]
    print(f"\nMost expensive rules at {largest['ranks']} ranks ({largest['cardinality']}): "
          + ", ".join(f"{name} {1000 * v:.0f} ms" for v, name in rules))
    print("\n## The simulator itself\n")
    for run in runs:
        print(f"- {run['ranks']} ranks ({run['cardinality']}): {_mb(run['worker_rss_bytes'])} "
              f"peak RSS in its {run['workers']} workers, "
              f"{run['worker_rank_rss_bytes'] / run['ranks'] / 1024:.0f} KB per rank above the "
              f"interpreter, {run['worker_cpu_seconds']:.0f} CPU s in {run['wall_seconds']:.0f} s, "
              f"{run['export_errors']} export errors; page delays: {run['pages']['delays']}")
    for run in runs:
        if run["trend"] and run["trend"][-1]["seconds"] > 600:
            print(f"\n## {run['ranks']} ranks ({run['cardinality']}) over time: the [1h] windows "
                  "of the rules fill\n")
            print("| minute | rule evaluation, all groups | head series | RSS |")
            print("|---|---|---|---|")
            for minute in range(0, int(run["trend"][-1]["seconds"] // 60) + 1, 5):
                near = [t for t in run["trend"] if minute * 60 <= t["seconds"] < minute * 60 + 60]
                if near:
                    evaluation = statistics.median(t["evaluation_seconds"] for t in near)
                    print(f"| {minute} | {1000 * evaluation:.0f} ms"
                          f" | {near[-1]['head_series']:.0f} | {_mb(near[-1]['rss_bytes'])} |")
    for run in runs:
        if "dashboards" in run:
            print(f"\n## Dashboard queries at {run['ranks']} ranks ({run['cardinality']}), "
                  f"median of 3; range queries of {POINTS} points (a 3-hour panel)\n")
            print("| dashboard | panel | kind | ms | series |")
            print("|---|---|---|---|---|")
            def ms(seconds: float | None) -> str:
                return "timed out" if seconds is None else f"{1000 * seconds:.0f}"
            for row in sorted(run["dashboards"], key=lambda r: -(r["all_seconds"] or 1e9)):
                print(f"| {row['dashboard'].replace('mfotel-', '')} | {row['panel']} | "
                      f"{'instant' if row['instant'] else 'range'} | {ms(row['all_seconds'])} | "
                      f"{row['all_series']} |")


def _plan_key(run: dict[str, Any]) -> tuple[int, str]:
    return run["ranks"], "full+node" if run.get("node_agents") else run["cardinality"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--health-at", type=int, nargs="*", default=[1024],
                        help="sizes also run at cardinality health")
    parser.add_argument("--interval", type=float, default=15.0,
                        help="scrape/evaluation interval of the alert checks' Prometheus "
                             "(default: the shipped one; each scrape of 1024 ranks costs the "
                             "simulator's workers ~2 ms of CPU)")
    parser.add_argument("--hold-minutes", type=float, default=0.0,
                        help="keep the largest full run going this much longer (windows fill)")
    parser.add_argument("--node-agents-at", type=int, nargs="*", default=[1024],
                        help="sizes also run with a node agent per node (full cardinality)")
    parser.add_argument("--no-dashboards", action="store_true",
                        help="do not time the dashboards' queries at the largest size")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--resume", action="store_true",
                        help="keep the runs already in --json (same sizes) and run the rest")
    args = parser.parse_args()
    plan = [(size, level) for size in args.sizes
            for level in ("full", "health") if level == "full" or size in args.health_at]
    plan += [(size, "full+node") for size in args.node_agents_at]
    runs = []
    if args.resume and args.json and args.json.is_file():
        runs = [run for run in json.loads(args.json.read_text())
                if _plan_key(run) in plan and not run["errors"]]
        print(f"resuming with {[(r['ranks'], r['cardinality']) for r in runs]} from {args.json}",
              file=sys.stderr)
    done = {_plan_key(run) for run in runs}
    for size, level in plan:
        if (size, level) in done:
            continue
        largest = size == max(args.sizes) and level == "full"
        dashboards = largest and not args.no_dashboards
        agents = level == "full+node"
        runs.append(measure(size, "full" if agents else level, dashboards, args.interval,
                            60 * args.hold_minutes if largest else 0.0, node_agents=agents))
        if args.json:   # after each run: a later failure keeps what was measured
            args.json.write_text(json.dumps(runs, indent=1))
    print(f"(machine: {os.cpu_count()} cores; checks' Prometheus every "
          f"{args.interval:g} s)")
    runs.sort(key=lambda run: (run["ranks"], run["cardinality"] != "full",
                               bool(run.get("node_agents"))))
    report([run for run in runs if not run.get("node_agents")])
    report_node_agents(runs)
    return 0 if all(run["ok"] for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
