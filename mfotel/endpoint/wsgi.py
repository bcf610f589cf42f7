"""The WSGI types every endpoint module shares, and the plain-text answer.

    def app(environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        return plain(start_response, "404 Not Found")
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

#: The WSGI environ of one request.
Environ = dict[str, Any]
#: WSGI's start_response(status, headers[, exc_info]) -> write.
StartResponse = Callable[..., Any]
#: A WSGI application.
WsgiApp = Callable[[Environ, StartResponse], Iterable[bytes]]
Headers = list[tuple[str, str]]
#: Environ key an auth middleware sets to True once the request's credentials passed (the
#: server then never counts the request's answer as a failure of its client).
AUTHENTICATED = "mfotel.authenticated"
#: Environ key an app may set to a callable: the server calls it with the seconds from the
#: connection's set-up in the kernel (before its accept, which a busy process makes late) to
#: the whole answer handed to the kernel (the metrics app counts a scrape as served only if
#: its scraper was still waiting for it).
SENT = "mfotel.sent"

#: Headers on every response of every endpoint, unless the app sets its own (the live page
#: sends a stricter Content-Security-Policy): nothing an endpoint answers may be sniffed into
#: HTML, framed, or leak the URL as a referrer.
SECURITY_HEADERS: tuple[tuple[str, str], ...] = (
    ("X-Content-Type-Options", "nosniff"),
    ("X-Frame-Options", "DENY"),
    ("Content-Security-Policy", "default-src 'none'; frame-ancestors 'none'"),
    ("Referrer-Policy", "no-referrer"),
)


def plain(start_response: StartResponse, status: str, headers: Sequence[tuple[str, str]] = (),
          text: str | None = None) -> list[bytes]:
    """Answer `status` with a one-line text body (`text`, else the status' reason)."""
    body = ((status[4:] if text is None else text) + "\n").encode()
    start_response(status, [("Content-Type", "text/plain; charset=utf-8"),
                            ("Content-Length", str(len(body))), *headers])
    return [body]


def merged_headers(defaults: Sequence[tuple[str, str]], configured: Mapping[str, str]
                   ) -> Headers:
    """`defaults`, with `configured` values in place of those of the same (case-insensitive)
    name."""
    replaced = {name.lower() for name in configured}
    return [*((n, v) for n, v in defaults if n.lower() not in replaced), *configured.items()]
