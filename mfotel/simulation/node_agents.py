"""Simulated node agents: one node endpoint per simulated node, as `mfotel-instrument` serves it.

Each serves the real node exposition (`mfotel.node.metrics` through
`node_endpoint`: the ranks' server stack) for its node's simulated ranks. The facts are the
simulation's: a served rank is running and answering, with a synthetic CPU time (its share
of the wall time since it started) and resident memory; a rank the `rank_down` fault ends
was killed by SIGKILL; a completed rank exited 0, a cancelled one was cancelled.

    agent = SimNodeAgent([(job, rank, local, sim_rank), ...], "127.77.0.3", 9463, ends)
    agent.close()
"""
from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ..config import parse_config
from ..node.agent import Exit, RankView
from ..node.endpoint import NodeEndpoint
from ..node.metrics import NodeCollector

#: A simulated rank's resident memory (an LLM rank's host memory is gigabytes).
RSS_BYTES = 24 << 30
CPU_SHARE = 0.95


class Followed(Protocol):
    """What the agent reads of a simulated rank (ranks.SimRank)."""

    @property
    def served(self) -> bool: ...


@dataclass
class RankEnd:
    """How a simulated rank ended (set by the worker when it ends it)."""

    at: float
    status: int          # a wait status: signal.SIGKILL (killed), 0 (completed)
    cancelled: bool = False


def views(ranks: Sequence[tuple[str, int, int, Followed, RankEnd | None]],
          started: float) -> list[RankView]:
    """(job, rank, local rank, the rank, its end) -> the node endpoint's facts now."""
    now, found = time.time(), []
    for job, rank, local, followed, end in ranks:
        cpu = CPU_SHARE * ((end.at if end else now) - started)
        done = Exit(end.at, end.status, cancelled=end.cancelled) if end else None
        live = done is None and followed.served
        found.append(RankView(job, rank, local, os.getpid(), "running" if live else "exited",
                              cpu, RSS_BYTES, True if live else None, now if live else None,
                              done))
    return found


class SimNodeAgent:
    """One simulated node's agent endpoint; `ends` maps (job, rank) to how it ended."""

    def __init__(self, ranks: Sequence[tuple[str, int, int, Followed]], host: str, port: int,
                 ends: dict[tuple[str, int], RankEnd]) -> None:
        self.ranks, self.ends, self.started = list(ranks), ends, time.time()
        prom = parse_config({"prometheus": {"host": host, "port": port + 1}},
                            source="mfotel simulate").prometheus
        self.endpoint = NodeEndpoint(NodeCollector(self.views), prom, port, "mfotel simulate")
        self.served = self.endpoint.start()

    def views(self) -> list[RankView]:
        return views([(job, rank, local, followed, self.ends.get((job, rank)))
                      for job, rank, local, followed in self.ranks], self.started)

    def close(self) -> None:
        self.endpoint.close()

