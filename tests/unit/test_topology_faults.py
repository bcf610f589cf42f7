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


def test_the_faults_are_played_once_each():
    class Stack:
        shards = 2
        killed: list[str] = []

        def kill_alertmanager(self, index: int) -> None:
            self.killed.append(f"am-{index}")

        def kill_scraper(self, shard: int) -> None:
            self.killed.append(f"shard-{shard}")

        def scraped_targets(self, shard: int) -> list[dict[str, Any]]:
            return [{}] * 5

    stack = Stack()
    faults = TopologyFaults(cast(ShardedStack, stack), "t")
    for now in (10.0, 11.0):
        faults.at_faults(now)
        faults.after_pages(now + 50)
    assert stack.killed == ["am-0", "shard-1"]
    assert (faults.check.alertmanager_killed_at, faults.check.killed_at,
            faults.check.shard_ranks, faults.check.killed_shard) == (10.0, 60.0, 5, "1")
    assert faults.waiting   # until its page is read


def test_shards_without_the_local_stack_is_refused_naming_the_fix(capsys):
    from mfotel.simulation.run import main
    assert main(["--ranks", "64", "--shards", "2"]) == 2
    err = capsys.readouterr().err
    assert "--shards 2" in err and "--with-stack" in err
