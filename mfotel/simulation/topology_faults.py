"""`mfotel simulate --shards K`: the scripted faults of the sharded topology itself, and what
they must page (docs/scaling.md, section 7).

- one Alertmanager of the clustered pair is killed as the jobs' faults begin: every fault
  still pages exactly once, through the other;
- one Prometheus shard is killed once every job's fault has paged (the shard that scraped
  most of the ranks the pages named, so its incidents must keep their culprits): one
  `MindFormersScraperDown` naming it (and each job's share of ranks it held), and nothing
  else: its ranks never page as down, missing or stalled, no incident pages again.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..localstack.sharded import ShardedStack
from .stack import Notification

SCRAPER_DOWN = "MindFormersScraperDown"


@dataclass
class TopologyCheck:
    """What the webhook received about the topology's own faults."""

    killed_shard: str | None = None
    killed_at: float | None = None
    alertmanager_killed_at: float | None = None
    shard_ranks: int = 0            # rank targets the killed shard scraped
    held_named: int = 0             # ranks named by the incidents' pages it scraped
    notifications: int = 0          # firing calls naming SCRAPER_DOWN
    shards_named: tuple[str, ...] = ()
    description: str = ""
    delay: float | None = None      # seconds from the kill to the first call
    others: list[str] = field(default_factory=list)   # any other firing alert of no job

    @property
    def ok(self) -> bool:
        return (self.notifications == 1 and self.shards_named == (self.killed_shard,)
                and not self.others)


class TopologyFaults:
    """Kills an Alertmanager at the faults and a shard once every incident has paged."""

    def __init__(self, stack: ShardedStack, prefix: str, kill_alertmanager: bool = True,
                 kill_scraper: bool = True) -> None:
        self.stack, self.prefix = stack, prefix
        self.kill_alertmanager, self.kill_scraper = kill_alertmanager, kill_scraper
        self.check = TopologyCheck()

    def at_faults(self, now: float) -> None:
        if self.kill_alertmanager and self.check.alertmanager_killed_at is None:
            self.stack.kill_alertmanager(0)
            self.check.alertmanager_killed_at = now

    def after_pages(self, now: float, named: Sequence[tuple[str, str]] = ()) -> None:
        """Every incident has paged: kill the shard that scraped most of the ranks the pages
        named (`named`: job name, rank; the last shard of a tie), so that its incidents must
        keep their culprits and not page again."""
        if self.kill_scraper and self.check.killed_at is None:
            held = [self._held(shard, set(named)) for shard in range(self.stack.shards)]
            shard = max(range(self.stack.shards), key=lambda s: (held[s], s))
            self.check.held_named = held[shard]
            self.check.shard_ranks = len(self.stack.scraped_targets(shard))
            self.stack.kill_scraper(shard)
            self.check.killed_shard, self.check.killed_at = str(shard), now

    def _held(self, shard: int, named: set[tuple[str, str]]) -> int:
        """How many of `named` (job name, rank) shard `shard` scraped within the last hour."""
        rows = self.stack.scrapers[shard].query(
            "max by (job_name, rank) (last_over_time(mindformers_train_status[1h]))")
        return sum((r["metric"].get("job_name", ""), r["metric"].get("rank", "")) in named
                   for r in rows)

    @property
    def waiting(self) -> bool:
        """Whether the scraper's page is still awaited."""
        return self.check.killed_at is not None and self.check.notifications == 0

    def read(self, received: Sequence[Notification]) -> TopologyCheck:
        """The check, from the notifications received so far."""
        check = self.check
        calls, others = [], []
        for notification in received:
            alerts = [a for a in notification.alerts if a.firing
                      and not a.labels.get("job_name", "").startswith(self.prefix + "-")]
            if any(a.alertname == SCRAPER_DOWN for a in alerts):
                calls.append((notification, alerts))
            others += [f"{a.alertname} {dict(a.labels)}" for a in alerts
                       if a.alertname != SCRAPER_DOWN]
        check.notifications, check.others = len(calls), others
        named = {a.labels.get("shard", "") for _, alerts in calls for a in alerts
                 if a.alertname == SCRAPER_DOWN}
        check.shards_named = tuple(sorted(named))
        if calls:
            first, alerts = calls[0]
            check.description = next(a.annotations.get("description", "") for a in alerts
                                     if a.alertname == SCRAPER_DOWN)
            if check.killed_at is not None:
                check.delay = first.received_at - check.killed_at
        return check
