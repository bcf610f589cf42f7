"""VictoriaMetrics (Debian's `victoria-metrics`) and `vmalert` on loopback, free ports.

    with VictoriaMetrics(workdir) as store, VMAlert(rules, store.url, [am_url], 5.0) as ruler:
        store.query("ALERTS")
"""
from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

from .servers import _Server, http_get_json, instant_query, required_binary


class VictoriaMetrics(_Server):
    """Single-node VictoriaMetrics with its own data directory: samples are queryable as soon
    as they are indexed (no 30 s latency offset, no cache of partial results)."""

    name = "victoria-metrics"

    def __init__(self, workdir: str | Path | None = None, port: int | None = None,
                 staleness_seconds: float | None = None, cache: bool = False) -> None:
        """`staleness_seconds`: how long a series without new samples (and no staleness
        marker: its Prometheus was killed) still answers instant queries (default: VM's own,
        from the median interval of its samples). `cache`: keep VM's rollup result cache
        (a ruler's repeated queries; off, every query is computed again)."""
        self.binary = required_binary(("victoria-metrics",), "victoria-metrics")
        super().__init__(workdir, port)
        self.staleness, self.cache = staleness_seconds, cache

    @property
    def write_url(self) -> str:
        """Where Prometheus' remote_write sends."""
        return f"{self.url}/api/v1/write"

    def command(self) -> list[str]:
        extra = [f"-search.maxStalenessInterval={self.staleness:g}s"] if self.staleness else []
        if not self.cache:
            extra.append("-search.disableCache")
        # a ruler's groups query at once: queue them (VM's default, 2 x cores at once and 10 s
        # in the queue, answered a busy 2-core machine's ruler with 503s)
        return [self.binary, f"-storageDataPath={self.workdir / 'data'}",
                f"-httpListenAddr=127.0.0.1:{self.port}", "-search.latencyOffset=0s",
                "-search.maxConcurrentRequests=16", "-search.maxQueueDuration=60s",
                "-loggerLevel=WARN", *extra]

    def query(self, expr: str, time_: float | None = None) -> list[dict]:
        """Instant query (now, or at unix time `time_`); the `result` list (RuntimeError on an
        API error)."""
        return instant_query(self.url, expr, time_)


class VMAlert(_Server):
    """`vmalert` evaluating `rule_file` against `datasource` (a VictoriaMetrics URL), writing
    its recorded series and alert state back there (and restoring it from there at start),
    notifying every URL of `alertmanagers`."""

    name = "vmalert"

    def __init__(self, rule_file: str | Path, datasource: str, alertmanagers: Sequence[str],
                 interval_seconds: float, workdir: str | Path | None = None,
                 port: int | None = None, flush_seconds: float = 1.0) -> None:
        self.binary = required_binary(("vmalert",), "victoria-metrics")
        super().__init__(workdir, port)
        self.rule_path = self.workdir / Path(rule_file).name
        shutil.copy(rule_file, self.rule_path)
        self.datasource, self.alertmanagers = datasource, list(alertmanagers)
        self.interval, self.flush = interval_seconds, flush_seconds

    def command(self) -> list[str]:
        every = f"{self.interval:g}s"
        return [self.binary, f"-rule={self.rule_path}", f"-datasource.url={self.datasource}",
                f"-remoteWrite.url={self.datasource}", f"-remoteRead.url={self.datasource}",
                f"-remoteWrite.flushInterval={self.flush:g}s",
                *(f"-notifier.url={url}" for url in self.alertmanagers),
                f"-evaluationInterval={every}",
                # a value is found up to two evaluations back (default 5m: a vanished rank
                # would stay present for 5 minutes), at the evaluation's own time
                f"-datasource.queryStep={2 * self.interval:g}s",
                "-datasource.queryTimeAlignment=false",
                f"-httpListenAddr=127.0.0.1:{self.port}", "-loggerLevel=WARN"]

    def groups(self) -> list[dict]:
        return http_get_json(f"{self.url}/api/v1/rules")["data"]["groups"]
