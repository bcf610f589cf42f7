"""Goodput on the sharded topology: the simulated restart of tests/support/restart_sim.py
scraped by two Prometheus shards by target that remote_write to VictoriaMetrics,
its goodput records evaluated by the real vmalert over the store (the global part of
`mfotel rules --topology sharded`): MetricsQL must account the run as one Prometheus does.

The truth is read from the raw series in the store (what a record can know: each rank's last
scrape before the kill), as the unsharded test reads it from Prometheus.
"""
from __future__ import annotations

import time

import pytest

from mfotel.alerting import goodput
from mfotel.alerting.rules import RulesConfig
from mfotel.localstack.servers import http_get_json
from mfotel.localstack.sharded import ShardedStack
from mfotel.localstack.victoria import VictoriaMetrics
from mfotel.simulation.attempts import resume_step
from tests.support.restart_sim import AFTER_RESTART, RANKS, TIMING, restart_run
from tests.support.waiting import settle, wait_for

pytestmark = pytest.mark.slow

#: Why the test fails today (found by it, 2026-12-06; issue 36 stays open for it): vmalert
#: writes a record to the store a flush after its evaluation, so a rule reads the records
#: before it in its group from the group's previous evaluation; the store forgets a series
#: 2.5 scrape intervals after its last sample (so that a killed shard's ranks vanish: a
#: killed Prometheus sends no staleness markers), which is shorter than the goodput group's
#: interval (1m shipped, 5 s here). Every goodput record past the first three reads nothing
#: and records nothing: with the store's staleness at 12 s the chain records again (a debug
#: run). Running the goodput group at the ruler's interval (1 s here) is not the fix: its
#: records came back, but the restart counted no attempt and no downtime (each record reads
#: the ones before it an evaluation late). The fix needs the goodput part written for a ruler
#: whose records arrive an evaluation late.
STALE_RECORDS = ("the store forgets the goodput group's records between its evaluations "
                 "(staleness 2.5 scrape intervals < the group's interval): issue 36")


def _values(store: VictoriaMetrics, expr: str, at: float | None = None) -> list[float]:
    return [float(row["value"][1]) for row in store.query(expr, at)]


def _one(store: VictoriaMetrics, expr: str, at: float | None = None) -> float:
    (value,) = _values(store, expr, at)
    return value


def _diagnosis(stack: ShardedStack, run: str) -> str:
    """What the store holds of the goodput records, and vmalert's rule errors."""
    assert stack.store is not None and stack.ruler is not None
    held = {name: stack.store.query(f"{name}{{{run}}}")
            for name in (goodput.ATTEMPTS, goodput.WALL, goodput.CATEGORY_TOTAL)}
    rules = http_get_json(f"{stack.ruler.url}/api/v1/rules")["data"]["groups"]
    errors = [(g["name"], r.get("name"), r.get("lastError")) for g in rules
              for r in g.get("rules", []) if r.get("lastError")]
    return f"store: {held}; vmalert errors: {errors[:10]}"


@pytest.mark.xfail(strict=True, reason=STALE_RECORDS)
def test_vmalert_accounts_a_restart_over_two_shards_as_one_prometheus_does(tmp_path):
    planned = restart_run(tmp_path, "gs")
    stack = ShardedStack(tmp_path / "stack", tmp_path / "targets" / "*.json", shards=2,
                         interval=1.0, rules=RulesConfig())
    with pytest.MonkeyPatch.context() as patch:   # the goodput records every 5 s (1m shipped)
        patch.setattr(goodput, "INTERVAL", "5s")
        stack.start()
    try:
        store = stack.store
        assert store is not None
        planned.go()
        restarted, run, ranks = planned.restarted, planned.run, planned.ranks
        scraped = f"count(last_over_time(mindformers_train_step{ranks}[3s]))"
        wait_for(lambda: _values(store, scraped) == [RANKS],
                 settle(TIMING.startup_seconds + 15), 0.5, "every rank in the store")
        # hashmod of the address splits the 8 targets (all on one shard 2 times in 256: the
        # global part then still reads them through the store, with their `shard` label)
        by_shard = [len(stack.scraped_targets(shard)) for shard in range(2)]
        time.sleep(max(restarted + TIMING.startup_seconds + AFTER_RESTART - time.time(), 0))

        def accounted() -> bool:
            attempts = _values(store, f"sum_over_time({goodput.ATTEMPTS}{{{run}}}[5m])")
            wall = _values(store, f"timestamp({goodput.WALL}{{{run}}})")
            return attempts == [2.0] and bool(wall) and \
                wall[0] > restarted + TIMING.startup_seconds
        # not stretched by the machine's load: while the records are missing (the expected
        # failure) the wait always runs out, and stretched it took 6 minutes of a loaded suite
        wait_for(accounted, 20.0, 1.0, "two attempts in vmalert's goodput records",
                 details=lambda: _diagnosis(stack, run))
        now = time.time()

        between = restarted - 0.5
        window = f"[{int(TIMING.fault_at)}s]"
        last_steps = _values(
            store, f"max by (rank) (last_over_time(mindformers_train_step{ranks}{window}))",
            between)
        last_events = _values(
            store,
            f"max by (rank) (last_over_time("
            f"mindformers_train_process_start_timestamp_seconds{ranks}{window}))"
            f" + on (rank) sum by (rank) "
            f"(last_over_time(mindformers_train_time_seconds_total{ranks}{window}))", between)
        assert len(last_steps) == len(last_events) == RANKS, (last_steps, last_events)
        high_water = min(last_steps)
        last = int(TIMING.warmup_seconds // TIMING.step_seconds)
        checkpoint = resume_step(last, TIMING)
        assert checkpoint == 16 and last - 1 <= high_water <= last, last_steps
        downtime = sum(restarted - event for event in last_events) / RANKS
        assert TIMING.restart_pause_seconds < downtime < TIMING.restart_pause_seconds + 1.5

        recorded = {r["metric"]["category"]: float(r["value"][1]) for r in store.query(
            f"last_over_time({goodput.CATEGORY_TOTAL}{{{run}}}[10s])", now)}
        assert _one(store, f"last_over_time({goodput.RECOMPUTED_TOTAL}{{{run}}}[10s])", now) \
            == pytest.approx(high_water - checkpoint, abs=1)
        assert recorded["downtime"] == pytest.approx(downtime, abs=0.5)
        assert recorded["recomputed"] > 0 and recorded["startup"] > TIMING.startup_seconds
        wall = _one(store, f"last_over_time({goodput.WALL}{{{run}}}[10s])", now)
        assert sum(recorded.values()) == pytest.approx(wall, abs=1e-3)
        assert -0.1 <= recorded[goodput.UNACCOUNTED] < 2.5 * TIMING.step_seconds
        print(f"\n[goodput sharded] ranks by shard {by_shard}, recorded {recorded}, "
              f"truth downtime {downtime:.2f}, redone {high_water - checkpoint:g}")
    finally:
        try:
            planned.sim.stop()
        finally:
            stack.stop()
