"""OTel MeterProvider, Resource and readers: Prometheus over HTTP per rank, OTLP push optional."""
from __future__ import annotations

import logging
import os
import platform
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Callable, Sequence

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, MetricReader
from opentelemetry.sdk.resources import Resource
from prometheus_client import CollectorRegistry, start_http_server

from .config import MonitorConfig
from .identity import RankIdentity

log = logging.getLogger("mfotel")
SCOPE = "mfotel"


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
    """Resource attributes, exposed by the Prometheus reader as `target_info`."""
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
    return Resource.create(attributes)


class CountingExporter(MetricExporter):
    """Wraps an exporter: a failed export is counted and warned about once, never raised."""

    def __init__(self, inner: MetricExporter, on_error: Callable[[], None]) -> None:
        super().__init__(preferred_temporality=inner._preferred_temporality,
                         preferred_aggregation=inner._preferred_aggregation)
        self.inner, self.on_error, self._warned = inner, on_error, False

    def export(self, metrics_data: Any, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
        try:
            result = self.inner.export(metrics_data, timeout_millis=timeout_millis, **kwargs)
        except Exception as exc:  # noqa: BLE001 - an exporter must never break training
            result = MetricExportResult.FAILURE
            if not self._warned:
                log.warning("mfotel: OTLP export failed (%s); counting further failures in "
                            "mfotel_export_errors_total{stage=\"otlp\"}", exc)
                self._warned = True
        if result is not MetricExportResult.SUCCESS:
            self.on_error()
        return result

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return self.inner.force_flush(timeout_millis)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self.inner.shutdown(timeout_millis=timeout_millis, **kwargs)


@dataclass
class Endpoint:
    host: str
    port: int
    server: Any
    thread: Any

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}/metrics"


class Telemetry:
    """Owns the MeterProvider, the Prometheus registry and HTTP endpoint, and OTLP push.

        tel = Telemetry(cfg, identity, "llama7b", on_error=count)
        meter = tel.start()
        tel.serve()
        ...
        tel.shutdown()
    """

    def __init__(self, cfg: MonitorConfig, identity: RankIdentity, job_name: str,
                 on_error: Callable[[str], None] = lambda stage: None) -> None:
        self.cfg, self.identity, self.job_name = cfg, identity, job_name
        self.on_error = on_error
        self.registry = CollectorRegistry(auto_describe=False)
        self.provider: MeterProvider | None = None
        self.endpoint: Endpoint | None = None

    @property
    def port(self) -> int:
        """This rank's port: base port + local rank (0 = endpoint off)."""
        base = self.cfg.prometheus.port
        return base + self.identity.local_rank if base else 0

    def _readers(self) -> Sequence[MetricReader]:
        readers: list[MetricReader] = [
            PrometheusMetricReader(scope_info_enabled=False, registry=self.registry)]
        otlp = self.cfg.otlp
        if otlp.endpoint:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
            from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
            inner = OTLPMetricExporter(endpoint=otlp.endpoint, headers=dict(otlp.headers),
                                       timeout=otlp.timeout_seconds)
            readers.append(PeriodicExportingMetricReader(
                CountingExporter(inner, lambda: self.on_error("otlp")),
                export_interval_millis=otlp.interval_seconds * 1000,
                export_timeout_millis=otlp.timeout_seconds * 1000))
        return readers

    def start(self) -> Any:
        """Create the provider and readers; returns the meter. Call serve() next."""
        silence_nonfinite_warnings()
        resource = build_resource(self.job_name, self.identity, dict(self.cfg.resource_attributes))
        self.provider = MeterProvider(metric_readers=self._readers(), resource=resource)
        return self.provider.get_meter(SCOPE, _version("mfotel") or None)

    def serve(self) -> None:
        """Serve /metrics on host:port + local rank; a busy port warns and counts, never raises."""
        port, prom = self.port, self.cfg.prometheus
        if not port:
            return
        try:
            server, thread = start_http_server(port, addr=prom.host, registry=self.registry,
                                               certfile=prom.certfile, keyfile=prom.keyfile)
        except OSError as exc:
            self.on_error("server")
            message = (f"mfotel: rank {self.identity.rank} cannot serve /metrics on "
                       f"{prom.host}:{port} ({exc.strerror or exc}); training continues without "
                       f"this endpoint. Fix: free the port or set monitor_config.prometheus.port "
                       f"(this rank uses port + local rank {self.identity.local_rank})")
            log.warning(message)
            return
        self.endpoint = Endpoint(prom.host, server.server_port, server, thread)

    def stop_endpoint(self) -> None:
        if self.endpoint is not None:
            self.endpoint.server.shutdown()
            self.endpoint.server.server_close()
            self.endpoint = None

    def shutdown(self) -> None:
        """Flush OTLP, stop the endpoint; safe to call twice."""
        self.stop_endpoint()
        if self.provider is not None:
            try:
                self.provider.shutdown(timeout_millis=self.cfg.otlp.timeout_seconds * 1000)
            except Exception:  # noqa: BLE001 - shutdown must not raise into training
                self.on_error("otlp")
            self.provider = None
