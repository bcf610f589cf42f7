"""Serving /metrics: a collector cache keyed on a version, the rendering app, and the router.

The OTel reader re-collects and re-translates every series on each scrape while holding the
GIL. Values only change when the training thread records, so `CachingCollector` hands out the
families of the last collection until the source's version moves, and `CachedMetricsApp`
reuses the rendered body until a collector re-collects. Collection is serialised: the OTel
Prometheus reader is not safe under concurrent scrapes (two collections can take each other's
data).
"""
from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from .wsgi import SENT, Environ, StartResponse, WsgiApp


class CachingCollector:
    """Re-collects `source` only when `version()` changes, and at most once per
    `cost / budget` seconds when `budget` is set (cost = the last collection's duration).

    The budget bounds the share of wall time spent collecting (holding the GIL, hence taken
    from training) whatever the scrape rate; scrapes in between get the previous families.
    """

    def __init__(self, source: Collector, version: Callable[[], Hashable],
                 budget: float | None = None) -> None:
        self.source, self.version, self.budget = source, version, budget
        self._lock = threading.Lock()
        self._seen: Hashable = object()
        self._families: list[Metric] = []
        self._last = (0.0, 0.0)  # (start, duration) of the last collection
        self.generation = 0  # bumped at every re-collection

    def refresh(self) -> int:
        """Re-collect if due; returns the generation of the families collect() returns."""
        with self._lock:
            current = self.version()
            if current != self._seen and self._due():
                started = time.monotonic()
                self._families = list(self.source.collect())
                self._last = (started, time.monotonic() - started)
                self._seen = current
                self.generation += 1
            return self.generation

    def _due(self) -> bool:
        started, cost = self._last
        return not self.budget or time.monotonic() - started >= cost / self.budget

    def collect(self) -> Iterable[Metric]:
        self.refresh()
        return self._families

    def is_current(self) -> bool:
        """Whether the last collection saw the source's current version."""
        return self._seen == self.version()


class _Families:
    """A collector-like view of one CachingCollector's current families (for the encoders)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterable[Metric]:
        return self.families


class CachedMetricsApp:
    """WSGI app serving /metrics. Each collector's part is rendered once per re-collection:
    a scrape after a training step re-renders the few contract series, not the thousands of
    native ones; the compressed body is reused until any part changes."""

    EOF = b"# EOF\n"

    def __init__(self, registry: CollectorRegistry, collectors: Sequence[CachingCollector]) -> None:
        self.registry, self.collectors = registry, collectors
        self._lock = threading.Lock()
        self._parts: dict[tuple[int, str], tuple[int, bytes]] = {}
        self._gzipped: dict[str, tuple[tuple[int, ...], bytes]] = {}
        self.served: tuple[int, ...] = ()  # generations of the last body served in time

    def _part(self, index: int, encoder: Callable[[Any], bytes], content_type: str) -> bytes:
        collector = self.collectors[index]
        generation = collector.refresh()
        cached = self._parts.get((index, content_type))
        if cached is None or cached[0] != generation:
            body = encoder(_Families(list(collector.collect())))
            cached = (generation, body[:-len(self.EOF)] if body.endswith(self.EOF) else body)
            self._parts[(index, content_type)] = cached
        return cached[1]

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        if environ.get("REQUEST_METHOD", "GET") not in ("GET", "HEAD"):
            start_response("405 Method Not Allowed", [("Allow", "GET, HEAD")])
            return [b""]
        encoder, content_type = choose_encoder(environ.get("HTTP_ACCEPT", ""))
        gzipped = "gzip" in environ.get("HTTP_ACCEPT_ENCODING", "")
        openmetrics = content_type.startswith("application/openmetrics-text")
        with self._lock:
            parts = [self._part(i, encoder, content_type) for i in range(len(self.collectors))]
            generations = tuple(c.generation for c in self.collectors)
            cached = self._gzipped.get(content_type) if gzipped else None
            if cached is not None and cached[0] == generations:
                body = cached[1]
            else:
                body = b"".join(parts) + (self.EOF if openmetrics else b"")
                if gzipped:
                    body = gzip.compress(body, compresslevel=1)
                    self._gzipped[content_type] = (generations, body)
        if not environ.get(NOT_A_SCRAPE_ENVIRON):
            environ[SENT] = self._when_sent(generations, scrape_timeout(environ))
        headers = [("Content-Type", content_type), ("Content-Length", str(len(body)))]
        if gzipped:
            headers.append(("Content-Encoding", "gzip"))
        start_response("200 OK", headers)
        return [body]

    def _when_sent(self, generations: tuple[int, ...], timeout: float | None
                   ) -> Callable[[float], None]:
        """What the server calls once the body is sent: it counts as served (a rank's linger
        until scraped ends) only if the scraper was still waiting. A Prometheus scrape that
        times out drops the body: the final status it carried would never be stored."""
        def sent(seconds: float) -> None:
            if timeout is None or seconds <= timeout * IN_TIME_SHARE:
                self.served = generations
        return sent


#: A request header by which a reader of /metrics says it is no scrape (the node agent's read of
#: a rank's identity): its answer never ends a rank's linger, which waits for the metrics
#: store to have stored the final status.
NOT_A_SCRAPE = "X-Mfotel-Not-A-Scrape"
NOT_A_SCRAPE_ENVIRON = "HTTP_" + NOT_A_SCRAPE.upper().replace("-", "_")

#: The share of a scrape's time-out (Prometheus' X-Prometheus-Scrape-Timeout-Seconds) within
#: which a sent body counts as served: the scraper's clock starts before its connection is set
#: up (the time the connection then waits to be accepted is counted), and its reading ends
#: after the body arrives.
IN_TIME_SHARE = 0.5


def scrape_timeout(environ: Environ) -> float | None:
    """The scrape's time-out in seconds, from Prometheus' header; None without a valid one."""
    try:
        value = float(environ.get("HTTP_X_PROMETHEUS_SCRAPE_TIMEOUT_SECONDS", ""))
    except ValueError:
        return None
    return value if value > 0 else None


class Router:
    """WSGI app dispatching on the path: only the documented paths answer, the rest is 404.

    Keys are exact paths; a key ending in "/" (other than "/") also serves the paths below it.
    """

    def __init__(self, routes: Mapping[str, WsgiApp]) -> None:
        self.routes = dict(routes)
        self._prefixes = sorted((p for p in routes if p.endswith("/") and p != "/"), key=len,
                                reverse=True)

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "") or "/"
        app = self.routes.get(path) or next(
            (self.routes[p] for p in self._prefixes if path.startswith(p)), None)
        if app is not None:
            return app(environ, start_response)
        body = b"Not Found: this endpoint serves " + ", ".join(sorted(self.routes)).encode() + b"\n"
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8"),
                                         ("Content-Length", str(len(body)))])
        return [body]
