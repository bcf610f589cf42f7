"""The node endpoint: the node agent's series, served by the very stack of a rank's /metrics.

Same server (`mfotel.endpoint`: one event loop, a few workers, the connection cap and time-outs),
same web-config file (TLS, mutual TLS, basic auth, headers, rate limit), same limits, same
bind address: `monitor_config.prometheus.host`, on `prometheus.node_port` (default `port - 1`,
9463). The only module of the node agent that knows the endpoint's building blocks.

    endpoint = NodeEndpoint(collector, cfg.prometheus, port=9463, source=cfg.source)
    endpoint.start()     # False (warned) when the port is taken
    endpoint.url         # http://127.0.0.1:9463/metrics
    endpoint.route("/stacks", app)   # another path, behind the same web-config and limits
    endpoint.close()
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry

from ..config.settings import PrometheusConfig
from ..endpoint import serve
from ..endpoint.exposition import CachedMetricsApp, CachingCollector, Router
from ..endpoint.server import Limits, Server
from ..endpoint.webconfig import endpoint_web_config
from ..endpoint.wsgi import WsgiApp

log = logging.getLogger("mfotel")


def scheme(prom: PrometheusConfig, source: str) -> str:
    """https when the ranks (and so the node endpoint) serve TLS."""
    web = endpoint_web_config(prom, source)
    return "https" if web is not None and web.tls is not None else "http"


class _Scrapes:
    """Counts the answered /metrics requests (only those past authentication)."""

    def __init__(self, app: WsgiApp) -> None:
        self.app = app
        self.count = 0
        self.last: float | None = None
        self._lock = threading.Lock()

    def __call__(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        body = self.app(environ, start_response)
        with self._lock:
            self.count += 1
            self.last = time.time()
        return body


def _each_second() -> int:
    """A version that moves once a second: /proc is read at most once a second however many
    Prometheus servers scrape."""
    return int(time.monotonic())


class NodeEndpoint:
    """Serves `collector` on `prom.host:port` behind the ranks' web-config and limits."""

    def __init__(self, collector: object, prom: PrometheusConfig, port: int,
                 source: str = "<kwargs>") -> None:
        self.prom, self.port, self.source = prom, port, source
        self.web = endpoint_web_config(prom, source)
        registry = CollectorRegistry(auto_describe=False)
        cached = CachingCollector(_registry_of(collector), _each_second)
        registry.register(cached)
        self.scrapes = _Scrapes(CachedMetricsApp(registry, [cached]))
        self.router = Router({"/metrics": self.scrapes})
        self.server: Server | None = None

    def start(self) -> bool:
        """Bind and serve; a taken port warns (naming the fix) and returns False."""
        limits = Limits(max_connections=self.prom.max_connections,
                        request_timeout=self.prom.request_timeout_seconds)
        try:
            self.server = serve(self.router, self.prom.host, self.port, self.web, limits,
                                self.prom.auth_failures_per_second, name="mfotel-node")
        except OSError as exc:
            log.warning("mfotel-instrument: cannot serve the node endpoint on %s:%d (%s); the "
                        "job runs without it (ranks' deaths then page as MindFormersRankDown). "
                        "Fix: free the port, or give this job another "
                        "monitor_config.prometheus.node_port (--node-port; 0 turns it off)",
                        self.prom.host, self.port, exc.strerror or exc)
            return False
        self.port = self.server.port
        return True

    def route(self, path: str, app: WsgiApp) -> None:
        """Serve `app` at `path` too: behind the same web-config, limits and server
        (mfotel.node.stacks: /stacks)."""
        self.router.routes[path] = app

    @property
    def scheme(self) -> str:
        return "https" if self.web is not None and self.web.tls is not None else "http"

    @property
    def url(self) -> str:
        host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(self.prom.host,
                                                                         self.prom.host)
        host = f"[{host}]" if ":" in host else host
        return f"{self.scheme}://{host}:{self.port}/metrics"

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None


def _registry_of(collector: object) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)  # type: ignore[arg-type]
    return registry
