"""The node endpoint's series: one table (pinned by tests/unit/test_node_agent.py), one collector.

Every series carries `job_name` and `rank`, as the ranks' own series do, so rules join them
`on (job_name, rank)`. An ended rank keeps its last CPU and memory figures and gains its
exit facts; the agent serves them until it exits (after its linger).

    registry.register(NodeCollector(agent.views))
"""
from __future__ import annotations

import signal
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from .agent import RankView

STATES: tuple[str, ...] = ("running", "stopped", "zombie", "exited")
CAUSES: tuple[str, ...] = ("completed", "exit_code", "signal", "oom", "cancelled", "unknown")
#: Causes that page (MindFormersRankExited): the rank ended on its own, not as asked.
FAILED_CAUSES: tuple[str, ...] = ("exit_code", "signal", "oom", "unknown")


@dataclass(frozen=True)
class NodeSeries:
    name: str                     # the sample name as exposed
    kind: str                     # gauge | counter
    help: str
    labels: tuple[str, ...] = ()  # beyond job_name and rank


SERIES: tuple[NodeSeries, ...] = (
    NodeSeries("mfotel_node_rank_info", "gauge",
               "1 for each rank the node agent follows: its local rank and process id",
               ("local_rank", "pid")),
    NodeSeries("mfotel_node_rank_state", "gauge",
               "1 for the rank process's state (running, stopped by SIGSTOP, zombie, exited), "
               "0 for the others", ("state",)),
    NodeSeries("mfotel_node_rank_stopped_timestamp_seconds", "gauge",
               "Unix time the rank process was first seen stopped (SIGSTOP, a debugger), while "
               "it is stopped; absent otherwise"),
    NodeSeries("mfotel_node_rank_endpoint_up", "gauge",
               "1 if the rank's /metrics answered the agent's last liveness probe, 0 if it was "
               "silent (absent while nothing listens)"),
    NodeSeries("mfotel_node_rank_endpoint_last_answer_timestamp_seconds", "gauge",
               "Unix time of the rank's last answer to a liveness probe (since it listens)"),
    NodeSeries("mfotel_node_rank_cpu_seconds_total", "counter",
               "User and system CPU time of the rank process (its last figure once it ended)"),
    NodeSeries("mfotel_node_rank_resident_memory_bytes", "gauge",
               "Resident memory of the rank process (its last figure once it ended)"),
    NodeSeries("mfotel_node_rank_exit_info", "gauge",
               "1 once the rank process ended: cause (completed, exit_code, signal, oom, "
               "cancelled, unknown), exit code, terminating signal",
               ("cause", "exit_code", "signal", "signal_name")),
    NodeSeries("mfotel_node_rank_exit_timestamp_seconds", "gauge",
               "Unix time the rank process ended"),
    NodeSeries("mfotel_node_rank_stack_timestamp_seconds", "gauge",
               "Unix time of the node agent's last capture of the rank's Python stacks (it "
               "stopped stepping or answering), served at <scheme>://<this endpoint>/stacks"
               "?job_name=<job_name>&rank=<rank>", ("scheme",)),
)
BY_NAME = {series.name: series for series in SERIES}


Family = GaugeMetricFamily | CounterMetricFamily


def _family(name: str) -> Family:
    series = BY_NAME[name]
    labels = ["job_name", "rank", *series.labels]
    if series.kind == "counter":
        return CounterMetricFamily(series.name.removesuffix("_total"), series.help, labels=labels)
    return GaugeMetricFamily(series.name, series.help, labels=labels)


def families(views: Sequence[RankView]) -> list[Metric]:
    """The node series of `views`."""
    out: dict[str, Family] = {series.name: _family(series.name) for series in SERIES}
    for view in views:
        who = [view.job_name, str(view.rank)]
        out["mfotel_node_rank_info"].add_metric([*who, str(view.local_rank), str(view.pid)], 1)
        for state in STATES:
            out["mfotel_node_rank_state"].add_metric([*who, state], float(state == view.state))
        if view.stopped_at is not None:
            out["mfotel_node_rank_stopped_timestamp_seconds"].add_metric(who, view.stopped_at)
        if view.endpoint_up is not None:
            out["mfotel_node_rank_endpoint_up"].add_metric(who, float(view.endpoint_up))
        if view.last_answer is not None:
            out["mfotel_node_rank_endpoint_last_answer_timestamp_seconds"].add_metric(
                who, view.last_answer)
        out["mfotel_node_rank_cpu_seconds_total"].add_metric(who, view.cpu_seconds)
        out["mfotel_node_rank_resident_memory_bytes"].add_metric(who, view.rss_bytes)
        if view.exit is not None:
            code, signum = view.exit.exit_code, view.exit.signal
            out["mfotel_node_rank_exit_info"].add_metric(
                [*who, view.exit.cause, "" if code is None else str(code),
                 "" if signum is None else str(signum),
                 "" if signum is None else signal_name(signum)], 1)
            out["mfotel_node_rank_exit_timestamp_seconds"].add_metric(who, view.exit.at)
        if view.stack_at is not None:
            out["mfotel_node_rank_stack_timestamp_seconds"].add_metric(
                [*who, view.stack_scheme], view.stack_at)
    return list(out.values())


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"SIG{signum}"


class NodeCollector:
    """A prometheus_client collector of the agent's views."""

    def __init__(self, views: Callable[[], Sequence[RankView]]) -> None:
        self.views = views

    def collect(self) -> Iterable[Metric]:
        return families(self.views())
