"""What `mfotel simulate --shards` checks of the topology's own faults
(mfotel/simulation/topology_faults.py), from the notifications a webhook received."""
from __future__ import annotations

from typing import Any, cast

from mfotel.alerting.webhook import ReceivedAlert
from mfotel.localstack.sharded import ShardedStack
from mfotel.simulation.stack import Notification
from mfotel.simulation.topology_faults import SCRAPER_DOWN, TopologyFaults


def _call(at: float, *alerts: tuple[str, str, dict[str, str]]) -> Notification:
    return Notification(at, 100, [ReceivedAlert(status, {"alertname": name, **labels},
                                                {"description": f"{name} text"})
                                  for status, name, labels in alerts])


def _faults(killed_at: float = 100.0) -> TopologyFaults:
    faults = TopologyFaults(cast(Any, object()), "t")
    faults.check.killed_shard, faults.check.killed_at = "1", killed_at
    return faults


def test_one_page_naming_the_killed_shard_is_ok():
    check = _faults().read([
        _call(50.0, ("firing", "MindFormersRankDown", {"job_name": "t-rank-down", "rank": "0"})),
        _call(130.0, ("firing", SCRAPER_DOWN, {"shard": "1"})),
        _call(190.0, ("resolved", SCRAPER_DOWN, {"shard": "1"}))])
    assert (check.notifications, check.shards_named, check.others, check.delay) == (
        1, ("1",), [], 30.0)
    assert check.description == f"{SCRAPER_DOWN} text" and check.ok


def test_a_second_page_another_shard_or_another_alert_of_no_job_is_not():
    twice = _faults().read([_call(130.0, ("firing", SCRAPER_DOWN, {"shard": "1"})),
                            _call(200.0, ("firing", SCRAPER_DOWN, {"shard": "1"}))])
    assert twice.notifications == 2 and not twice.ok
    wrong = _faults().read([_call(130.0, ("firing", SCRAPER_DOWN, {"shard": "0"}))])
    assert wrong.shards_named == ("0",) and not wrong.ok
    other = _faults().read([
        _call(130.0, ("firing", SCRAPER_DOWN, {"shard": "1"})),
        _call(140.0, ("firing", "MindFormersGlobalRulerDown", {"mfotel_component": "store"}))])
    assert len(other.others) == 1 and "MindFormersGlobalRulerDown" in other.others[0]
    assert not other.ok


class _Scraper:
    """A shard's query API as the faults read it: the (job, rank) it holds."""

    def __init__(self, held: list[tuple[str, str]]) -> None:
        self.held = held

    def query(self, expr: str) -> list[dict[str, Any]]:
        assert "mindformers_train_status" in expr
        return [{"metric": {"job_name": job, "rank": rank}, "value": [0, "1"]}
                for job, rank in self.held]


class _Stack:
    """The parts of a ShardedStack the faults use (the real one: the sharded e2e tests)."""

    shards = 2

    def __init__(self, held: list[list[tuple[str, str]]]) -> None:
        self.killed: list[str] = []
        self.scrapers = [_Scraper(h) for h in held]

    def kill_alertmanager(self, index: int) -> None:
        self.killed.append(f"am-{index}")

    def kill_scraper(self, shard: int) -> None:
        self.killed.append(f"shard-{shard}")

    def scraped_targets(self, shard: int) -> list[dict[str, Any]]:
        return [{}] * (5 + shard)


def test_the_faults_are_played_once_each():
    stack = _Stack([[("t-a", "0")], [("t-a", "1")]])
    faults = TopologyFaults(cast(ShardedStack, stack), "t")
    for now in (10.0, 11.0):
        faults.at_faults(now)
        faults.after_pages(now + 50)
    # no page named a rank: the last shard
    assert stack.killed == ["am-0", "shard-1"]
    assert (faults.check.alertmanager_killed_at, faults.check.killed_at,
            faults.check.shard_ranks, faults.check.killed_shard) == (10.0, 60.0, 6, "1")
    assert faults.waiting   # until its page is read


def test_the_shard_killed_is_the_one_that_scraped_most_of_the_ranks_the_pages_named():
    stack = _Stack([[("t-a", "1"), ("t-b", "2"), ("t-c", "0")], [("t-a", "3"), ("t-b", "0")]])
    faults = TopologyFaults(cast(ShardedStack, stack), "t")
    faults.after_pages(60.0, [("t-a", "1"), ("t-b", "2"), ("t-a", "3")])
    assert stack.killed == ["shard-0"]
    assert (faults.check.killed_shard, faults.check.held_named, faults.check.shard_ranks) == (
        "0", 2, 5)
    tie = _Stack([[("t-a", "1")], [("t-a", "3")]])
    TopologyFaults(cast(ShardedStack, tie), "t").after_pages(60.0, [("t-a", "1"), ("t-a", "3")])
    assert tie.killed == ["shard-1"]


def test_shards_without_the_local_stack_is_refused_naming_the_fix(capsys):
    from mfotel.simulation.run import main
    assert main(["--ranks", "64", "--shards", "2"]) == 2
    err = capsys.readouterr().err
    assert "--shards 2" in err and "--with-stack" in err
