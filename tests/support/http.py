"""One HTTP client for the tests: GET (or POST) a URL, with optional auth, TLS context, timeout.

    reply = get(url, auth=basic_auth("prometheus", "pw"), context=ssl_context)
    reply.status, reply.headers["Content-Type"], reply.text, reply.json()
    get_text(url)   # the body of a 2xx answer; AssertionError naming the URL otherwise
    get_json(url)

`get`/`post`/`request` return error statuses (4xx, 5xx) like any other answer; `get_text` and
`get_json` raise StatusError (an OSError) for them. A failed connection (refused, reset, TLS
handshake refused, timeout, a broken answer) raises OSError. No redirects are followed.
"""
from __future__ import annotations

import base64
import http.client
import json
import ssl
import urllib.parse
from dataclasses import dataclass
from typing import Any


class StatusError(OSError):
    """A non-2xx answer where a 2xx one was required."""


@dataclass(frozen=True)
class Reply:
    status: int
    headers: http.client.HTTPMessage
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode()

    def json(self) -> Any:
        return json.loads(self.body)


def basic_auth(user: str, password: str) -> str:
    """An Authorization header value for HTTP basic auth."""
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def bearer(token: str) -> str:
    """An Authorization header value for a bearer token."""
    return f"Bearer {token}"


def request(url: str, method: str = "GET", data: bytes | dict | list | None = None, *,
            auth: str | None = None, headers: dict[str, str] | None = None,
            context: ssl.SSLContext | None = None, timeout: float = 10.0,
            source: str | None = None) -> Reply:
    """One request to `url`; a dict or list `data` is sent as JSON. `auth` is the Authorization
    header's value; `source` a local address to connect from (another loopback address)."""
    parts = urllib.parse.urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    address = (source, 0) if source else None
    if parts.scheme == "https":
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(
            parts.hostname or "", port, timeout=timeout, source_address=address,
            context=context or ssl.create_default_context())
    else:
        conn = http.client.HTTPConnection(parts.hostname or "", port, timeout=timeout,
                                          source_address=address)
    sent = dict(headers or {})
    if isinstance(data, (dict, list)):
        data = json.dumps(data).encode()
        sent.setdefault("Content-Type", "application/json")
    if auth:
        sent["Authorization"] = auth
    path = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
    try:
        conn.request(method, path, body=data, headers=sent)
        response = conn.getresponse()
        return Reply(response.status, response.headers, response.read())
    except http.client.HTTPException as exc:  # a broken answer: as a failed connection
        if isinstance(exc, OSError):
            raise
        raise ConnectionError(f"{method} {url}: {exc!r}") from exc
    finally:
        conn.close()


def get(url: str, **options: Any) -> Reply:
    return request(url, "GET", **options)


def post(url: str, data: bytes | dict | list, **options: Any) -> Reply:
    return request(url, "POST", data, **options)


def get_text(url: str, **options: Any) -> str:
    """The body of a 2xx answer to GET `url` (StatusError otherwise)."""
    reply = get(url, **options)
    if not 200 <= reply.status < 300:
        raise StatusError(f"GET {url}: {reply.status} {reply.body[:300]!r}")
    return reply.text


def get_json(url: str, **options: Any) -> Any:
    """The decoded JSON body of a 2xx answer to GET `url` (StatusError otherwise)."""
    return json.loads(get_text(url, **options))
