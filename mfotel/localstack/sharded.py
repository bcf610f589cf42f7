"""One job larger than one Prometheus, on loopback: K Prometheus shards, a store, a global
ruler, two clustered Alertmanagers (docs/scaling.md, section 7).

    with ShardedStack(workdir, workdir / "targets/*.json", shards=2, interval=5.0,
                      rules=RulesConfig()) as stack:
        stack.kill_scraper(1)
        stack.store.query("ALERTS")

- each shard is the shipped prometheus.yml's file_sd job keeping the targets whose address
  hashes to it (`hashmod` over `__address__`, as the Prometheus Operator's `shards:` does),
  with the scraper part of the rules (mfotel.alerting.sharded), `external_labels`
  `shard: "<i>"`, `remote_write` to the store, and alerts to both Alertmanagers; it also
  scrapes itself (its rule alerts) and the store and the ruler (`mfotel_component`), whose
  outage it pages;
- VictoriaMetrics holds every shard's samples and the ruler's records;
- `vmalert` evaluates the global part over the store, writes its records back, restores its
  alerts' state from it, and notifies both Alertmanagers;
- two Alertmanagers with the shipped routes and inhibitions gossip on loopback
  (`--cluster.listen-address`, `--cluster.peer`): one notification per group between them.
"""
from __future__ import annotations

import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from ..alerting.receiver import AlertsReceiver
from ..alerting.rules import RulesConfig, duration_seconds
from ..alerting.sharded import (
    COMPONENT_LABEL,
    GLOBAL_FILE,
    RULER_FLUSH_SECONDS,
    SCRAPER_FILE,
    SHARD_LABEL,
    global_depths,
    record_lag_seconds,
)
from ..assets import alertmanager_files, sharded_rule_files, write_files
from .alerting import (
    SELF_JOB,
    operator_alertmanager_config,
    self_scrape_job,
    shipped_files,
)
from .servers import Alertmanager, Prometheus, _Server, free_port
from .victoria import VictoriaMetrics, VMAlert

FILE_SD_JOB = "mindformers-file-sd"
#: How long a clustered Alertmanager waits per position before it notifies what its peer
#: before it did not (Alertmanager's default: 15s).
PEER_TIMEOUT = "5s"
#: A shard's remote_write batch deadline and the ruler's flush of its records, in seconds.
REMOTE_WRITE_SECONDS = 1.0
FLUSH_SECONDS = RULER_FLUSH_SECONDS


def shard_config(shipped: str, shard: int, shards: int, file_sd: str | Path,
                 interval: float, store: str, alertmanagers: list[str],
                 components: Mapping[str, str], external: Mapping[str, str] | None = None,
                 itself: str = "prometheus-0:9090") -> str:
    """The shipped prometheus.yml as shard `shard` of `shards`: its file_sd job on `file_sd`
    keeping its share of the targets, its `prometheus` job on its own address `itself`
    (host:port, one per shard: its rule alerts name it), the scraper rules, remote_write to
    `store` (a VictoriaMetrics URL), alerts to every `alertmanagers` address (host:port), and a
    scrape job per global component (`components`: name -> host:port)."""
    if not 0 <= shard < shards:
        raise ValueError(f"shard {shard} of {shards}: a shard's number is 0 .. shards - 1")
    config = yaml.safe_load(shipped)
    every = f"{interval:g}s"
    config["global"].update(scrape_interval=every, evaluation_interval=every,
                            scrape_timeout=f"{min(interval, 10):g}s",
                            external_labels={**(external or {}), SHARD_LABEL: str(shard)})
    config["rule_files"] = [SCRAPER_FILE]
    config["alerting"]["alertmanagers"] = [{"static_configs": [{"targets": alertmanagers}]}]
    # every shard pages the global layer's outage: one alert, not one per shard
    config["alerting"]["alert_relabel_configs"] = [{"action": "labeldrop",
                                                    "regex": SHARD_LABEL}]
    job = next(j for j in config["scrape_configs"] if j["job_name"] == FILE_SD_JOB)
    job["file_sd_configs"] = [{"files": [str(file_sd)], "refresh_interval": "30s"}]
    job["relabel_configs"] = [
        {"source_labels": ["__address__"], "modulus": shards, "target_label": "__tmp_shard",
         "action": "hashmod"},
        {"source_labels": ["__tmp_shard"], "regex": str(shard), "action": "keep"}]
    config["scrape_configs"] = [job, self_scrape_job(config, itself)] + [
        {"job_name": f"mfotel-{name}",
         "static_configs": [{"targets": [address], "labels": {COMPONENT_LABEL: name}}]}
        for name, address in components.items()]
    # the shard's own metrics stay with it (its rule alerts read them there)
    config["remote_write"] = [{"url": f"{store}/api/v1/write",
                               "queue_config": {"batch_send_deadline": f"{REMOTE_WRITE_SECONDS:g}s",
                                                "max_samples_per_send": 2000},
                               "write_relabel_configs": [{"source_labels": ["job"],
                                                          "regex": SELF_JOB, "action": "drop"}]}]
    return yaml.safe_dump(config, sort_keys=False)


class ClusteredAlertmanager(Alertmanager):
    """Alertmanager gossiping with its peers on loopback."""

    name = "alertmanager"

    def __init__(self, config_text: str, cluster_port: int, peers: list[int],
                 workdir: Path) -> None:
        super().__init__(config_text, workdir=workdir)
        self.cluster_port, self.peers = cluster_port, peers

    def command(self) -> list[str]:
        command = [c for c in super().command() if not c.startswith("--cluster.")]
        return [*command, f"--cluster.listen-address=127.0.0.1:{self.cluster_port}",
                f"--cluster.advertise-address=127.0.0.1:{self.cluster_port}",
                f"--cluster.peer-timeout={PEER_TIMEOUT}",
                *(f"--cluster.peer=127.0.0.1:{port}" for port in self.peers)]


class ShardedStack:
    """Receiver, two clustered Alertmanagers, VictoriaMetrics, vmalert and `shards`
    Prometheus shards on 127.0.0.1, each with its own port and data directory."""

    def __init__(self, workdir: Path | None, file_sd: str | Path, shards: int, interval: float,
                 rules: RulesConfig, receiver: AlertsReceiver | None = None) -> None:
        if shards < 1:
            raise ValueError(f"--shards {shards}: give 1 or more Prometheus shards")
        self._own_dir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="mfotel-sharded-"))
        self.file_sd, self.shards, self.interval, self.rules = file_sd, shards, interval, rules
        self.files = shipped_files()
        self.am_config = yaml.safe_load(self.files["alertmanager"])
        self.receiver = receiver or AlertsReceiver(port=0, out=None, err=None)
        self.alertmanagers: list[ClusteredAlertmanager] = []
        self.store: VictoriaMetrics | None = None
        self.ruler: VMAlert | None = None
        self.scrapers: list[Prometheus] = []

    # what run_simulation reads of a stack
    @property
    def prometheus(self) -> Prometheus | None:
        return self.scrapers[0] if self.scrapers else None

    @property
    def alertmanager(self) -> ClusteredAlertmanager | None:
        alive = [a for a in self.alertmanagers if a.process is not None]
        return alive[0] if alive else None

    def start(self) -> ShardedStack:
        try:
            # Prometheus watches the targets' folder only if it exists at its start (else it
            # reads the files at its next refresh, 30 s later)
            Path(self.file_sd).parent.mkdir(parents=True, exist_ok=True)
            self.receiver.start()
            self._start_alertmanagers()
            rules = write_files(sharded_rule_files(self.rules, f"{self.interval:g}s"),
                                self.workdir / "rules")
            by_name = {p.name: p for p in rules}
            # a shard's series stay for 2.5 intervals after its last sample (no staleness
            # marker comes from a killed Prometheus)
            self.store = VictoriaMetrics(self.workdir / "store", cache=True,
                                         staleness_seconds=2.5 * self.interval).start()
            am_urls = [a.url for a in self.alertmanagers]
            self.ruler = VMAlert(by_name[GLOBAL_FILE], self.store.url, am_urls, self.interval,
                                 workdir=self.workdir / "ruler",
                                 flush_seconds=FLUSH_SECONDS).start()
            components = {"store": f"127.0.0.1:{self.store.port}",
                          "global-ruler": f"127.0.0.1:{self.ruler.port}"}
            for shard in range(self.shards):
                port = free_port()
                text = shard_config(self.files["prometheus"], shard, self.shards, self.file_sd,
                                    self.interval, self.store.url,
                                    [f"127.0.0.1:{a.port}" for a in self.alertmanagers],
                                    components, itself=f"127.0.0.1:{port}")
                self.scrapers.append(Prometheus(
                    text, rule_files=[by_name[SCRAPER_FILE]],
                    workdir=self.workdir / f"shard-{shard}", port=port).start())
        except BaseException:
            self.stop()
            raise
        return self

    def _start_alertmanagers(self) -> None:
        config = operator_alertmanager_config(self.files["alertmanager"], self.receiver.url)
        ports = [free_port(), free_port()]
        for index, port in enumerate(ports):
            am_dir = self.workdir / f"alertmanager-{index}"
            write_files(alertmanager_files(), am_dir)   # the templates beside the config
            self.alertmanagers.append(ClusteredAlertmanager(
                config, port, [p for p in ports if p != port], am_dir).start())

    def kill_scraper(self, shard: int) -> None:
        """SIGKILL shard `shard`'s Prometheus: no staleness markers, no last samples."""
        _kill(self.scrapers[shard])

    def kill_alertmanager(self, index: int) -> None:
        _kill(self.alertmanagers[index])

    def kill_ruler(self) -> None:
        assert self.ruler is not None
        _kill(self.ruler)

    def kill_store(self) -> None:
        assert self.store is not None
        _kill(self.store)

    def scraped_targets(self, shard: int) -> list[dict[str, Any]]:
        """The rank targets shard `shard` scrapes (its file_sd job's active targets)."""
        return [t for t in self.scrapers[shard].targets()
                if t["labels"].get("job") == FILE_SD_JOB]

    def stop(self) -> None:
        for server in [*self.scrapers, self.ruler, self.store, *self.alertmanagers]:
            if server is not None:
                server.stop()
        self.receiver.stop()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> ShardedStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _kill(server: _Server) -> None:
    if server.process is not None and server.process.poll() is None:
        server.process.kill()
        server.process.wait(timeout=10)
    server.process = None


def detection_seconds(interval: float, rules: RulesConfig) -> float:
    """Seconds from a shard's death to MindFormersScraperDown firing: the store's staleness,
    a ruler evaluation reading it, and the alert's `for:`."""
    return 2.5 * interval + 2 * interval + duration_seconds(rules.rank_down_for)


def global_page_lag(alertname: str, rules: RulesConfig, interval: float) -> float:
    """Seconds a page of the global part may come later than the same page from one
    Prometheus: a shard's remote_write deadline, then each of the ruler's own records read
    one after another (global_depths), each a new series read `record_lag_seconds` later,
    and an Alertmanager taking over from a dead peer (its peer timeout)."""
    depth = global_depths(rules).get(alertname, 0)
    return REMOTE_WRITE_SECONDS + depth * record_lag_seconds(interval) + duration_seconds(
        PEER_TIMEOUT)
