"""The monitoring side of a simulation: the shipped Prometheus and Alertmanager configs on
loopback, and what Prometheus says about itself (memory, series, rule evaluation time).

Only what a loopback run needs is changed: Prometheus keeps the shipped `file_sd` scrape job
(pointed at the simulation's target file) and rule files (generated with the run's
`RulesConfig`), at the run's scrape/evaluation interval; Alertmanager keeps its routes,
`group_wait`s and inhibitions, only the webhook URLs point at a local receiver.
"""
from __future__ import annotations

import re
import statistics
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from ..alerting.receiver import AlertsReceiver
from ..alerting.rules import RulesConfig, duration_seconds, write_rules
from ..alerting.webhook import ReceivedAlert
from ..localstack.alerting import AlertingStack, self_scrape_job
from ..localstack.servers import Prometheus, free_port, http_get_json

FILE_SD_JOB = "mindformers-file-sd"
_MATCHER = re.compile(r'^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"?(.*?)"?\s*$')


# ---------------------------------------------------------------- configs
def prometheus_config(text: str, file_sd: str | Path, alertmanager: str | None,
                      interval: float | None, rule_files: Sequence[str],
                      itself: str | None = None) -> str:
    """The shipped prometheus.yml: its file_sd job on `file_sd`, at `interval` seconds (None:
    the shipped intervals), alerts to `alertmanager` (None: nowhere), and with `itself`
    (host:port) its `prometheus` job scraping itself there."""
    config = yaml.safe_load(text)
    if interval is not None:
        every = f"{interval:g}s"
        config["global"].update(scrape_interval=every, evaluation_interval=every,
                                scrape_timeout=f"{min(interval, 10):g}s")
    config["rule_files"] = list(rule_files)
    if alertmanager is None:
        del config["alerting"]
    else:
        config["alerting"]["alertmanagers"] = [{"static_configs": [{"targets": [alertmanager]}]}]
    job = next(j for j in config["scrape_configs"] if j["job_name"] == FILE_SD_JOB)
    job["file_sd_configs"] = [{"files": [str(file_sd)], "refresh_interval": "30s"}]
    own = [] if itself is None else [self_scrape_job(config, itself)]
    config["scrape_configs"] = [job, *own]
    return yaml.safe_dump(config, sort_keys=False)


def _route_matches(route: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    for text in route.get("matchers", []):
        match = _MATCHER.match(text)
        if match is None:
            raise ValueError(f"cannot read Alertmanager matcher {text!r}")
        name, op, value = match.groups()
        actual = labels.get(name, "")
        hit = re.fullmatch(value, actual) is not None if "~" in op else actual == value
        if hit == op.startswith("!"):
            return False
    return (all(labels.get(k, "") == v for k, v in route.get("match", {}).items())
            and all(re.fullmatch(v, labels.get(k, ""))
                    for k, v in route.get("match_re", {}).items()))


def route_setting(config: Mapping[str, Any], labels: Mapping[str, str], key: str,
                  default: str) -> float:
    """Seconds of a route setting (`group_wait`, `group_interval`) for an alert's labels: the
    first matching child route at each level wins, children inherit from their parent."""
    route, value = config["route"], config["route"].get(key, default)
    while True:
        child = next((r for r in route.get("routes", []) if _route_matches(r, labels)), None)
        if child is None:
            return duration_seconds(value)
        route, value = child, child.get(key, value)


# ---------------------------------------------------------------- the webhook
@dataclass
class Notification:
    """One webhook call: when it arrived, its size, its alerts."""

    received_at: float
    bytes: int
    alerts: list[ReceivedAlert]


class CountingReceiver(AlertsReceiver):
    """The alerts receiver, also keeping every notification's arrival and size (what a
    pager's webhook receives, after Alertmanager's `group_wait`). It only records: no
    control directory, no authentication (synthetic data; it binds where it is told,
    loopback by default)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__(host=host, port=port, out=None, err=None)
        self.notifications_seen: list[Notification] = []

    def handle_body(self, body: bytes) -> list[ReceivedAlert]:
        alerts = super().handle_body(body)
        self.notifications_seen.append(Notification(time.time(), len(body), alerts))
        return alerts


# ---------------------------------------------------------------- the stack
class SimStack(AlertingStack):
    """Receiver + Alertmanager + Prometheus on 127.0.0.1 with the shipped configs, the ranks
    found through `file_sd` (a glob of target files).

        with SimStack(workdir, workdir / "targets/*.json", 5.0, RulesConfig()) as stack:
            stack.prometheus.query("up")

    `shipped_cost` adds a second Prometheus with the shipped intervals and rules, alerting
    nowhere: its memory and rule evaluation time are what a user's Prometheus would spend
    (the first one runs the simulation's shorter windows).
    """

    def __init__(self, workdir: Path, file_sd: Path, interval: float, rules: RulesConfig,
                 shipped_cost: bool = False) -> None:
        super().__init__(targets=[], interval_seconds=interval, out=None, workdir=workdir)
        self.receiver: CountingReceiver = CountingReceiver()
        self.file_sd, self.interval_seconds, self.rules = file_sd, interval, rules
        self.am_config = yaml.safe_load(self.files["alertmanager"])
        self.shipped_cost = shipped_cost
        self.shipped: Prometheus | None = None

    def group_wait(self, labels: Mapping[str, str]) -> float:
        return route_setting(self.am_config, labels, "group_wait", "30s")

    def start(self) -> SimStack:
        # Prometheus watches the target files' folder only if it exists when it starts;
        # otherwise new targets wait for file_sd's 30 s refresh
        Path(self.file_sd).parent.mkdir(parents=True, exist_ok=True)
        try:
            alertmanager = self.start_alertmanager()
            rule_files = write_rules(self.workdir / "prometheus", self.rules)
            port = free_port()
            self.prometheus = Prometheus(
                prometheus_config(self.files["prometheus"], self.file_sd,
                                  f"127.0.0.1:{alertmanager.port}", self.interval_seconds,
                                  [p.name for p in rule_files], itself=f"127.0.0.1:{port}"),
                workdir=self.workdir / "prometheus", port=port).start()
            if self.shipped_cost:
                shipped_rules = write_rules(self.workdir / "prometheus-shipped", RulesConfig())
                self.shipped = Prometheus(
                    prometheus_config(self.files["prometheus"], self.file_sd, None,
                                      None, [p.name for p in shipped_rules]),
                    workdir=self.workdir / "prometheus-shipped").start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.shipped is not None:
            self.shipped.stop()
        super().stop()


# ---------------------------------------------------------------- Prometheus about itself
@dataclass
class PrometheusProbe:
    """Samples what a Prometheus says about itself during a run: its memory and head series
    (/metrics), its resident memory peak (/proc), and each rule's evaluation time (rules API).
    """

    prometheus: Prometheus
    samples: list[dict[str, float]] = field(default_factory=list)
    missed: int = 0                 # samples a busy Prometheus did not answer in time

    def try_sample(self) -> dict[str, float] | None:
        """`sample()`, or None (counted in `missed`) when Prometheus does not answer: a busy
        machine delays its self-measurement, it must not end the run being measured."""
        try:
            return self.sample()
        except (OSError, ValueError, KeyError):
            self.missed += 1
            return None

    def sample(self) -> dict[str, float]:
        with urllib.request.urlopen(f"{self.prometheus.url}/metrics", timeout=10) as response:
            text = response.read().decode()
        found: dict[str, float] = {"time": time.time()}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name in ("process_resident_memory_bytes", "prometheus_tsdb_head_series",
                              "go_memstats_heap_inuse_bytes", "process_cpu_seconds_total"):
                    found[s.name] = s.value
                elif s.name == "prometheus_rule_group_iterations_missed_total":
                    found["missed_iterations"] = found.get("missed_iterations", 0) + s.value
        groups = http_get_json(f"{self.prometheus.url}/api/v1/rules", timeout=10)["data"]["groups"]
        for group in groups:
            found[f"group:{group['name']}"] = group["evaluationTime"]
            for index, rule in enumerate(group["rules"]):
                found[f"rule:{group['name']}:{index}:{rule['name']}"] = rule["evaluationTime"]
        process = self.prometheus.process
        if process is not None:
            found["peak_rss_bytes"] = _peak_rss(process.pid)
        self.samples.append(found)
        return found

    def summary(self, last: int = 6) -> dict[str, float]:
        """The latest values; evaluation times as the median and max of the last samples."""
        if not self.samples:
            return {}
        latest, recent = dict(self.samples[-1]), self.samples[-last:]
        for key in [k for k in latest if k.startswith(("group:", "rule:"))]:
            values = [s[key] for s in recent if key in s]
            latest[key] = statistics.median(values)
            latest["max_" + key] = max(values)
        latest["peak_rss_bytes"] = max(s.get("peak_rss_bytes", 0) for s in self.samples)
        latest["missed_samples"] = self.missed
        first = self.samples[0]
        if len(self.samples) > 1 and "process_cpu_seconds_total" in first:
            # CPU share over the run: unlike evaluation wall times, not inflated by a busy machine
            latest["cpu_share"] = ((latest["process_cpu_seconds_total"]
                                    - first["process_cpu_seconds_total"])
                                   / (latest["time"] - first["time"]))
        return latest


def _peak_rss(pid: int) -> float:
    """VmHWM of a Linux process (bytes), 0 where /proc cannot tell."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return 0.0
