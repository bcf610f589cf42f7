"""Every HTTP endpoint of mfotel (a rank's /metrics and live page, the alerts receiver) is
served by this package, one concern a module:

    wsgi.py        the WSGI types, the plain-text answer, the headers of every response
    server.py      the asyncio server: exact connection cap, per-client share, timeouts,
                   TLS off the accept path, answers under way finished before close
    webconfig.py   exporter-toolkit's web-config file: parsing and validation only
    auth.py        basic auth (bcrypt), fixed credentials (bearer / basic), mutual-TLS peers
    ratelimit.py   token buckets, per client, and the web-config's rate_limit
    exposition.py  /metrics: cached collection and rendering, the routing table

`serve` puts a web-config in front of an app and starts the server:

    server = serve(Router({"/metrics": app}), "0.0.0.0", 9464, load_web_config("web.yml"))
    ...
    server.close()
"""
from __future__ import annotations

from collections.abc import Callable

from .auth import AllowedSans, BasicAuth
from .ratelimit import RateLimit, TokenBucket
from .server import DEFAULT_LIMITS, Limits, Server
from .webconfig import WebConfig
from .wsgi import SECURITY_HEADERS, WsgiApp, merged_headers


def serve(app: WsgiApp, host: str, port: int, web: WebConfig | None = None,
          limits: Limits = DEFAULT_LIMITS, auth_failures_per_second: float = 1.0,
          on_error: Callable[[str], None] = lambda stage: None,
          name: str = "mfotel-metrics") -> Server:
    """Serve `app` on host:port behind the web-config's TLS, mutual-TLS peer check, basic
    auth, rate limit and headers; OSError when the port cannot be bound."""
    tls, headers = None, SECURITY_HEADERS
    if web is not None:
        if web.users:
            app = BasicAuth(app, web.users, auth_failures_per_second)
        if web.rate_limit:
            interval, burst = web.rate_limit
            app = RateLimit(app, TokenBucket(1.0 / interval, burst))
        tls = web.tls
        headers = tuple(merged_headers(SECURITY_HEADERS, web.headers))
    peers = AllowedSans(tls.client_allowed_sans) if tls and tls.client_allowed_sans else None
    return Server(app, host, port, tls.context() if tls else None, limits, peers, on_error,
                  headers, name).start()
