"""The HTTP(S) server of /metrics: nothing a network client sends can starve the training process.

One asyncio loop in a daemon thread accepts connections, runs TLS handshakes and reads request
heads, so an idle or slow client costs a file descriptor and a few KB, never a thread. Complete
requests go to a few daemon worker threads that call the WSGI app. The limits (`Limits`):

- at most `max_connections` open connections: at the cap, the oldest connection that is waiting
  on its client (handshake, request, or reading the response) is closed to admit the new one, so
  an idle flood can neither lock a scraper out nor exhaust the process's file descriptors;
- the TLS handshake and the request head must arrive within `request_timeout` seconds of the
  accept, and the response must be taken within the same time (slowloris, stalled readers);
- request heads of at most `max_head_bytes`; one request per connection (`Connection: close`);
- a client whose connections end in errors (4xx/5xx answers, timeouts, evictions, failed
  handshakes) more than `client_error_burst` times, then more than `client_errors_per_second`,
  has its new connections closed as soon as accepted, before any parsing or TLS: a flooding or
  password-guessing client costs the training process an accept and a close per connection;
- `workers` threads call the app; the listen backlog holds `backlog` pending connections.

    server = MetricsServer(app, "127.0.0.1", 9464, tls=context, limits=Limits(max_connections=64))
    server.start()      # serving in the background; server.port is the bound port
    server.close()
"""
from __future__ import annotations

import asyncio
import http.client
import io
import logging
import queue
import socket
import ssl
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable
from urllib.parse import unquote, urlsplit

from .ratelimit import Buckets, client_key

log = logging.getLogger("mfotel")
WsgiApp = Callable[[dict, Callable], Iterable[bytes]]
#: (status line, headers, body) of one response
Response = tuple[str, list[tuple[str, str]], bytes]
#: At close, how long answers under way may take to finish before their connections are cut.
DRAIN_SECONDS = 1.0


@dataclass(frozen=True)
class Limits:
    max_connections: int = 100
    request_timeout: float = 10.0
    workers: int = 4
    max_head_bytes: int = 8192
    backlog: int = 128  # socketserver's 5 drops bursts of scrapers
    client_errors_per_second: float = 1.0
    client_error_burst: int = 20


def _plain(status: str) -> Response:
    return status, [("Content-Type", "text/plain; charset=utf-8")], status[4:].encode() + b"\n"


class _Workers:
    """A fixed set of daemon threads running the loop's blocking calls.

    Not concurrent.futures: its threads are joined at interpreter exit, so one app call stuck
    behind a lock held by the exiting main thread would hang the end of training.
    """

    def __init__(self, count: int, name: str) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True)
                         for i in range(count)]
        for thread in self._threads:
            thread.start()

    def submit(self, loop: asyncio.AbstractEventLoop, call: Callable[[], Any]) -> asyncio.Future:
        future = loop.create_future()
        self._jobs.put((loop, future, call))
        return future

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            loop, future, call = job
            if future.cancelled():  # its connection was closed while it waited
                continue
            try:
                result, error = call(), None
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting coroutine
                result, error = None, exc
            try:
                loop.call_soon_threadsafe(_settle, future, result, error)
            except RuntimeError:  # the loop is closed: the server stopped
                pass

    def close(self, timeout: float) -> None:
        """Stop the threads once their current call returns (waiting at most `timeout`)."""
        for _ in self._threads:
            self._jobs.put(None)
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if not future.cancelled():
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)


class MetricsServer:
    """Serve a WSGI `app` on host:port in a daemon thread (TLS when `tls` is given).

    `accept_peer` sees the verified client certificate (`SSLSocket.getpeercert()`) after the
    handshake and may refuse the connection (exporter-toolkit's client_allowed_sans).
    `on_error(stage)` counts an app that raised (stage "scrape"); the client gets a 500.
    """

    def __init__(self, app: WsgiApp, host: str, port: int, tls: ssl.SSLContext | None = None,
                 limits: Limits = Limits(), accept_peer: Callable[[Any], bool] | None = None,
                 on_error: Callable[[str], None] = lambda stage: None) -> None:
        self.app, self.host, self.tls, self.limits = app, host, tls, limits
        self.accept_peer, self.on_error = accept_peer, on_error
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.create_server((host, port), family=family, backlog=limits.backlog)
        self.socket.setblocking(False)
        self.port: int = self.socket.getsockname()[1]
        self.scheme = "https" if tls is not None else "http"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="mfotel-metrics",
                                        daemon=True)
        # open connections in admission order -> whether a worker holds their request
        self._connections: dict[asyncio.Task, bool] = {}
        self._responding: set[asyncio.Task] = set()  # past the request head: being answered
        self._workers: _Workers | None = None
        self._accepting: asyncio.Task | None = None
        self._errors = Buckets(limits.client_errors_per_second, limits.client_error_burst)
        self._warned: set[str] = set()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "MetricsServer":
        self._workers = _Workers(self.limits.workers, "mfotel-metrics-worker")
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start_accepting(), self._loop).result(10)
        return self

    async def _start_accepting(self) -> None:
        self._accepting = asyncio.get_running_loop().create_task(self._accept_forever())

    def close(self, timeout: float = 5.0) -> None:
        """Stop accepting, close every connection, stop the threads; safe to call twice."""
        if self._thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout)
            except Exception:  # noqa: BLE001 - closing must not raise into training
                pass
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)
        if not self._thread.is_alive() and not self._loop.is_closed():
            self._loop.close()
        if self._workers is not None:
            self._workers.close(timeout)
            self._workers = None
        self.socket.close()

    async def _stop(self) -> None:
        # Answers under way are finished first (at most DRAIN_SECONDS): the final scrape, the
        # one that ended the linger, must reach Prometheus whole, not cut by the shutdown.
        if self._accepting is not None:  # new clients are refused at once, not left waiting
            self._accepting.cancel()
            await asyncio.gather(self._accepting, return_exceptions=True)
        self.socket.close()
        if self._responding:
            await asyncio.wait(set(self._responding), timeout=DRAIN_SECONDS)
        tasks = [t for t in (self._accepting, *self._connections) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.socket.close()

    # ------------------------------------------------------------------ connections
    async def _accept_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, peer = await loop.sock_accept(self.socket)
            except OSError as exc:  # EMFILE and friends: the process is short of descriptors
                self._warn_once("accept", "mfotel: /metrics cannot accept connections (%s); "
                                "retrying", exc.strerror or exc)
                await asyncio.sleep(0.1)
                continue
            try:
                await self._admit(conn, peer)
            except Exception as exc:  # noqa: BLE001 - the endpoint must keep accepting
                conn.close()
                self.on_error("server")
                self._warn_once("admit", "mfotel: /metrics dropped a connection (%s: %s)",
                                type(exc).__name__, exc)

    async def _admit(self, conn: socket.socket, peer: Any) -> None:
        """Serve `conn` unless its client failed too often or every place is being served."""
        client = client_key(str(peer[0])) if isinstance(peer, tuple) else ""
        if not self._errors[client].ready() or not await self._make_room():
            conn.close()
            return
        task = asyncio.get_running_loop().create_task(self._serve(conn, peer, client))
        self._connections[task] = False

    async def _make_room(self) -> bool:
        """Make room for one more connection; False if every open one is being served.

        Waits until the evicted connection's socket is closed, so that open descriptors never
        exceed the cap (a burst of accepts would otherwise outrun the closes).
        """
        if len(self._connections) < self.limits.max_connections:
            return True
        victim = next((task for task, at_app in self._connections.items() if not at_app), None)
        if victim is None:
            return False
        del self._connections[victim]  # the oldest one waiting on its client
        victim.cancel()
        await asyncio.wait({victim})  # its finally closed the socket (or scheduled the close first)
        return True

    async def _serve(self, conn: socket.socket, peer: Any, client: str) -> None:
        task = asyncio.current_task()
        assert task is not None and self._workers is not None
        timeout, transport, answered = self.limits.request_timeout, None, False
        try:
            async with asyncio.timeout(timeout):  # handshake and request head
                reader, writer = await self._open(conn)
                transport = writer.transport
                if self.accept_peer is not None and not self.accept_peer(
                        writer.get_extra_info("peercert")):
                    return
                request = await self._read_head(reader, peer, writer)
            self._responding.add(task)
            if isinstance(request, dict):
                self._connections[task] = True  # at the app: not a candidate for eviction
                try:
                    response = await self._workers.submit(asyncio.get_running_loop(),
                                                          lambda: self._call_app(request))
                finally:
                    if task in self._connections:
                        self._connections[task] = False
                head_only = request["REQUEST_METHOD"] == "HEAD"
            else:
                response, head_only = _plain(request), False
            async with asyncio.timeout(timeout):  # the client takes the response
                writer.write(self._encode(response, head_only))
                await writer.drain()
                answered = response[0][:1] in ("2", "3")
                writer.close()
                await writer.wait_closed()
                transport = None  # closed cleanly
        except (OSError, EOFError, asyncio.IncompleteReadError, asyncio.TimeoutError,
                asyncio.CancelledError):
            pass  # client gone, too slow, evicted, or the server stopping: drop the connection
        except Exception as exc:  # noqa: BLE001 - one bad connection must not matter
            self.on_error("server")
            self._warn_once("serve", "mfotel: /metrics dropped a connection (%s: %s)",
                            type(exc).__name__, exc)
        finally:
            self._connections.pop(task, None)
            self._responding.discard(task)
            if not answered:
                self._errors[client].spend()
            if transport is not None:
                transport.abort()
            else:
                conn.close()

    async def _open(self, conn: socket.socket) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Streams over an accepted socket; the TLS handshake runs here, in the loop."""
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=self.limits.max_head_bytes, loop=loop)
        protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
        timeout = self.limits.request_timeout if self.tls else None
        transport, _ = await loop.connect_accepted_socket(
            lambda: protocol, conn, ssl=self.tls, ssl_handshake_timeout=timeout,
            ssl_shutdown_timeout=timeout)
        return reader, asyncio.StreamWriter(transport, protocol, reader, loop)

    async def _read_head(self, reader: asyncio.StreamReader, peer: Any,
                         writer: asyncio.StreamWriter) -> dict | str:
        """The WSGI environ of the request, or the status line of why it is refused."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            return "431 Request Header Fields Too Large"
        except asyncio.IncompleteReadError as exc:
            if not exc.partial:
                raise  # closed without a request (e.g. a port check)
            return "400 Bad Request"
        return self._environ(head, peer, writer)

    def _environ(self, head: bytes, peer: Any, writer: asyncio.StreamWriter) -> dict | str:
        line, _, rest = head.partition(b"\r\n")
        parts = line.decode("latin-1").split(" ")
        if len(parts) != 3:
            return "400 Bad Request"
        method, target, version = parts
        if version not in ("HTTP/1.0", "HTTP/1.1"):
            return "505 HTTP Version Not Supported"
        if not target.startswith("/"):
            target = urlsplit(target).path if target.startswith(("http://", "https://")) else ""
            if not target:
                return "400 Bad Request"
        try:
            headers = http.client.parse_headers(io.BytesIO(rest))
        except http.client.HTTPException:
            return "400 Bad Request"
        path, _, query = target.partition("?")
        environ: dict[str, Any] = {
            "REQUEST_METHOD": method, "SCRIPT_NAME": "",
            "PATH_INFO": unquote(path, encoding="latin-1"), "QUERY_STRING": query,
            "SERVER_NAME": self.host, "SERVER_PORT": str(self.port), "SERVER_PROTOCOL": version,
            "REMOTE_ADDR": str(peer[0]) if isinstance(peer, tuple) else "",
            "wsgi.version": (1, 0), "wsgi.url_scheme": self.scheme, "wsgi.input": io.BytesIO(),
            "wsgi.errors": sys.stderr, "wsgi.multithread": True, "wsgi.multiprocess": False,
            "wsgi.run_once": False, "mfotel.peercert": writer.get_extra_info("peercert")}
        for name, value in headers.items():
            key = name.upper().replace("-", "_")
            key = key if key in ("CONTENT_TYPE", "CONTENT_LENGTH") else f"HTTP_{key}"
            environ[key] = f"{environ[key]},{value}" if key in environ else value
        return environ

    def _call_app(self, environ: dict) -> Response:
        """Run the WSGI app (in a worker thread); an app that raises is a 500, counted."""
        started: list = []
        written: list[bytes] = []

        def start_response(status: str, headers: list, exc_info: Any = None) -> Callable:
            started[:] = [status, list(headers)]
            return written.append

        try:
            chunks = self.app(environ, start_response)
            try:
                body = b"".join([*written, *chunks])
            finally:
                getattr(chunks, "close", lambda: None)()
            return started[0], started[1], body
        except Exception as exc:  # noqa: BLE001 - a scrape must never take training down
            self.on_error("scrape")
            self._warn_once("app", "mfotel: serving %s failed (%s: %s); answered 500, counted in "
                            "mfotel_export_errors_total{stage=\"scrape\"}",
                            environ.get("PATH_INFO"), type(exc).__name__, exc)
            return _plain("500 Internal Server Error")

    @staticmethod
    def _encode(response: Response, head_only: bool) -> bytes:
        status, headers, body = response
        names = {name.lower() for name, _ in headers}
        headers = [(n, v) for n, v in headers if n.lower() != "connection"]
        if "content-length" not in names:
            headers.append(("Content-Length", str(len(body))))
        lines = [f"HTTP/1.1 {status}", *(f"{n}: {v}" for n, v in headers), "Connection: close"]
        return "\r\n".join(lines).encode("latin-1") + b"\r\n\r\n" + (b"" if head_only else body)

    def _warn_once(self, what: str, message: str, *args: Any) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning(message, *args)
