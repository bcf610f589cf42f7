"""OTel MeterProvider, Resource and readers: Prometheus over HTTP per rank, OTLP push optional."""
from __future__ import annotations

import errno
import logging
import os
import platform
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING, Any

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider, ObservableGauge
from opentelemetry.sdk.metrics.export import CardinalityLimits, MetricReader
from opentelemetry.sdk.resources import Resource
from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.samples import Sample

from .config import MonitorConfig
from .config.redact import redact_named
from .contract import MetricSpec
from .endpoint import serve as serve_endpoint
from .endpoint.exposition import CachedMetricsApp, CachingCollector, Router
from .endpoint.server import Limits, Server
from .endpoint.webconfig import WebConfig, endpoint_web_config
from .endpoint.wsgi import WsgiApp
from .identity import RankIdentity

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
    of the contract. Values of secret-named attributes (password, token, ...) are `***`: they
    reach neither target_info nor OTLP in clear (mfotel.config.redact).
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
    resource = Resource.create(attributes)   # also reads OTEL_RESOURCE_ATTRIBUTES
    return Resource(redact_named(resource.attributes), resource.schema_url)


class _Labelled:
    """Adds `labels` to every sample of `collector` (job_name and rank on the process_* series)."""

    def __init__(self, collector: ProcessCollector, labels: dict[str, str]) -> None:
        self.collector, self.labels = collector, labels

    def collect(self) -> list[Metric]:
        families = list(self.collector.collect())
        for family in families:
            family.samples = [s._replace(labels={**s.labels, **self.labels})
                              for s in family.samples]
        return families


#: (spec, labels, value) of the gauges whose value is NaN/Inf now (Instruments.nonfinite_values)
NonFiniteValues = Callable[[], Iterable[tuple[MetricSpec, dict[str, str], float]]]


class _AsIs:
    """The OTel reader's families with the loss and grad norm as they are: where the value is
    NaN/Inf, the sample the reader made of the last finite value (the SDK drops non-finite
    measurements) gets the value itself, which prometheus_client writes as NaN, +Inf, -Inf.
    Runs at collection (a scrape), never on the training thread."""

    def __init__(self, source: CollectorRegistry, values: NonFiniteValues) -> None:
        self.source, self.values = source, values

    def collect(self) -> list[Metric]:
        families = list(self.source.collect())
        for spec, labels, value in self.values():
            name = spec.prometheus_name
            family = next((f for f in families if f.name == name), None)
            if family is None:  # no finite value yet: the reader has no series of it
                family = GaugeMetricFamily(name, spec.description)
                families.append(family)
            family.samples = [*(s for s in family.samples if s.labels != labels),
                              Sample(name, dict(labels), value)]
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
    server: Server
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


#: Hosts that bind every interface, and loopback ones (which other machines cannot reach).
_WILDCARD = ("", "0.0.0.0", "::", "[::]")
_LOOPBACK = ("localhost", "::1", "[::1]")


def local_endpoints_line(cfg: MonitorConfig, identity: RankIdentity, job_name: str,
                         scheme: str = "http", page: bool = False,
                         served: bool = True) -> str | None:
    """The line the logging rank prints at train begin: where every rank of its node serves
    /metrics (port + local rank) and, with `page`, the live page. None on the other ranks
    (only the node's first rank of `output.log_rank` says it) and when the endpoint is off.

    A wildcard host is shown as the machine's name; a loopback host is shown as it is, with a
    note that other machines cannot reach it. `served`: whether this rank's own port was bound.
    """
    base = cfg.prometheus.port
    local, ranks = identity.local_rank, identity.local_world_size
    first = identity.rank - local
    node = range(first, first + ranks) if ranks else (identity.rank,)
    if not base or next((r for r in node if cfg.logs_on(r)), None) != identity.rank:
        return None
    host, note = cfg.prometheus.host, ""
    if host in _WILDCARD:
        host, note = identity.node or platform.node(), " (listening on every interface)"
    elif host in _LOOPBACK or host.startswith("127."):
        note = (" (loopback only: other machines cannot reach it; set "
                "monitor_config.prometheus.host to serve them)")
    host = f"[{host.strip('[]')}]" if ":" in host else host
    addresses = []
    for i in range(ranks) if ranks else (local,):
        address = f"{scheme}://{host}:{base + i}/metrics (local rank {i})"
        addresses.append(address if served or i != local else
                         address + " [not served: see the warning above]")
    pages = (f"; the live page at / of each port, e.g. {addresses[0].split('metrics')[0]}"
             if page else "")
    return (f"mfotel: job {job_name} on {identity.node or platform.node()}: /metrics at "
            f"{', '.join(addresses)}{pages}{note}")


#: How often a rank whose port was busy tries to bind it again.
BIND_RETRY_SECONDS = 2.0


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
                 on_error: Callable[[str], None] = lambda stage: None,
                 web: WebConfig | None = None) -> None:
        self.cfg, self.identity, self.job_name = cfg, identity, job_name
        self.on_error = on_error
        self.registry = CollectorRegistry(auto_describe=False)   # what /metrics serves
        self._sources = (CollectorRegistry(auto_describe=False),
                         CollectorRegistry(auto_describe=False))
        self.providers: list[MeterProvider] = []
        self.native_meter: Any = None
        self.endpoint: Endpoint | None = None
        self._stopped = threading.Event()  # set by stop_endpoint
        self._binding = threading.Lock()   # endpoint set (late bind) vs stopped
        self._otlp: OtlpPush | None = None
        self.app: CachedMetricsApp | None = None
        self.extra_routes: dict[str, WsgiApp] = {}  # documented paths beside /metrics (mfotel.ui)
        #: TLS and auth of the endpoint: `web` when the caller loaded it, else read from cfg
        self.web = web if web is not None else endpoint_web_config(cfg.prometheus, cfg.source)

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
        limits: CardinalityLimits | None = (
            {ObservableGauge: self.cfg.native_series_limit} if native else None)
        readers: list[MetricReader] = [PrometheusMetricReader(
            disable_target_info=native, scope_info_enabled=False, registry=source,
            cardinality_limits=limits)]
        if self.cfg.otlp.endpoint:  # push off the training thread, one warning (cluster.otlp)
            from .cluster.otlp import OtlpPush
            self._otlp = self._otlp or OtlpPush(self.cfg.otlp, lambda: self.on_error("otlp"))
            readers.append(self._otlp.reader(cardinality_limits=limits))
        return readers

    def start(self) -> Any:
        """Create the providers and readers; returns the contract meter. Call serve() next."""
        silence_nonfinite_warnings()
        resource = build_resource(self.job_name, self.identity, dict(self.cfg.resource_attributes))
        version = _version("mfotel") or None
        self.providers = [MeterProvider(metric_readers=self._readers(source, native),
                                        resource=resource)
                          for source, native in zip(self._sources, (False, True), strict=True)]
        self.native_meter = self.providers[1].get_meter(SCOPE + ".native", version)
        return self.providers[0].get_meter(SCOPE, version)

    def serve(self, version: Callable[[], Hashable] = object,
              native_version: Callable[[], Hashable] = object,
              nonfinite: NonFiniteValues = list) -> None:
        """Serve /metrics on host:port + local rank; a busy port warns and counts, never raises,
        and is bound as soon as it is free.

        `version` / `native_version` change whenever the values behind each provider change
        (the default, `object`, never repeats: no caching). `nonfinite` gives the gauges to
        show as they are (NaN/Inf) in place of their last finite value.
        """
        collectors = [CachingCollector(_AsIs(self._sources[0], nonfinite), version),
                      CachingCollector(self._sources[1], native_version, NATIVE_COLLECT_BUDGET)]
        if self.cfg.cardinality != "health":  # health: the fewest series per rank
            labels = {"job_name": self.job_name, "rank": str(self.identity.rank)}
            collectors.append(CachingCollector(process_metrics(labels), _each_second))
        for collector in collectors:
            self.registry.register(collector)
        self.app = CachedMetricsApp(self.registry, collectors)
        port = self.port
        if not port:
            return
        try:
            endpoint = self._bind(port)
        except OSError as exc:
            self.on_error("server")
            busy = exc.errno == errno.EADDRINUSE
            self._cannot_serve(port, exc, f"and it binds as soon as the port is free (tried every "
                               f"{BIND_RETRY_SECONDS:g} s)" if busy else "without this endpoint")
            if busy:  # often a run of the job that lingers for its final scrape
                threading.Thread(target=self._bind_when_free, args=(port,),
                                 name="mfotel-bind", daemon=True).start()
            return
        self.endpoint = endpoint

    def _cannot_serve(self, port: int, exc: OSError, then: str) -> None:
        log.warning("mfotel: rank %d cannot serve /metrics on %s:%d (%s); training continues "
                    "%s. Fix: free the port or set monitor_config.prometheus.port (this rank "
                    "uses port + local rank %d)", self.identity.rank, self.cfg.prometheus.host,
                    port, exc.strerror or exc, then, self.identity.local_rank)

    def _bind(self, port: int) -> Endpoint:
        prom = self.cfg.prometheus
        limits = Limits(max_connections=prom.max_connections,
                        request_timeout=prom.request_timeout_seconds)
        server = serve_endpoint(Router(self.routes()), prom.host, port, self.web, limits,
                                prom.auth_failures_per_second, self.on_error)
        return Endpoint(prom.host, server.port, server, server.scheme)

    def _bind_when_free(self, port: int) -> None:
        """A busy port (the lingering rank of the last run, a port probe): bind once it frees,
        until the endpoint is stopped."""
        while not self._stopped.wait(BIND_RETRY_SECONDS):
            try:
                endpoint = self._bind(port)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    continue
                self._cannot_serve(port, exc, "without this endpoint")
                return
            with self._binding:
                if self._stopped.is_set():
                    endpoint.server.close()
                    return
                self.endpoint = endpoint
            log.warning("mfotel: rank %d serves /metrics on %s:%d now (the port was freed)",
                        self.identity.rank, self.cfg.prometheus.host, port)
            return

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
        self._stopped.set()  # a bind still waiting for its port gives up
        with self._binding:
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
