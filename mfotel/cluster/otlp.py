"""OTLP/HTTP push for clusters Prometheus cannot scrape, off the training thread.

The OTel PeriodicExportingMetricReader collects and exports on its own thread; the training
thread only assigns plain attributes. When the collector is down or hangs, an export fails
after `otlp.timeout_seconds` on that thread: the failure is counted in
`mfotel_export_errors_total{stage="otlp"}` and warned about once (the SDK's own per-failure
log lines are absorbed into that one warning). At the end of training, the final push waits
at most `otlp.timeout_seconds`. If the reader's thread itself dies (an error outside the
export), that is counted and warned about the same way, never silent. Warnings never show
URL passwords.

    push = OtlpPush(cfg.otlp, on_error=lambda: count("otlp"))
    provider = MeterProvider(metric_readers=[push.reader()], resource=resource)
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from opentelemetry.sdk.metrics.export import (
    MetricExporter,
    MetricExportResult,
    PeriodicExportingMetricReader,
)

from ..config import OtlpConfig, metrics_url
from ..config.redact import redact_text, redact_url

log = logging.getLogger("mfotel")
#: Loggers of the OTLP exporter that log every failed export (and every retry).
SDK_EXPORT_LOGGERS = ("opentelemetry.exporter.otlp.proto.http.metric_exporter",
                      "opentelemetry.exporter.http_transport")


class _AbsorbExportLogs(logging.Filter):
    """Drops the SDK's export log records emitted while one of our exports runs (that
    thread only), keeping the last message as the reason for mfotel's single warning."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: set[int] = set()
        self.last: dict[int, str] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.thread in self.threads:
            self.last[record.thread] = record.getMessage()
            return False
        return True


_ABSORB = _AbsorbExportLogs()


def _install_filter() -> None:
    for name in SDK_EXPORT_LOGGERS:
        logger = logging.getLogger(name)
        if _ABSORB not in logger.filters:
            logger.addFilter(_ABSORB)


class CountingExporter(MetricExporter):
    """Wraps an exporter: a failed export is counted and warned about once, never raised."""

    def __init__(self, inner: MetricExporter, on_error: Callable[[], None],
                 warn_once: Callable[[str], None], endpoint: str = "") -> None:
        super().__init__(preferred_temporality=inner._preferred_temporality,
                         preferred_aggregation=inner._preferred_aggregation)
        self.inner, self.on_error, self.warn_once = inner, on_error, warn_once
        self.endpoint = endpoint

    def export(self, metrics_data: Any, timeout_millis: float = 10_000,
               **kwargs: Any) -> MetricExportResult:
        thread = threading.get_ident()
        _ABSORB.threads.add(thread)
        reason = ""
        try:
            result = self.inner.export(metrics_data, timeout_millis=timeout_millis, **kwargs)
        except Exception as exc:  # noqa: BLE001 - an exporter must never break training
            result, reason = MetricExportResult.FAILURE, f"{type(exc).__name__}: {exc}"
        finally:
            _ABSORB.threads.discard(thread)
            reason = reason or _ABSORB.last.pop(thread, "")
        if result is not MetricExportResult.SUCCESS:
            self.on_error()
            self.warn_once(f"mfotel: OTLP export to {redact_url(self.endpoint)} failed "
                           f"({redact_text(reason) or 'no reason given'}); training continues, "
                           f"further failures are counted in "
                           f"mfotel_export_errors_total{{stage=\"otlp\"}}")
        return result

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return self.inner.force_flush(timeout_millis)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self.inner.shutdown(timeout_millis=timeout_millis, **kwargs)


class GuardedReader(PeriodicExportingMetricReader):
    """A periodic reader whose thread, should it die, is counted and warned about.

    The SDK's `_ticker` catches only collection timeouts: anything else (e.g. an interval too
    large for `Event.wait`) ends the thread silently, and pushes stop with no error counted.
    """

    def __init__(self, exporter: MetricExporter, on_death: Callable[[BaseException], None],
                 **kwargs: Any) -> None:
        self._on_death = on_death  # before super(): the thread starts in its __init__
        super().__init__(exporter, **kwargs)

    def _ticker(self) -> None:
        try:
            super()._ticker()
        except BaseException as exc:  # noqa: BLE001 - the thread's last word, never lost
            self._on_death(exc)


class OtlpPush:
    """Creates the OTLP readers of one Telemetry; their failures share one warning."""

    def __init__(self, cfg: OtlpConfig, on_error: Callable[[], None]) -> None:
        self.cfg, self.on_error = cfg, on_error
        self.warned = False
        _install_filter()

    def _warn_once(self, message: str) -> None:
        if not self.warned:
            self.warned = True
            log.warning(message)

    def _died(self, exc: BaseException) -> None:
        self.on_error()
        self._warn_once(f"mfotel: the OTLP push thread stopped ({type(exc).__name__}: "
                        f"{redact_text(str(exc))}); training continues without OTLP pushes, "
                        f"counted in mfotel_export_errors_total{{stage=\"otlp\"}}")

    def reader(self, **reader_kwargs: Any) -> PeriodicExportingMetricReader:
        """A periodic reader pushing to `cfg.endpoint` (kwargs go to the reader).

        A base URL (`http://collector:4318`) gets `/v1/metrics` appended, as OTel SDKs do.
        """
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        cfg = self.cfg
        url = metrics_url(cfg.endpoint or "")
        inner = OTLPMetricExporter(endpoint=url, headers=dict(cfg.headers),
                                   timeout=cfg.timeout_seconds)
        return GuardedReader(
            CountingExporter(inner, self.on_error, self._warn_once, url), self._died,
            export_interval_millis=cfg.interval_seconds * 1000,
            export_timeout_millis=cfg.timeout_seconds * 1000, **reader_kwargs)
