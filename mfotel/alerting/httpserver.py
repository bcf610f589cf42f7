"""`http.server` with limits, so no client can starve the alerts receiver of threads or sockets.

    server = BoundedHTTPServer(("127.0.0.1", 0), Handler, max_connections=16,
                               request_seconds=10, tls=tls_context("crt.pem", "key.pem"))

- At most `max_connections` connections are served at once, one thread each; a connection
  beyond that gets `503` (Alertmanager retries) from the accept loop, without a thread, and is
  closed a second later (at most `MAX_LINGERING` such sockets are kept).
- Each connection has `request_seconds` in total to send its request and read the answer
  (every read and write waits at most what is left), so idle or trickling clients are cut off.
- TLS handshakes run in the connection's thread under the same deadline, never in `accept()`
  (where one silent client would block every other).
- One request per connection (HTTP/1.0 replies), so the deadline covers the whole connection.
"""
from __future__ import annotations

import io
import socket
import ssl
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

LINGER_SECONDS = 1.0     # a refused connection stays open this long for the client to read
MAX_LINGERING = 256      # ... and at most this many of them (file descriptors)
BUSY_RESPONSE = (b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain\r\n"
                 b"Retry-After: 1\r\nConnection: close\r\nContent-Length: 24\r\n\r\n"
                 b"too many connections   \n")


def tls_context(cert_file: str, key_file: str, client_ca_file: str | None = None
                ) -> ssl.SSLContext:
    """A server TLS context (TLS 1.2+); with `client_ca_file`, clients must show a certificate
    signed by it (mutual TLS)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert_file, key_file)
    if client_ca_file:
        context.load_verify_locations(cafile=client_ca_file)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


class _DeadlineReader(io.RawIOBase):
    """Socket reads that together take at most until `deadline` (time.monotonic)."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        super().__init__()
        self.sock, self.deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the client took too long to send its request")
        self.sock.settimeout(remaining)
        return self.sock.recv_into(buffer)


class BoundedRequestHandler(BaseHTTPRequestHandler):
    """A request handler whose reads share the connection's deadline (`self.deadline`)."""

    server: "BoundedHTTPServer"

    def setup(self) -> None:
        super().setup()
        self.deadline = self.server.deadline_for(self.request)
        self.rfile.close()
        self.rfile = io.BufferedReader(_DeadlineReader(self.connection, self.deadline))

    def allow_writing(self) -> None:
        """Before answering: what is left of the deadline, but at least a second to write."""
        self.connection.settimeout(max(self.deadline - time.monotonic(), 1.0))

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        """No access log: the receiver's output is one line per alert."""


class BoundedHTTPServer(HTTPServer):
    """An HTTPServer serving each connection on its own thread, within the limits above."""

    request_queue_size = 64   # listen backlog: bursts wait in the kernel, not in threads
    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BoundedRequestHandler], *,
                 max_connections: int = 16, request_seconds: float = 10.0,
                 tls: ssl.SSLContext | None = None) -> None:
        if max_connections < 1 or not request_seconds > 0:
            raise ValueError("max_connections must be >= 1 and request_seconds > 0")
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, handler)
        self.max_connections, self.request_seconds, self.tls = \
            max_connections, request_seconds, tls
        self._slots = threading.BoundedSemaphore(max_connections)
        self._deadlines: dict[int, float] = {}
        self._closing: deque[tuple[float, socket.socket]] = deque()   # refused, closing soon
        self._lock = threading.Lock()
        self.refused = 0        # connections turned away because all slots were busy
        self.failed = 0         # connections that ended in a timeout, reset or TLS error

    def deadline_for(self, sock: socket.socket) -> float:
        with self._lock:
            return self._deadlines.get(id(sock), time.monotonic() + self.request_seconds)

    def process_request(self, request: socket.socket, client_address: Any) -> None:
        """Called by serve_forever's accept loop: hand the connection to a thread, or refuse."""
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            self._refuse(request)
            return
        thread = threading.Thread(target=self._serve, args=(request, client_address),
                                  name="mfotel-receiver-conn", daemon=True)
        try:
            thread.start()
        except RuntimeError:  # cannot start a thread (resource limits): refuse, keep serving
            self._slots.release()
            self._refuse(request)

    def _refuse(self, sock: socket.socket) -> None:
        """Answer 503 without a thread. The socket stays open (write side shut) for a moment,
        so that the client can send its request and read the answer instead of a reset."""
        if self.tls is not None:  # a TLS client cannot read a clear-text answer
            self.shutdown_request(sock)
            return
        try:
            sock.setblocking(False)
            sock.send(BUSY_RESPONSE)   # a fresh socket's buffer takes it whole
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            self.close_request(sock)
            return
        self._closing.append((time.monotonic() + LINGER_SECONDS, sock))
        while len(self._closing) > MAX_LINGERING:
            self._close_refused(self._closing.popleft()[1])

    def service_actions(self) -> None:
        """Called by serve_forever's loop: close refused sockets whose moment is over."""
        now = time.monotonic()
        while self._closing and self._closing[0][0] <= now:
            self._close_refused(self._closing.popleft()[1])

    def _close_refused(self, sock: socket.socket) -> None:
        try:   # read what the client sent (up to 1 MiB), so that closing does not reset it
            for _ in range(16):
                if not sock.recv(1 << 16):
                    break
        except OSError:   # nothing more buffered (the socket does not block), or gone
            pass
        self.close_request(sock)

    def server_close(self) -> None:
        super().server_close()
        while self._closing:
            self.close_request(self._closing.popleft()[1])

    def _serve(self, sock: socket.socket, client_address: Any) -> None:
        deadline = time.monotonic() + self.request_seconds
        conn: socket.socket = sock
        try:
            sock.settimeout(self.request_seconds)
            if self.tls is not None:  # the handshake, bounded by the socket timeout
                conn = self.tls.wrap_socket(sock, server_side=True)
            with self._lock:
                self._deadlines[id(conn)] = deadline
            self.finish_request(conn, client_address)
        except Exception:  # noqa: BLE001 - timeouts, resets, failed handshakes: the client's
            self.failed += 1   # problem, never a traceback or a lost thread slot
        finally:
            with self._lock:
                self._deadlines.pop(id(conn), None)
            self.shutdown_request(conn)
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Never print a traceback for a client's misbehaviour."""
        self.failed += 1
