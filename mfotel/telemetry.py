"""OTel MeterProvider, Resource and readers: Prometheus over HTTP per rank, OTLP push optional."""
from __future__ import annotations

import logging
import os
import platform
import time
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING, Any, Callable, Hashable, Sequence

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import ObservableGauge
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.resources import Resource
from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.metrics_core import Metric

from .config import MonitorConfig
from .exposition import CachedMetricsApp, CachingCollector, Router, WsgiApp
from .metrics_server import MetricsServer, Limits
from .identity import RankIdentity
from .webconfig import WebConfig, certificate_files, load_web_config

if TYPE_CHECKING:
    from .cluster.otlp import OtlpPush

log = logging.getLogger("mfotel")
SCOPE = "mfotel"
#: Share of wall time that re-collecting native series (thousands of them) may take from
#: training; scrapes in between are served the previous values.
NATIVE_COLLECT_BUDGET = 0.02


class _DropNonFinite(logging.Filter):
    """The SDK warns on every NaN measurement; mfotel reports NaN through its own series."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "not finite" not in str(record.msg) and "non-finite" not in str(record.msg)


def silence_nonfinite_warnings() -> None:
    target = logging.getLogger("opentelemetry.sdk.metrics._internal.instrument")
    if not any(isinstance(f, _DropNonFinite) for f in target.filters):
        target.addFilter(_DropNonFinite())


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return ""


def build_resource(job_name: str, identity: RankIdentity,
                   extra: dict[str, str] | None = None) -> Resource:
    """Resource attributes, exposed by the Prometheus reader as `target_info`.

    `job_name` and `rank` are there under the label names every series carries (extra
    attributes cannot replace them), so `target_info` joins `on(job_name, rank)` like the rest
    of the contract.
    """
    attributes: dict[str, Any] = {
        "service.name": job_name,
        "service.instance.id": f"{identity.node}:{identity.rank}",
        "host.name": identity.node,
        "process.pid": os.getpid(),
        "mfotel.rank": identity.rank,
        "mfotel.local_rank": identity.local_rank,
        "mfotel.world_size": identity.world_size,
        "mfotel.version": _version("mfotel"),
        "mindspore.version": _version("mindspore"),
        "mindformers.version": _version("mindformers"),
        "python.version": platform.python_version(),
    }
    attributes = {k: v for k, v in attributes.items() if v != ""}
    attributes.update(extra or {})
    attributes.update(job_name=job_name, rank=str(identity.rank))
    return Resource.create(attributes)


class _Labelled:
    """Adds `labels` to every sample of `collector` (job_name and rank on the process_* series)."""

    def __init__(self, collector: ProcessCollector, labels: dict[str, str]) -> None:
        self.collector, self.labels = collector, labels

    def collect(self) -> list[Metric]:
        families = self.collector.collect()
        for family in families:
            family.samples = [s._replace(labels={**s.labels, **self.labels})
                              for s in family.samples]
        return families


def process_metrics(labels: dict[str, str]) -> CollectorRegistry:
    """prometheus_client's standard process collector (process_resident_memory_bytes,
    process_cpu_seconds_total, process_open_fds, process_start_time_seconds, ...) of this
    process, labelled with `labels`."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Labelled(ProcessCollector(registry=None), labels))
    return registry


def _each_second() -> int:
    """A version that moves once a second: /proc is read at most once a second however many
    scrapers ask."""
    return int(time.monotonic())


@dataclass
class Endpoint:
    host: str
    port: int
    server: MetricsServer
    scheme: str = "http"

    @property
    def url(self) -> str:
        host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        host = f"[{host}]" if ":" in host else host
        return f"{self.scheme}://{host}:{self.port}/metrics"

    @property
    def page_url(self) -> str:
        """The live page (mfotel.ui), when it is on."""
        return self.url[:-len("metrics")]


class Telemetry:
    """Owns the MeterProviders, the Prometheus registries and HTTP endpoint, and OTLP push.

    Two providers: the contract's few dozen series, and mindformers-native metrics (possibly
    thousands of per-parameter series), each behind its own exposition cache so a scrape
    between two records re-renders only what changed.

        tel = Telemetry(cfg, identity, "llama7b", on_error=count)
        meter = tel.start()
        tel.serve(version=lambda: inst.version, native_version=lambda: inst.native_version)
        ...
        tel.shutdown()
    """

    def __init__(self, cfg: MonitorConfig, identity: RankIdentity, job_name: str,
                 on_error: Callable[[str], None] = lambda stage: None) -> None:
        self.cfg, self.identity, self.job_name = cfg, identity, job_name
        self.on_error = on_error
        self.registry = CollectorRegistry(auto_describe=False)   # what /metrics serves
        self._sources = (CollectorRegistry(auto_describe=False), CollectorRegistry(auto_describe=False))
        self.providers: list[MeterProvider] = []
        self.native_meter: Any = None
        self.endpoint: Endpoint | None = None
        self._otlp: OtlpPush | None = None
        self.app: CachedMetricsApp | None = None
        self.extra_routes: dict[str, WsgiApp] = {}  # documented paths beside /metrics (mfotel.ui)
        self.web = self._web_config()

    def _web_config(self) -> WebConfig | None:
        prom = self.cfg.prometheus
        if prom.web_config_file:
            return load_web_config(prom.web_config_file)
        if prom.certfile:
            return certificate_files(prom.certfile, prom.keyfile or "", self.cfg.source)
        return None

    @property
    def cert_file(self) -> str | None:
        """The endpoint's TLS certificate (None: plain HTTP)."""
        return self.web.tls.cert_file if self.web is not None and self.web.tls else None

    @property
    def port(self) -> int:
        """This rank's port: base port + local rank (0 = endpoint off)."""
        base = self.cfg.prometheus.port
        return base + self.identity.local_rank if base else 0

    def _readers(self, source: CollectorRegistry, native: bool) -> Sequence[MetricReader]:
        # native per-parameter metrics may exceed OTel's 2000-series cap: raised on purpose
        limits = {ObservableGauge: self.cfg.native_series_limit} if native else None
        readers: list[MetricReader] = [PrometheusMetricReader(
            disable_target_info=native, scope_info_enabled=False, registry=source,
            cardinality_limits=limits)]
        if self.cfg.otlp.endpoint:  # push, off the training thread; one warning (mfotel.cluster.otlp)
            from .cluster.otlp import OtlpPush
            self._otlp = self._otlp or OtlpPush(self.cfg.otlp, lambda: self.on_error("otlp"))
            readers.append(self._otlp.reader(cardinality_limits=limits))
        return readers

    def start(self) -> Any:
        """Create the providers and readers; returns the contract meter. Call serve() next."""
        silence_nonfinite_warnings()
        resource = build_resource(self.job_name, self.identity, dict(self.cfg.resource_attributes))
        version = _version("mfotel") or None
        self.providers = [MeterProvider(metric_readers=self._readers(source, native), resource=resource)
                          for source, native in zip(self._sources, (False, True))]
        self.native_meter = self.providers[1].get_meter(SCOPE + ".native", version)
        return self.providers[0].get_meter(SCOPE, version)

    def serve(self, version: Callable[[], Hashable] = object,
              native_version: Callable[[], Hashable] = object) -> None:
        """Serve /metrics on host:port + local rank; a busy port warns and counts, never raises.

        `version` / `native_version` change whenever the values behind each provider change
        (the default, `object`, never repeats: no caching).
        """
        collectors = [CachingCollector(self._sources[0], version),
                      CachingCollector(self._sources[1], native_version, NATIVE_COLLECT_BUDGET)]
        if self.cfg.cardinality != "health":  # health: the fewest series per rank
            labels = {"job_name": self.job_name, "rank": str(self.identity.rank)}
            collectors.append(CachingCollector(process_metrics(labels), _each_second))
        for collector in collectors:
            self.registry.register(collector)
        self.app = CachedMetricsApp(self.registry, collectors)
        port, prom = self.port, self.cfg.prometheus
        if not port:
            return
        app: WsgiApp = Router(self.routes())
        tls = self.web.tls if self.web is not None else None
        if self.web is not None:
            app = self.web.wrap(app, prom.auth_failures_per_second)
        limits = Limits(max_connections=prom.max_connections,
                        request_timeout=prom.request_timeout_seconds)
        try:
            server = MetricsServer(app, prom.host, port, tls.context() if tls else None, limits,
                                tls.accepts_peer if tls and tls.client_allowed_sans else None,
                                self.on_error).start()
        except OSError as exc:
            self.on_error("server")
            log.warning("mfotel: rank %d cannot serve /metrics on %s:%d (%s); training continues "
                        "without this endpoint. Fix: free the port or set "
                        "monitor_config.prometheus.port (this rank uses port + local rank %d)",
                        self.identity.rank, prom.host, port, exc.strerror or exc,
                        self.identity.local_rank)
            return
        self.endpoint = Endpoint(prom.host, server.port, server, server.scheme)

    def routes(self) -> dict[str, WsgiApp]:
        """The documented paths of the endpoint; every other path answers 404."""
        assert self.app is not None
        return {"/metrics": self.app, **self.extra_routes}

    def wait_scraped(self, timeout: float) -> bool:
        """Block until a scrape has served the current values, or `timeout` seconds pass."""
        if self.endpoint is None or self.app is None:
            return False
        deadline, main = time.monotonic() + timeout, self.app.collectors[0]
        while time.monotonic() < deadline:
            if main.is_current() and self.app.served[:1] == (main.generation,):
                return True
            time.sleep(0.05)
        return False

    def stop_endpoint(self) -> None:
        if self.endpoint is not None:
            self.endpoint.server.close()
            self.endpoint = None

    def shutdown(self) -> None:
        """Flush OTLP, stop the endpoint; safe to call twice."""
        self.stop_endpoint()
        for provider in self.providers:
            try:
                provider.shutdown(timeout_millis=self.cfg.otlp.timeout_seconds * 1000)
            except Exception:  # noqa: BLE001 - shutdown must not raise into training
                self.on_error("otlp")
        self.providers = []
