"""A short liveness probe of a rank's /metrics: does the rank's own server still answer?

A rank's endpoint runs in the rank's process, in Python: while the process holds the GIL
(a graph compilation, a C call that keeps it) or is stopped, the kernel still accepts
connections into the listen backlog, but nothing answers. The probe asks for `LIVENESS_PATH`,
which every mfotel endpoint's server answers itself (`200 alive`, before the app and its
authentication): no collection, no credentials, and never a failure counted against the
probing address (mfotel.endpoint.server). Any other answer proves a server runs too (a 401 or
404 of another server, a TLS alert refusing the probe's missing client certificate, a close).
Only silence until the timeout means "not answering"; a refused connection means nothing
listens.

The probe reads nothing it could misuse: it verifies no certificate (it only asks whether
the server answers) and sends no credentials. Neither the probe nor the one read of /metrics
(the rank's identity) counts as the scrape that ends a rank's linger (`linger_until_scraped`):
both send `X-Mfotel-Not-A-Scrape` (a rank cancelled before its identity was read ended its
linger on that read, and its final status never reached Prometheus).

    probe("127.0.0.1", 9465, "http", timeout=2.0)   # Probe(outcome="answered", status=200)
"""
from __future__ import annotations

import socket
import ssl
import time
from dataclasses import dataclass
from typing import Literal

from ..endpoint.exposition import NOT_A_SCRAPE
from ..endpoint.server import LIVENESS_PATH

Outcome = Literal["answered", "silent", "refused"]
#: Enough of a body to read mindformers_train_rank_info from (identity); beyond, not read.
MAX_BODY_BYTES = 4 << 20


@dataclass(frozen=True)
class Probe:
    outcome: Outcome
    seconds: float
    status: int | None = None   # the HTTP status, when one came
    body: bytes = b""           # with body=True and a 200


def _tls_context() -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # liveness only: nothing secret is sent or trusted
    return context


_TLS = _tls_context()


def probe(address: str, port: int, scheme: str, timeout: float, body: bool = False,
          path: str = LIVENESS_PATH) -> Probe:
    """HEAD `path` at address:port within `timeout` seconds in all; with `body`, GET
    /metrics (the rank's identity)."""
    path = "/metrics" if body else path
    started = time.monotonic()
    deadline = started + timeout

    def left() -> float:
        return max(0.001, deadline - time.monotonic())

    def done(outcome: Outcome, status: int | None = None, data: bytes = b"") -> Probe:
        return Probe(outcome, time.monotonic() - started, status, data)

    try:
        sock = socket.create_connection((address, port), timeout=left())
    except ConnectionRefusedError:
        return done("refused")
    except TimeoutError:
        return done("silent")
    except OSError:
        return done("refused")  # unreachable: nothing listens there for us
    try:
        if scheme == "https":
            sock.settimeout(left())
            sock = _TLS.wrap_socket(sock, server_hostname=None)
        host = f"[{address}]" if ":" in address else address
        method = "GET" if body else "HEAD"
        sock.settimeout(left())
        sock.sendall(f"{method} {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
                     f"User-Agent: mfotel-node-agent\r\n{NOT_A_SCRAPE}: 1\r\n"
                     "Connection: close\r\n\r\n".encode())
        received = b""
        while len(received) < MAX_BODY_BYTES:
            sock.settimeout(left())
            chunk = sock.recv(65536)
            if not chunk:
                break
            received += chunk
            if not body and b"\r\n" in received:
                break  # the status line is all a liveness probe needs
        return done("answered", *_response(received, body))
    except TimeoutError:
        return done("silent")
    except (OSError, ValueError):
        return done("answered")  # the server acted: a TLS alert, a reset, a close
    finally:
        sock.close()


def _response(received: bytes, body: bool) -> tuple[int | None, bytes]:
    """(status, body) of an HTTP/1.x response (None when it is not one)."""
    head, _, rest = received.partition(b"\r\n\r\n")
    parts = head.split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
        return None, b""
    status = int(parts[1])
    return status, rest if body and status == 200 else b""
