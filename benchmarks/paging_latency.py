"""NaN step -> page at the webhook, with the shipped Prometheus and Alertmanager files.

    .venv/bin/python benchmarks/paging_latency.py [--runs 5] [--interval 1]

Real `prometheus` runs the shipped prometheus.yml and rules with the changes an operator makes
(the scrape targets, the Alertmanager address, scrape and evaluation every --interval seconds;
shipped: 15), real `prometheus-alertmanager` runs the shipped alertmanager.yml with only the
webhook URL changed, and `mfotel alerts-receiver` listens on loopback. Each run trains the demo
network under a fresh job_name and makes its loss NaN at a known step, at a random moment of
the scrape cycle (the run waits until Prometheus scrapes it, then a uniform random part of one
interval). Latency = arrival of the MindFormersLossNotFinite notification minus the monitor's
timestamp of the NaN step (`mindformers_train_last_step_timestamp_seconds`).

Rule path: the Prometheus rule alone. Fast path: `alertmanager_url` set, Prometheus running too
(the rule's copy of the alert must not page again). The rule path is split into its parts from
Prometheus' own data: NaN step -> first scrape seeing it, -> the rule firing, -> the webhook.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mfotel.demo.alerting import scrape_gate, step_clock
from mfotel.demo.training import run_demo
from mfotel.localstack.alerting import AlertingStack
from mfotel.localstack.servers import free_port, http_get_json, unix_seconds

ALERT = "MindFormersLossNotFinite"
PHASE = random.Random()   # own generator: the demo's ms.set_seed(0) reseeds the global one
STEPS, NAN_AT, STEP_SECONDS = 60, 30, 0.05


@dataclass
class Run:
    path: str
    latency: float            # NaN step -> first notification at the webhook
    pages: int                # firing notifications for the run's job when measured
    scraped: float | None     # NaN step -> first scrape that saw loss_finite 0
    fired: float | None       # NaN step -> the rule's activeAt (its evaluation)


def jitter(step: int, seconds: float) -> Any:
    """After `step`, wait a uniform random part of `seconds`: the NaN's phase in the cycle."""
    from mindspore.train import Callback

    class Jitter(Callback):
        def on_train_step_end(self, run_context: Any) -> None:
            if int(run_context.original_args().cur_step_num) == step:
                time.sleep(PHASE.uniform(0, seconds))
    return Jitter()


def first_zero_scrape(stack: AlertingStack, job: str) -> float | None:
    """Unix time of the first scrape whose loss_finite was 0 (raw samples of the last 10m)."""
    result = stack.prometheus.query(f'mindformers_train_loss_finite{{job_name="{job}"}}[10m]')
    times = [float(t) for series in result for t, v in series["values"] if float(v) == 0]
    return min(times) if times else None


def rule_active_at(stack: AlertingStack, job: str) -> float | None:
    """Unix time the rule's alert became active (the evaluation that fired it)."""
    alerts = http_get_json(f"{stack.prometheus.url}/api/v1/alerts")["data"]["alerts"]
    times = [unix_seconds(a["activeAt"]) for a in alerts
             if a["labels"].get("alertname") == ALERT and a["labels"].get("job_name") == job]
    return min(times) if times else None


def measure(stack: AlertingStack, port: int, path: str, index: int, interval: float) -> Run:
    job = f"paging-{path}-{index}"
    clock: dict[int, float] = {}
    settings: dict[str, Any] = {"alertmanager_url": stack.alertmanager.url} \
        if path == "fast" else {}
    run_demo(steps=STEPS, port=port, nan_at_step=NAN_AT, job_name=job,
             min_step_seconds=STEP_SECONDS, linger_seconds=2 * interval + 5,
             output={"console": False},
             extra_callbacks=(scrape_gate(stack.prometheus, job, NAN_AT - 1),
                              jitter(NAN_AT - 1, interval), step_clock(NAN_AT, clock)),
             **settings)
    page = stack.receiver.wait_for(
        lambda a: a.firing and a.alertname == ALERT and a.labels.get("job_name") == job,
        timeout=4 * interval + 30)
    nan = clock[NAN_AT]
    if path == "rule":   # the rule's parts; the fast path's page does not wait for them
        stack.prometheus.wait_for(f'ALERTS{{alertname="{ALERT}", job_name="{job}"}}',
                                  timeout=4 * interval + 30)
    scraped, fired = first_zero_scrape(stack, job), rule_active_at(stack, job)
    pages = len(stack.receiver.received(
        lambda a: a.firing and a.alertname == ALERT and a.labels.get("job_name") == job))
    return Run(path, page.received_at - nan, pages,
               None if scraped is None else scraped - nan, None if fired is None else fired - nan)


def _stats(values: list[float]) -> str:
    return (f"{statistics.median(values):7.3f} {max(values):7.3f} {min(values):7.3f}"
            if values else f"{'-':>7} {'-':>7} {'-':>7}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="runs per path (default 5)")
    parser.add_argument("--interval", type=int, default=1,
                        help="scrape and evaluation interval in seconds (default 1; shipped 15)")
    parser.add_argument("--paths", nargs="+", choices=("rule", "fast"), default=["rule", "fast"])
    args = parser.parse_args(argv)
    os.environ.setdefault("GLOG_v", "3")
    port = free_port()
    runs: list[Run] = []
    with AlertingStack([f"127.0.0.1:{port}"], interval_seconds=args.interval, out=None) as stack:
        print(f"shipped files, changed only in: {'; '.join(stack.changes)}")
        for index in range(args.runs):
            for path in args.paths:
                run = measure(stack, port, path, index, args.interval)
                runs.append(run)
                print(f"  {path} path run {index + 1}: {run.latency:.3f} s, "
                      f"{run.pages} page(s)", flush=True)
    goal = {"rule": 2 * args.interval + 1, "fast": 1.0}
    print(f"\nNaN step -> webhook, seconds ({args.runs} runs per path; scrape and evaluation "
          f"every {args.interval}s; load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores)")
    print(f"{'path':<10} {'median':>7} {'max':>7} {'min':>7}  {'goal':>6}  {'pages':>7}  "
          f"parts (median): NaN->scrape, ->rule fired, ->webhook")
    status = 0
    for path in args.paths:
        mine = [r for r in runs if r.path == path]
        latencies = [r.latency for r in mine]
        parts = ""
        if path == "rule":
            scraped = [r.scraped for r in mine if r.scraped is not None]
            fired = [r.fired for r in mine if r.fired is not None]
            if scraped and fired:
                s, f = statistics.median(scraped), statistics.median(fired)
                parts = f"{s:.3f}, +{f - s:.3f}, +{statistics.median(latencies) - f:.3f}"
        met = max(latencies) <= goal[path]
        status |= 0 if met and all(r.pages == 1 for r in mine) else 1
        pages = "1 each" if all(r.pages == 1 for r in mine) else \
            "/".join(str(r.pages) for r in mine)
        print(f"{path + ' path':<10} {_stats(latencies)}  <={goal[path]:>4.1f}  {pages:>7}  {parts}"
              f"{'' if met else '  (over the goal)'}")
    return status


if __name__ == "__main__":
    sys.exit(main())
