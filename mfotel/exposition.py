"""Serving /metrics: a collector cache keyed on a version, and the HTTP(S) server.

The OTel reader re-collects and re-translates every series on each scrape while holding the
GIL. Values only change when the training thread records, so `CachingCollector` hands out the
families of the last collection until the source's version moves, and `CachedMetricsApp`
reuses the rendered body until a collector re-collects. Collection is serialised: the OTel
Prometheus reader is not safe under concurrent scrapes (two collections can take each other's
data).
"""
from __future__ import annotations

import gzip
import ssl
import threading
import time
from typing import Any, Callable, Hashable, Iterable, Sequence
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import ThreadingWSGIServer, choose_encoder
from prometheus_client.metrics_core import Metric

from .webconfig import BasicAuth, WebConfig


class CachingCollector:
    """Re-collects `source` only when `version()` changes, and at most once per
    `cost / budget` seconds when `budget` is set (cost = the last collection's duration).

    The budget bounds the share of wall time spent collecting (holding the GIL, hence taken
    from training) whatever the scrape rate; scrapes in between get the previous families.
    """

    def __init__(self, source: CollectorRegistry, version: Callable[[], Hashable],
                 budget: float | None = None) -> None:
        self.source, self.version, self.budget = source, version, budget
        self._lock = threading.Lock()
        self._seen: Hashable = object()
        self._families: list[Metric] = []
        self._next_allowed = 0.0
        self.generation = 0  # bumped at every re-collection

    def refresh(self) -> int:
        """Re-collect if due; returns the generation of the families collect() returns."""
        with self._lock:
            current = self.version()
            if current != self._seen and time.monotonic() >= self._next_allowed:
                started = time.monotonic()
                self._families = list(self.source.collect())
                cost = time.monotonic() - started
                self._next_allowed = started + cost / self.budget if self.budget else 0.0
                self._seen = current
                self.generation += 1
            return self.generation

    def collect(self) -> Iterable[Metric]:
        self.refresh()
        return self._families

    def is_current(self) -> bool:
        """Whether the last collection saw the source's current version."""
        return self._seen == self.version()


class CachedMetricsApp:
    """WSGI app serving /metrics; rendered bytes are reused until a collector re-collects."""

    def __init__(self, registry: CollectorRegistry, collectors: Sequence[CachingCollector]) -> None:
        self.registry, self.collectors = registry, collectors
        self._lock = threading.Lock()
        self._cache: dict[tuple, bytes] = {}
        self._key: tuple = ()
        self.served: tuple = ()  # generations of the last body served

    def __call__(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        if environ.get("REQUEST_METHOD", "GET") not in ("GET", "HEAD"):
            start_response("405 Method Not Allowed", [("Allow", "GET")])
            return [b""]
        encoder, content_type = choose_encoder(environ.get("HTTP_ACCEPT", ""))
        gzipped = "gzip" in environ.get("HTTP_ACCEPT_ENCODING", "")
        with self._lock:
            generations = tuple(c.refresh() for c in self.collectors)
            if generations != self._key:
                self._cache, self._key = {}, generations
            body = self._cache.get((content_type, gzipped))
            if body is None:
                body = encoder(self.registry)
                body = gzip.compress(body, compresslevel=1) if gzipped else body
                self._cache[(content_type, gzipped)] = body
            self.served = generations
        headers = [("Content-Type", content_type), ("Content-Length", str(len(body)))]
        if gzipped:
            headers.append(("Content-Encoding", "gzip"))
        start_response("200 OK", headers)
        return [body]


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        """No access log on the training process's stderr."""


def serve(app: Callable, host: str, port: int,
          web: WebConfig | None = None) -> tuple[ThreadingWSGIServer, threading.Thread]:
    """Serve a WSGI `app` on host:port in a daemon thread, with TLS / basic auth from `web`."""
    if web is not None and web.users:
        app = BasicAuth(app, web.users)

    class Server(ThreadingWSGIServer):
        """Per-call subclass so IPv6 hosts can set the address family."""
        request_queue_size = 128  # listen backlog: socketserver's 5 drops bursts of scrapers

    if ":" in host:
        import socket
        Server.address_family = socket.AF_INET6
    httpd = make_server(host, port, app, Server, handler_class=_QuietHandler)
    if web is not None and web.cert_file:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(web.cert_file, web.key_file)
        httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    thread = threading.Thread(target=httpd.serve_forever, name="mfotel-metrics", daemon=True)
    thread.start()
    return httpd, thread
