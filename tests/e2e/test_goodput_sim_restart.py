"""Goodput of a simulated job killed and restarted (mfotel/simulation/attempts.py), watched by
a real Prometheus with the shipped rules: the simulator's attempts as the records see them.

One job of 8 simulated ranks (2 nodes, the real rank exporter each), a step a second, a
checkpoint every 12 steps: every rank SIGKILLed 20.5 s into training, its next process started
4 s later on the same port with the same run id, 2 s of start-up, resuming after the last
checkpoint. Prometheus scrapes every second, evaluates every rule every second and the goodput
records every 5 s (1m as shipped). The truth is cut from the raw series (what a record can
know: each rank's last scrape before the kill): two attempts, the steps between the
checkpoint and the last step every rank was scraped at are done again, the downtime is from
each rank's last scraped event to its new process start; the dashboards mark each attempt.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from mfotel.alerting import goodput
from mfotel.alerting.rules import write_rules
from mfotel.dashboards.queries import ALL, dashboard_queries, substitute
from mfotel.localstack.alerting import shipped_files
from mfotel.localstack.servers import Prometheus
from mfotel.simulation.stack import prometheus_config
from tests.support.paths import ROOT
from tests.support.restart_sim import (
    AFTER_RESTART,
    RANKS,
    TIMING,
    UNACCOUNTED_MOST,
    restart_run,
    truth,
)
from tests.support.waiting import settle, wait_for

pytestmark = pytest.mark.slow


def _prometheus(workdir: Path, file_sd: Path) -> Prometheus:
    """The shipped config and rules on the simulation's targets, every second; the goodput
    records every 5 s."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(goodput, "INTERVAL", "5s")
        rules = write_rules(workdir / "rules")
    config = prometheus_config(shipped_files()["prometheus"], file_sd, None, 1.0,
                               [path.name for path in rules])
    return Prometheus(config, rule_files=rules, workdir=workdir / "prometheus")


def _one(prom: Prometheus, expr: str, at: float | None = None) -> float:
    (row,) = prom.query(expr, at)
    return float(row["value"][1])


def test_a_simulated_restart_is_two_attempts_with_its_recomputed_steps_and_downtime(tmp_path):
    planned = restart_run(tmp_path, "gp")
    job = planned.job
    prom = _prometheus(tmp_path, tmp_path / "targets" / "*.json").start()
    try:
        planned.go()
        start, restarted, run, ranks = (planned.start, planned.restarted, planned.run,
                                        planned.ranks)
        scraped = f"count(mindformers_train_step{ranks})"
        wait_for(lambda: prom.query(scraped) and _one(prom, scraped) == RANKS,
                 settle(TIMING.startup_seconds + 10), 0.5, "every rank scraped")
        time.sleep(max(restarted + TIMING.startup_seconds + AFTER_RESTART - time.time(), 0))

        def accounted() -> bool:
            # both attempts recorded, and the goodput records past the restart's first steps
            attempts = prom.query(f"sum_over_time({goodput.ATTEMPTS}{{{run}}}[5m])")
            return bool(attempts) and float(attempts[0]["value"][1]) == 2 and _one(
                prom, f"timestamp({goodput.WALL}{{{run}}})") > restarted + TIMING.startup_seconds
        wait_for(accounted, settle(15), 0.5, "two attempts in the goodput records")
        now = time.time()

        # the truth, from each rank's last scrape of attempt 1 (read between the attempts)
        between = restarted - 0.5
        window = f"[{int(TIMING.fault_at)}s]"
        last_steps = [float(r["value"][1]) for r in prom.query(
            f"last_over_time(mindformers_train_step{ranks}{window})", between)]
        last_events = [float(r["value"][1]) for r in prom.query(
            f"last_over_time(mindformers_train_process_start_timestamp_seconds{ranks}{window})"
            f" + on (job_name, rank) sum by (job_name, rank) "
            f"(last_over_time(mindformers_train_time_seconds_total{ranks}{window}))", between)]
        # the series' latest values since the restart: scrapes that failed under load
        # (staleness markers; once none answered for 10 s) must not hide a rank at `now`
        recent = f"[{int(now - restarted)}s]"
        starts = {float(r["value"][1]) for r in prom.query(
            f"last_over_time(mindformers_train_process_start_timestamp_seconds{ranks}{recent})",
            now)}
        redone, downtime = truth(last_steps, last_events, restarted)
        (start_2,) = starts
        assert _one(prom, f'count(last_over_time({{__name__="mindformers_train_rank_info", '
                          f'{run}, attempt="2"}}{recent}))', now) == RANKS
        assert start_2 == pytest.approx(restarted, abs=1e-6), "started when scripted"

        recorded = {r["metric"]["category"]: float(r["value"][1]) for r in prom.query(
            f"{goodput.CATEGORY_TOTAL}{{{run}}}", now)}
        # the mean of the ranks' redone steps: exact on a quiet machine; under load the ranks'
        # last scrapes before the kill may be a step apart (23 of 24 steps for 8 ranks seen)
        assert _one(prom, f"{goodput.RECOMPUTED_TOTAL}{{{run}}}", now) == \
            pytest.approx(redone, abs=1)
        assert recorded["downtime"] == pytest.approx(downtime, abs=1e-6)
        # recomputed time if and only if scraped steps were redone
        assert (recorded["recomputed"] > 0) == (redone > 0)
        assert recorded["startup"] > TIMING.startup_seconds
        wall = _one(prom, f"{goodput.WALL}{{{run}}}", now)
        assert sum(recorded.values()) == pytest.approx(wall, abs=1e-6)
        # the ranks run: what is not accounted yet is the step in progress and the age of the
        # ranks' last scrape, a scrape interval, two where one failed under load (3.23 s
        # seen). Below 0 by at most a scrape's duration: a rank's account is as of when it
        # answered, its sample as of when the scrape began (-0.53 s seen at a load of 20;
        # -21 ms beside another stack: the ranks' and the ruler's clocks)
        since = f"[{int(now - start) + 5}s]"
        slowest = _one(prom, f"max(max_over_time(scrape_duration_seconds{since}))", now)
        assert -0.1 - slowest <= recorded[goodput.UNACCOUNTED] < UNACCOUNTED_MOST, slowest

        # the dashboards' attempt marks: each attempt at its processes' first start
        overview = json.loads((ROOT / "grafana" / "dashboards" /
                               "mfotel-training-overview.json").read_text())
        (marks,) = [q for q in dashboard_queries(overview) if q.title == "annotation: Attempts"]
        expr = substitute(marks.expr, {"job_name": [job.name], "run_id": ALL, "rank": ALL})
        starts_1 = {float(r["value"][1]) * 1000 for r in prom.query(
            f"last_over_time(mindformers_train_process_start_timestamp_seconds{ranks}{window})",
            between)}
        (series,) = prom.query(f"({expr})[{int(now - start) + 5}s:1s]", now)
        values = [float(v) for _, v in series["values"]]
        changes = [v for i, v in enumerate(values) if i == 0 or v != values[i - 1]]
        # each attempt marked at its first start, once: attempt 1's mark may come down to
        # its earliest rank's start while its ranks are first scraped (in two evaluations),
        # never back once the ranks are killed and their last scrapes age out one by one
        assert changes[-2:] == [min(starts_1), start_2 * 1000], changes
        assert set(changes[:-1]) <= starts_1 and changes[:-1] == sorted(changes[:-1],
                                                                          reverse=True), changes
    finally:
        try:
            planned.sim.stop()
        finally:
            prom.stop()
