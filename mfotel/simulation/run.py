"""`mfotel simulate`: start the worker processes, write the file_sd targets, run the scenario,
and check the notifications a webhook received against what each fault must cause: one per
incident, naming the right rank, in time; then stop (every rank reports cancelled) and check
that stopping paged nobody.

    result = run_simulation(SimSettings(ranks=64, with_stack=True))
    print(format_report(result))
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import nullcontext, suppress
from dataclasses import asdict, dataclass, field
from ipaddress import IPv4Address
from pathlib import Path
from typing import Any

import yaml

from ..alerting.rules import RulesConfig, duration_seconds, parse_set
from ..cluster.discovery import target_groups, write_target_file
from ..contract import SEED_METRICS
from ..localstack.alerting import shipped_files
from ..localstack.servers import free_port_block
from ..localstack.sharded import ShardedStack, detection_seconds, global_page_lag
from .scenario import (
    Expected,
    SimJob,
    Timing,
    expected_pages,
    plan_jobs,
    quiet_seconds,
    rank_specs,
    slow_factor,
)
from .stack import CountingReceiver, Notification, PrometheusProbe, SimStack, route_setting
from .topology_faults import TopologyCheck, TopologyFaults

#: Rule thresholds and `for:` durations of a simulated run: the shipped ones would take
#: 15 minutes per fault (stall 900 s, straggler 10m). Each is shortened so its alert can fire
#: within a minute or two of its fault; docs/scaling.md says why the result transfers.
SIM_RULES: dict[str, Any] = {
    "stall_seconds": 30, "stall_for": "10s", "rank_down_for": "10s", "ranks_missing_for": "20s",
    "straggler_for": "30s", "loss_spike_for": "30s", "grad_norm_spike_for": "30s",
    # above a scrape interval and a step: the NaN loss that explains a NaN grad norm is
    # scraped from the rank it started on within one interval
    "grad_norm_nonfinite_for": "30s",
    "loss_divergence_for": "30s", "step_drift_seconds": 30, "step_drift_for": "30s",
    # the baseline within the warm-up (rate() over a window longer than a series' life
    # divides by the whole window: a young job looks slow), and the alert firing for long
    # enough to outlast group_wait before that short baseline catches up with the slow steps
    "throughput_window": "1m", "throughput_baseline_window": "1m", "throughput_drop_for": "10s",
    "overflow_storm_for": "30s", "failed_lookback": "5m"}
LOOPBACK_NODES = IPv4Address("127.77.0.1")   # node k listens on 127.77.0.1 + k
RANKS_PER_WORKER = 256


@dataclass
class SimSettings:
    ranks: int = 64
    ranks_per_node: int = 8
    processes: int = 0              # 0: one per RANKS_PER_WORKER ranks
    prefix: str = "sim"
    seed: int = 0
    cardinality: str = "full"       # monitor_config.cardinality of every rank
    step_interval: int = 1          # monitor_config.step_interval
    timing: Timing = field(default_factory=Timing)
    host: str | None = None         # None: node k on 127.77.0.1 + k; else every node here
    advertise: str | None = None    # address in the file_sd (default: host)
    port: int = 0                   # first port of each node (0: a free one)
    file_sd_dir: Path | None = None  # where each job's targets file goes (default: workdir)
    workdir: Path | None = None
    interval: float = 5.0           # scrape and evaluation interval (of your Prometheus too)
    rules: Mapping[str, Any] = field(default_factory=lambda: dict(SIM_RULES))
    with_stack: bool = False        # run Prometheus + Alertmanager + receiver on loopback
    shipped_cost: bool = False      # and a second Prometheus with the shipped rules, measured
    alertmanager_url: str | None = None  # also poll this Alertmanager's active alerts
    webhook: str | None = None      # HOST:PORT: receive your Alertmanager's notifications here
    extra_seconds: float = 0.0      # keep running this long after the checks' window
    late_seconds: float = 0.0       # then up to this long more while an expected page is missing
    node_agents: bool = False       # a node agent (mfotel-instrument's endpoint) per node
    shards: int = 0                 # with_stack: K Prometheus shards, VictoriaMetrics, vmalert,
                                    # two clustered Alertmanagers (0: one Prometheus)
    kill_topology: bool = True      # shards: kill an Alertmanager and a shard mid-run
    on_progress: Callable[[str], None] = lambda text: None
    during_run: Callable[[Simulation, SimStack | ShardedStack | None], None] | None = None

    def rules_config(self) -> RulesConfig:
        return RulesConfig(**self.rules)


# ---------------------------------------------------------------- the ranks
def rank_config(settings: SimSettings) -> dict[str, Any]:
    """Every rank's monitor_config (host and port are per node): all five seed metrics,
    sequence length known, rank 0 the metric rank at cardinality health. With two Prometheus
    servers scraping (`shipped_cost`), ranks linger the full linger_seconds, as the docs say
    for HA pairs: the first scrape of the final status must not end the linger for both."""
    return {"metrics": list(SEED_METRICS), "step_interval": settings.step_interval,
            "output": {"console": False}, "cardinality": settings.cardinality,
            "metric_ranks": [0], "batch_size": settings.timing.batch_size,
            "seq_length": settings.timing.seq_length,
            "prometheus": {"linger_until_scraped": not settings.shipped_cost}}


class Simulation:
    """The worker processes serving every rank, and the job's file_sd files."""

    def __init__(self, settings: SimSettings, workdir: Path,
                 group_wait: Callable[[Mapping[str, str]], float]) -> None:
        self.settings, self.workdir = settings, workdir
        self.jobs = plan_jobs(settings.ranks, settings.ranks_per_node, settings.prefix,
                              settings.seed)
        self.specs = rank_specs(self.jobs, settings.seed)
        self.expected = expected_pages(self.jobs, settings.timing, settings.rules_config(),
                                       settings.interval, group_wait,
                                       node_agents=settings.node_agents)
        # nodes on loopback addresses of their own share one block of ports; on one host,
        # every rank needs its own port
        block = settings.ranks_per_node if settings.host is None else settings.ranks
        self.port = settings.port or free_port_block(block, settings.host)
        nodes = settings.ranks // settings.ranks_per_node
        # node agents: every node's on one port (one address per node), else a port per node
        self.node_port = free_port_block(1 if settings.host is None else nodes, settings.host) \
            if settings.node_agents else 0
        self.file_sd_dir = settings.file_sd_dir or workdir / "targets"
        self.file_sd_dir.mkdir(parents=True, exist_ok=True)
        self.workers: list[subprocess.Popen] = []
        self.ready: list[dict[str, Any]] = []
        self.done: list[dict[str, Any]] = []
        self.start_time = math.nan

    def address(self, node: int) -> tuple[str, int]:
        """(bind address, first port) of global node `node`."""
        if self.settings.host is None:
            return str(LOOPBACK_NODES + node), self.port
        return self.settings.host, self.port + node * self.settings.ranks_per_node

    def node_address(self, node: int) -> tuple[str, int]:
        """(bind address, port) of global node `node`'s node agent."""
        host, _ = self.address(node)
        return host, self.node_port + (0 if self.settings.host is None else node)

    def _advertised(self, node: int) -> str:
        host, _ = self.address(node)
        return self.settings.advertise or host

    def start(self) -> None:
        """Start the workers, wait until every rank serves, write the targets files."""
        count = self.settings.processes or max(1, -(-len(self.specs) // RANKS_PER_WORKER))
        nodes = sorted({spec.node for spec in self.specs})
        shares = [nodes[i::count] for i in range(count)]   # whole nodes per worker
        config = rank_config(self.settings)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).resolve().parents[3]), os.environ.get("PYTHONPATH", "")])}
        for index, share in enumerate(shares):
            ranks = [{"spec": asdict(spec), "host": self.address(spec.node)[0],
                      "port": self.address(spec.node)[1],
                      "node_name": f"{self.settings.prefix}-node-{spec.node:03d}"}
                     for spec in self.specs if spec.node in set(share)]
            path = self.workdir / f"worker-{index}.json"
            path.write_text(json.dumps({
                "timing": asdict(self.settings.timing), "ranks": ranks, "monitor_config": config,
                # the orchestrator stops the workers (closing their stdin) after its checks;
                # the duration only bounds a worker whose orchestrator hangs
                "seed": self.settings.seed, "duration": self.duration + 3600,
                "slow": {job.name: slow_factor(job, self.settings.timing) for job in self.jobs},
                "faults": {job.name: job.fault for job in self.jobs},
                "node_agents": [{"node": node, "host": self.node_address(node)[0],
                                 "port": self.node_address(node)[1]}
                                for node in share if self.settings.node_agents]}))
            with open(self.workdir / f"worker-{index}.log", "w") as log:
                self.workers.append(subprocess.Popen(
                    [sys.executable, "-m", "mfotel.simulation.ranks", str(path)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                    stderr=log))
        for index, worker in enumerate(self.workers):
            assert worker.stdout is not None  # stdout=PIPE
            line = worker.stdout.readline()
            if not line:
                raise RuntimeError(f"simulation worker {index} exited before serving its ranks:\n"
                                   + (self.workdir / f"worker-{index}.log").read_text()[-3000:])
            self.ready.append(json.loads(line))
        failed = [f for ready in self.ready for f in ready["failed"]]
        if failed:
            raise RuntimeError(f"{len(failed)} ranks could not serve /metrics ({failed[0]}, ...); "
                               "choose a free --port")
        self.write_targets()

    def write_targets(self) -> None:
        """One file_sd file per job, as its launcher writes it with `mfotel targets --hosts
        NODES --ranks-per-node R --port P --out FILE` (the same functions)."""
        rpn = self.settings.ranks_per_node
        for job in self.jobs:
            nodes = range(job.first_node, job.first_node + job.nodes)
            if self.settings.host is None:
                groups = target_groups([self._advertised(node) for node in nodes], rpn, self.port)
            else:   # one address: node k's ranks on ports port + k * ranks_per_node + local
                groups = [g for node in nodes for g in target_groups(
                    [self._advertised(node)], rpn, self.address(node)[1])]
            if self.settings.node_agents:   # one target per node, as mfotel-instrument adds
                groups += [g for node in nodes for g in target_groups(
                    [self._advertised(node)], 1, self.node_address(node)[1],
                    {"mfotel_target": "node"})]
            write_target_file(self.file_sd_dir / f"{job.name}.json", groups)

    @property
    def duration(self) -> float:
        return self.settings.timing.fault_at + self.observe_seconds + self.settings.extra_seconds

    @property
    def observe_seconds(self) -> float:
        """How long after the faults the checks watch: every deadline, then a quiet period."""
        s = self.settings
        quiet = s.timing.linger_seconds + quiet_seconds(s.rules_config(), s.interval)
        return max([*(e.deadline for e in self.expected), quiet]) + s.interval

    def go(self) -> float:
        """Start the scenario's clock in every worker; returns its unix start time."""
        self.start_time = time.time() + 0.5
        for worker in self.workers:
            assert worker.stdin is not None  # stdin=PIPE
            worker.stdin.write(json.dumps({"start": self.start_time}) + "\n")
            worker.stdin.flush()
        return self.start_time

    def stop(self, timeout: float | None = None) -> None:
        """Close the workers' stdin: they stop stepping, every rank still up reports cancelled
        and lingers for its final scrape, then they shut their ranks down and report."""
        timeout = self.settings.timing.linger_seconds + 60 if timeout is None else timeout
        # every worker at once, as a job's cancellation reaches all its ranks: a job's nodes
        # are spread over the workers, and stopping them in turn would leave a job with ranks
        # gone while the others still run (MindFormersRanksMissing after stopping)
        for worker in self.workers:
            if worker.stdin is not None:
                with suppress(OSError):
                    worker.stdin.close()
                worker.stdin = None   # closed: communicate() below only reads
        for index, worker in enumerate(self.workers):
            # a worker that never became ready has no entry in self.ready
            ready = self.ready[index] if index < len(self.ready) else {}
            try:
                out, _ = worker.communicate(timeout=timeout)
                self.done += [{**ready, **json.loads(line)} for line in out.splitlines()
                              if '"done"' in line]
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.communicate()
        self.workers = []


# ---------------------------------------------------------------- what was notified
@dataclass
class IncidentCheck:
    """What the webhook received about one incident's job."""

    expected: Expected
    notifications: int = 0          # firing webhook calls about the job
    alertnames: tuple[str, ...] = ()
    ranks: tuple[str, ...] = ()     # ranks named by them ("" for a job-level alert)
    delay: float | None = None      # seconds from the fault to the first call
    bytes: int = 0                  # of those calls

    @property
    def ok(self) -> bool:
        e = self.expected
        return (self.notifications == 1 and self.alertnames == (e.alertname,)
                and self.ranks == (e.ranks or ("",)) and self.delay is not None
                and self.delay <= e.deadline)


def firing_alerts(notification: Notification, prefix: str) -> list[Any]:
    """The firing alerts of `notification` for the simulation's jobs (named `prefix-...`)."""
    return [a for a in notification.alerts
            if a.firing and a.labels.get("job_name", "").startswith(prefix + "-")]


def new_after(received: Sequence[Notification], stopped: float,
              prefix: str) -> list[Notification]:
    """The notifications from `stopped` on that page for an alert (job, name, rank) no
    notification before paged: Alertmanager's update of an incident whose ranks resolve one by
    one (the others still listed as firing) is that incident ending, not a page."""
    def keys(n: Notification) -> set[tuple[str, str, str]]:
        return {(a.labels.get("job_name", ""), a.alertname, a.labels.get("rank", ""))
                for a in firing_alerts(n, prefix)}
    paged = set().union(*(keys(n) for n in received if n.received_at < stopped))
    return [n for n in received if n.received_at >= stopped and keys(n) - paged]


def check_notifications(expected: list[Expected], received: Iterable[Notification],
                        fault_time: float, prefix: str
                        ) -> tuple[list[IncidentCheck], list[Notification]]:
    """Each incident against the firing notifications about its job; and every notification
    about a simulated job that has no incident (a false page)."""
    by_job: dict[str, list[Notification]] = {}
    for notification in received:
        for job in {a.labels["job_name"] for a in firing_alerts(notification, prefix)}:
            by_job.setdefault(job, []).append(notification)
    checks = []
    for item in expected:
        calls = by_job.get(item.job_name, [])
        alerts = [a for call in calls for a in firing_alerts(call, prefix)
                  if a.labels["job_name"] == item.job_name]
        checks.append(IncidentCheck(
            item, len(calls), tuple(sorted({a.alertname for a in alerts})),
            tuple(sorted({a.labels.get("rank", "") for a in alerts}, key=_rank_order)),
            min(c.received_at for c in calls) - fault_time if calls else None,
            sum(c.bytes for c in calls)))
    wanted = {item.job_name for item in expected}
    false = [call for job, calls in sorted(by_job.items()) if job not in wanted for call in calls]
    return checks, false


def pages_missing(sim: Simulation, webhook: CountingReceiver | None, start: float) -> bool:
    """Whether an expected incident has had no notification yet (False without a webhook)."""
    if webhook is None:
        return False
    checks, _ = check_notifications(sim.expected, list(webhook.notifications_seen),
                                    start + sim.settings.timing.fault_at, sim.settings.prefix)
    return any(check.notifications == 0 for check in checks)


def _rank_order(rank: str) -> tuple[int, str]:
    return (int(rank), "") if rank.isdigit() else (-1, rank)


class AlertmanagerPoller:
    """Polls an Alertmanager's active, unsilenced, uninhibited alerts of the simulated jobs:
    what it would notify, seen before `group_wait` is over (so never a delay measurement)."""

    def __init__(self, url: str, prefix: str, every: float = 2.0) -> None:
        self.url, self.prefix, self.every = url.rstrip("/"), prefix, every
        self.seen: set[tuple[str, str, str]] = set()   # (job_name, alertname, rank)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="mfotel-sim-am", daemon=True)

    def _loop(self) -> None:
        query = urllib.parse.urlencode({"active": "true", "silenced": "false", "inhibited": "false",
                                        "filter": f'job_name=~"{self.prefix}-.*"'})
        while not self._stop.wait(self.every):
            try:
                with urllib.request.urlopen(f"{self.url}/api/v2/alerts?{query}", timeout=10) as r:
                    alerts = json.loads(r.read().decode())
            except (OSError, ValueError):
                continue
            self.seen |= {(a["labels"].get("job_name", ""), a["labels"].get("alertname", ""),
                           a["labels"].get("rank", "")) for a in alerts
                          if a["labels"].get("severity") != "info"}

    def __enter__(self) -> AlertmanagerPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=15)


# ---------------------------------------------------------------- one run
@dataclass
class SimResult:
    settings: SimSettings
    jobs: list[SimJob]
    start_time: float
    fault_time: float
    checks: list[IncidentCheck] = field(default_factory=list)   # notifications received
    unexpected: list[Notification] = field(default_factory=list)
    after_stop: list[Notification] = field(default_factory=list)  # pages caused by stopping
    active_in_alertmanager: list[tuple[str, str, str]] = field(default_factory=list)
    workers: list[dict[str, Any]] = field(default_factory=list)
    prometheus: dict[str, float] = field(default_factory=dict)           # the checks' Prometheus
    shipped_prometheus: dict[str, float] = field(default_factory=dict)   # shipped rules/intervals
    firing_in_prometheus: list[dict[str, str]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    checked: bool = True            # False: no webhook received anything to check
    topology: TopologyCheck | None = None   # shards: the killed shard's page

    @property
    def ok(self) -> bool:
        return (self.checked and all(c.ok for c in self.checks) and not self.unexpected
                and not self.after_stop and (self.topology is None or self.topology.ok))


def topology_quiet_seconds(settings: SimSettings) -> float:
    """How long to watch after a shard is killed: its page (the store's staleness, the
    ruler, the `for:`), and the longest an alert its ranks could wrongly raise takes (down,
    missing, stalled), each with the critical route's group_wait."""
    rules = settings.rules_config()
    stall = rules.stall_seconds + duration_seconds(rules.stall_for)
    return max(detection_seconds(settings.interval, rules), stall,
               quiet_seconds(rules, settings.interval)) + 2 * settings.interval + 10


def run_simulation(settings: SimSettings) -> SimResult:
    """Run the scenario once. The checks read the notifications a webhook received: the local
    stack's (`with_stack`: Prometheus, Alertmanager and the receiver on loopback), or
    `webhook` (HOST:PORT) where your Alertmanager sends the simulated jobs' notifications.
    `alertmanager_url` (or the local one) is also polled for its active, uninhibited alerts."""
    own_dir = settings.workdir is None
    workdir = Path(settings.workdir or tempfile.mkdtemp(prefix="mfotel-sim-"))
    workdir.mkdir(parents=True, exist_ok=True)
    file_sd_dir = settings.file_sd_dir or workdir / "targets"
    stack: SimStack | ShardedStack | None = None
    if settings.with_stack and settings.shards:
        stack = ShardedStack(workdir, file_sd_dir / "*.json", settings.shards, settings.interval,
                             settings.rules_config(), CountingReceiver())
    elif settings.with_stack:
        stack = SimStack(workdir, file_sd_dir / "*.json", settings.interval,
                         settings.rules_config(), settings.shipped_cost)
    topology = TopologyFaults(stack, settings.prefix, kill_scraper=settings.shards > 1) \
        if isinstance(stack, ShardedStack) and settings.kill_topology else None
    webhook = None
    if stack is None and settings.webhook:
        host, _, port = settings.webhook.rpartition(":")
        webhook = CountingReceiver(host or "127.0.0.1", int(port))
    am_config = yaml.safe_load(shipped_files()["alertmanager"])
    def group_wait(labels: Mapping[str, str]) -> float:
        return route_setting(am_config, labels, "group_wait", "30s")
    sim = Simulation(settings, workdir, group_wait)
    if settings.shards:   # the global part's pages come through the store and the ruler
        sim.expected = [dataclasses.replace(e, deadline=e.deadline + lag, how=(
            f"{e.how} + global ruler {lag:.0f}s")) for e in sim.expected
            for lag in [global_page_lag(e.alertname, settings.rules_config(), settings.interval)]]
    say, probes, poll_url = settings.on_progress, [], settings.alertmanager_url
    result: SimResult | None = None
    try:
        if stack is not None:
            stack.start()
            assert stack.prometheus is not None and stack.alertmanager is not None
            shipped = stack.shipped if isinstance(stack, SimStack) else None
            probes = [PrometheusProbe(p) for p in (stack.prometheus, shipped) if p]
            # the Alertmanager that stays up
            poll_url = poll_url or (stack.alertmanagers[-1].url if isinstance(
                stack, ShardedStack) else stack.alertmanager.url)
            assert isinstance(stack.receiver, CountingReceiver)
            webhook = stack.receiver
            say(f"Prometheus {stack.prometheus.url}, Alertmanager {stack.alertmanager.url}, "
                f"receiver {stack.receiver.url}")
        elif webhook is not None:
            webhook.start()
            say(f"webhook {webhook.url}: route the jobs {settings.prefix}-* of your "
                f"Alertmanager there (no authentication: it only records)")
        sim.start()
        say(f"{sum(r['ready'] for r in sim.ready)} ranks serve /metrics from {len(sim.ready)} "
            f"processes; targets in {sim.file_sd_dir}")
        with (AlertmanagerPoller(poll_url, settings.prefix) if poll_url
              else nullcontext()) as poller:
            start = sim.go()
            say(f"faults at +{settings.timing.fault_at:.0f}s, run ends at +{sim.duration:.0f}s")
            for item in sim.expected:
                say(f"expect one {item.alertname} job_name={item.job_name} "
                    f"rank={','.join(item.ranks) or '-'} within {item.deadline:.0f}s of the "
                    f"faults ({item.how})")
            end = start + sim.duration
            while (now := time.time()) < end + settings.late_seconds:
                missing = pages_missing(sim, webhook, start)
                if topology is not None and webhook is not None:
                    if now >= start + settings.timing.fault_at:
                        topology.at_faults(now)
                    if not missing and now >= start + settings.timing.fault_at \
                            and topology.check.killed_at is None:
                        topology.after_pages(now, [(e.job_name, rank) for e in sim.expected
                                                   for rank in e.ranks])
                        end = max(end, now + topology_quiet_seconds(settings))
                    topology.read(webhook.notifications_seen)
                if now >= end and not missing and (topology is None or not topology.waiting):
                    break
                time.sleep(min(2.0 if topology else 10.0, max(end - now, 1.0)))
                for probe in probes:
                    probe.try_sample()
            if settings.during_run is not None:
                settings.during_run(sim, stack)
        result = SimResult(settings, sim.jobs, start, start + settings.timing.fault_at)
        if poller is not None:
            result.active_in_alertmanager = sorted(poller.seen)
        if stack is not None and stack.prometheus is not None:
            # the store holds every shard's alerts and the global ruler's
            alerts_from = stack.store if isinstance(stack, ShardedStack) else stack.prometheus
            try:   # what fired, muted or not: a busy Prometheus may not answer in time
                assert alerts_from is not None
                result.firing_in_prometheus = [r["metric"] for r in alerts_from.query(
                    f'ALERTS{{alertstate="firing", job_name=~"{settings.prefix}-.*"}}')]
            except (OSError, RuntimeError) as error:
                result.extra["firing_query_error"] = repr(error)
            result.prometheus = probes[0].summary()
            result.shipped_prometheus = probes[1].summary() if len(probes) > 1 else {}
            result.extra["trend"] = [   # the last probe's evolution: windows fill over time
                {"seconds": s["time"] - start, "rss_bytes": s.get("process_resident_memory_bytes"),
                 "head_series": s.get("prometheus_tsdb_head_series"),
                 "evaluation_seconds": sum(v for k, v in s.items() if k.startswith("group:"))}
                for s in probes[-1].samples]
        stopped = time.time()
        sim.stop()   # every rank still up reports cancelled and lingers for its final scrape
        if webhook is not None:
            # what a stopped rank could raise (rank down, ranks missing), notified
            critical = group_wait({"severity": "critical", "alertname": "MindFormersRankDown"})
            time.sleep(quiet_seconds(settings.rules_config(), settings.interval) + critical
                       + settings.interval)
            received = list(webhook.notifications_seen)
            result.checks, result.unexpected = check_notifications(
                sim.expected, [n for n in received if n.received_at < stopped],
                result.fault_time, settings.prefix)
            result.after_stop = new_after(received, stopped, settings.prefix)
            if topology is not None:
                result.topology = topology.read(received)
        else:   # nothing to check against: the schedule of what should have paged
            result.checks, result.checked = [IncidentCheck(e) for e in sim.expected], False
    finally:
        sim.stop()
        if stack is not None:
            stack.stop()
        elif webhook is not None:
            webhook.stop()
        if own_dir:
            shutil.rmtree(workdir, ignore_errors=True)
    result.workers = sim.done
    return result


def format_report(result: SimResult) -> str:
    s = result.settings
    lines = [f"# mfotel simulate: {s.ranks} ranks ({s.cardinality}), "
             f"{len(result.jobs)} jobs, scrape/eval every {s.interval:g}s"]
    for job in result.jobs:
        hit = ("all" if len(job.fault_ranks) == job.world_size
               else ",".join(map(str, job.fault_ranks)))
        lines.append(f"  {job.name}: {job.world_size} ranks, {job.fault} (ranks {hit})")
    if not result.checked:
        lines.append("not checked (no --with-stack, no --webhook); expected, from the faults:")
    lines.append("| incident | expected alert | ranks named | notifications | delay | deadline "
                 "| webhook bytes | ok |")
    lines.append("|---|---|---|---|---|---|---|---|")
    for check in result.checks:
        e = check.expected
        delay = "-" if check.delay is None else f"{check.delay:.1f}s"
        verdict = ("yes" if check.ok else "NO") if result.checked else "?"
        named = ",".join(check.ranks) if check.notifications else "-"
        lines.append(f"| {e.job_name} | {e.alertname} ({','.join(e.ranks) or 'job'}) | "
                     f"{named or 'job'} | {check.notifications} | {delay} | {e.deadline:.0f}s | "
                     f"{check.bytes} | {verdict} |")
    if not result.checked:
        return "\n".join(lines)
    lines.append(f"false notifications: {len(result.unexpected)}; after stopping: "
                 f"{len(result.after_stop)}")
    if result.topology is not None:
        t = result.topology
        delay = "-" if t.delay is None else f"{t.delay:.1f}s"
        am_at = (t.alertmanager_killed_at or 0) - result.start_time
        lines.append(f"Alertmanager 0 of 2 killed at +{am_at:.0f}s; "
                     f"shard {t.killed_shard} ({t.shard_ranks} rank targets) killed at "
                     f"+{(t.killed_at or 0) - result.start_time:.0f}s: {t.notifications} "
                     f"MindFormersScraperDown notification(s) naming shard(s) "
                     f"{','.join(t.shards_named) or '-'} after {delay}; other pages: "
                     f"{len(t.others)} ({'yes' if t.ok else 'NO'})")
        lines += [f"  {other}" for other in t.others]
    for notification in [*result.unexpected, *result.after_stop]:
        for alert in firing_alerts(notification, s.prefix):
            lines.append(f"  {alert.alertname} job_name={alert.labels.get('job_name')} "
                         f"rank={alert.labels.get('rank', '-')} ({alert.labels.get('severity')})")
    return "\n".join(lines)


# ---------------------------------------------------------------- command line
def add_simulate_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--ranks", type=int, default=64, help="ranks in all (default %(default)s)")
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--processes", type=int, default=0,
                        help=f"worker processes (default: one per {RANKS_PER_WORKER} ranks)")
    parser.add_argument("--prefix", default="sim",
                        help="job names are PREFIX-main, PREFIX-nan, ...")
    parser.add_argument("--seed", type=int, default=0, help="picks the faulty ranks and the noise")
    parser.add_argument("--cardinality", choices=("full", "health"), default="full")
    parser.add_argument("--step-seconds", type=float, default=1.0, help="a job's step period")
    parser.add_argument("--warmup", type=float, default=60.0, help="healthy seconds before faults")
    parser.add_argument("--host", default=None,
                        help="bind every rank to this address, node k on ports PORT + k x "
                             "ranks-per-node (default: node k on 127.77.0.1 + k, ports from PORT)")
    parser.add_argument("--advertise", default=None,
                        help="address written into the targets files (default: --host)")
    parser.add_argument("--port", type=int, default=0, help="first port (default: a free one)")
    parser.add_argument("--file-sd-dir", type=Path, default=None,
                        help="write PREFIX-*.json file_sd files here (point your Prometheus at it)")
    parser.add_argument("--interval", type=float, default=5.0,
                        help="scrape and evaluation interval in seconds (yours, without "
                             "--with-stack; deadlines follow it)")
    parser.add_argument("--rules-set", metavar="KEY=VALUE", action="append", default=None,
                        help="RulesConfig of the rules evaluated (as `mfotel rules --set`); "
                             "default: the simulation's shortened set; 'shipped' for none")
    parser.add_argument("--with-stack", action="store_true",
                        help="run Prometheus, Alertmanager and a webhook receiver on loopback "
                             "with the shipped configs and check every notification")
    parser.add_argument("--webhook", default=None, metavar="HOST:PORT",
                        help="without --with-stack: receive your Alertmanager's notifications "
                             "of the simulated jobs here (a webhook_configs url "
                             "http://HOST:PORT/alerts) and check them")
    parser.add_argument("--alertmanager-url", default=None,
                        help="also list this Alertmanager's active, uninhibited alerts")
    parser.add_argument("--node-agents", action="store_true",
                        help="also serve a node agent endpoint per node (one target per "
                             "--ranks-per-node ranks), as mfotel-instrument does")
    parser.add_argument("--shards", type=int, default=0, metavar="K",
                        help="with --with-stack: split every job's targets over K Prometheus "
                             "shards (hashmod of the address) writing to VictoriaMetrics, the "
                             "global rules on vmalert, two clustered Alertmanagers; kill one "
                             "Alertmanager at the faults and one shard once they paged")
    parser.add_argument("--no-kill", dest="kill_topology", action="store_false",
                        help="with --shards: kill neither an Alertmanager nor a shard")
    parser.add_argument("--json", type=Path, default=None, help="also write the result as JSON")
    return parser


def settings_from_args(args: argparse.Namespace) -> SimSettings:
    if args.rules_set == ["shipped"]:
        rules: dict[str, Any] = {}
    elif args.rules_set:
        rules = {**SIM_RULES, **parse_set(args.rules_set)}
    else:
        rules = dict(SIM_RULES)
    return SimSettings(
        ranks=args.ranks, ranks_per_node=args.ranks_per_node, processes=args.processes,
        prefix=args.prefix, seed=args.seed, cardinality=args.cardinality,
        timing=Timing(step_seconds=args.step_seconds, warmup_seconds=args.warmup),
        host=args.host, advertise=args.advertise, port=args.port, file_sd_dir=args.file_sd_dir,
        interval=args.interval, rules=rules, with_stack=args.with_stack,
        alertmanager_url=args.alertmanager_url, webhook=args.webhook, node_agents=args.node_agents,
        shards=args.shards, kill_topology=args.kill_topology,
        on_progress=lambda text: print(f"mfotel simulate: {text}", file=sys.stderr, flush=True))


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)   # unwinds through `finally`: workers and servers stop


def run_simulate_command(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        settings = settings_from_args(args)
        settings.rules_config()
        if settings.shards < 0 or (settings.shards and not settings.with_stack):
            raise ValueError(f"--shards {settings.shards}: give a number of Prometheus shards "
                             ">= 1 together with --with-stack (the sharded topology runs on "
                             "loopback), or leave --shards out")
        plan_jobs(settings.ranks, settings.ranks_per_node, settings.prefix)
    except ValueError as error:
        print(f"mfotel simulate: {error}", file=sys.stderr)
        return 2
    try:
        result = run_simulation(settings)
    except (RuntimeError, FileNotFoundError, TimeoutError) as error:
        print(f"mfotel simulate: {error}", file=sys.stderr)
        return 1
    print(format_report(result))
    if args.json:
        args.json.write_text(json.dumps(asdict(result), default=str, indent=1))
    checked = settings.with_stack or settings.webhook
    return 0 if not checked or result.ok else 1


def add_simulate_command(subparsers: Any) -> argparse.ArgumentParser:
    """Register `simulate` on argparse subparsers; dispatch via `args.func(args)`."""
    parser = subparsers.add_parser(
        "simulate", help="simulate a large job's ranks with scripted faults",
        description="Serve N simulated ranks (the real mfotel exposition, a synthetic training "
                    "loop) with scripted faults, and check the pages they cause.")
    add_simulate_arguments(parser)
    parser.set_defaults(func=run_simulate_command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = add_simulate_arguments(
        argparse.ArgumentParser(prog="python -m mfotel.simulation.run"))
    return run_simulate_command(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
