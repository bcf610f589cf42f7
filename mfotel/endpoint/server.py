"""The HTTP(S) server of every mfotel endpoint: no network client can starve the process.

One asyncio loop in a daemon thread accepts connections, runs TLS handshakes, reads request
heads, writes answers and drains unread request bodies, on non-blocking sockets: an idle or slow
client costs a file descriptor and a few KB, never a thread. A complete request head goes to a
few daemon worker threads that call the WSGI app; the app reads a request body (`wsgi.input`)
in its worker, within the request deadline.

A connection is *waiting* from its accept until its request head is complete (TLS handshake
included): its client has not shown credentials yet. It is *idle* while it has sent nothing
(no byte read, none in the kernel's buffer), *started* once bytes came. It is then *at the app*
(authentication and the answer are computed; the limits never close it), then *answering*
(the client takes the answer), then *draining* (the answer is out; what is left of a body the
app did not read is read and dropped). The limits (`Limits`):

- at most `max_connections` connections accepted and not yet closed, counted exactly (each is
  one file descriptor; connections the kernel has completed but the process has not accepted
  yet wait in the listen backlog, outside the cap). At the cap a new connection takes the place
  of a waiting or answering one (the victim rule below) before it is accepted; when every place
  is at the app, it is closed as soon as accepted;
- at most `max_connections_per_client` of them from one client (an IPv4 address, an IPv6 /64)
  outside the app (waiting, answering or draining): beyond it one of the client's own makes
  room (the victim rule below), or the new one is closed. Connections at the app do not count:
  the app answers them in a moment, and an attacker cycling requests through the app (a 401
  costs it nothing) would otherwise fill the share of an address it shares with a legitimate
  client;
- `reserved` places are kept for requests past their head: waiting connections never hold more
  than `max_connections - reserved`; beyond that a waiting one (victim rule) is closed;
- the victim, by what closing it costs: a draining connection (its answer is out), then an idle
  waiting one (older than IDLE_GRACE_SECONDS), then a started waiting one, then a young idle
  one (for a client's own share the newest first: a burst from an address takes its own
  places, not that of a client of that address whose request is on its way), then one
  answering a request without verified credentials; never one at the app, nor one
  answering an authenticated request (when only such places are left, the newcomer is
  closed). Within each kind: one of the client holding
  the most; among such clients, the one with the most recent failures (see below); then the
  oldest. A flood from many addresses thus closes its own connections, not a scraper's; a
  client sharing an address with idle sockets (Alertmanager on the attacker's host) keeps its
  connection: it sent its request at once, and the idle ones go first;
- with `defer_accept` (the alerts receiver's) the kernel hands a connection over only once
  its first bytes came (Linux TCP_DEFER_ACCEPT; then it does anyway): a client's request is in
  the buffer when it is accepted, and a socket that comes without any was idle that long
  already (the victim rule counts it as an idle one older than IDLE_GRACE_SECONDS);
- the TLS handshake and request head must arrive within `header_timeout` of the accept (before
  any authentication), the body within `request_timeout` of the accept, and the answer must be
  taken within `request_timeout` of its start (idle sockets, slowloris, stalled readers);
- a body of at most `read_body_bytes` (0: none; an app that reads bodies without asking for
  credentials first, e.g. a receiver without them) is read by the server before the app is
  called, the connection still waiting (closable, no worker held), within `header_timeout`
  plus its declared length at `min_body_rate` of the accept (at most `request_timeout`):
  a client that declares a body and never sends it cannot hold the app's workers;
- request heads of at most `max_head_bytes` (431); one request per connection
  (`Connection: close`); a body the app did not read (a refusal, the liveness answer) is read
  and dropped after the answer only while it keeps coming: at most `drain_idle` seconds
  between its bytes, up to `drain_bytes`, within `request_timeout` of the answer, so that a
  client still sending gets the answer instead of a reset, and one that declared a body it
  never sends holds no place (a declared length is a promise, not a reason to wait);
- a client whose connections end in failures (4xx/5xx answers to unauthenticated requests,
  timeouts, evictions, failed handshakes) more than `client_error_burst` times, then more than
  `client_errors_per_second`, has its new connections closed as soon as accepted, before any
  parsing or TLS (unless `close_failing_clients` is off: then failures only rank victims);
- `GET` / `HEAD` of `LIVENESS_PATH` is answered by the server itself, `200 alive`, before the
  app and its authentication (after TLS and the peer check): the node agent's liveness probe
  costs no collection and no failure. It says only that the process runs, as an accepted
  connection does. (Answered 404 or 401 by the app, one probe a second spent the probing
  address's failures as fast as they refill: after a stall had spent the rest, a scraper on
  the same host was refused for minutes.)
- `workers` threads call the app; the listen backlog holds `backlog` pending connections.

Every answer carries `headers` (SECURITY_HEADERS by default) unless the app set them itself.

    server = Server(app, "127.0.0.1", 9464, tls=context, limits=Limits(max_connections=64))
    server.start()      # serving in the background; server.port is the bound port
    server.close()
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import http.client
import io
import logging
import queue
import select
import socket
import ssl
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

from .ratelimit import Buckets, client_key
from .wsgi import AUTHENTICATED, SECURITY_HEADERS, SENT, Environ, Headers, WsgiApp

log = logging.getLogger("mfotel")
#: (status line, headers, body) of one response
Response = tuple[str, Headers, bytes]
#: At close, how long answers under way may take to finish before their connections are cut.
DRAIN_SECONDS = 1.0
#: Connections accepted per readiness of the listening socket, so that reads and writes of
#: connections already open are served in between under a flood.
ACCEPT_BATCH = 32
#: An idle connection younger than this is closed for a newcomer only after the started ones:
#: a client's request may still be on its way (its connect completes before its first write;
#: on a loaded machine a client's process can wait a second for a core in between).
IDLE_GRACE_SECONDS = 2.0
WAITING, AT_APP, ANSWERING, DRAINING = "waiting", "at app", "answering", "draining"
#: The path of the liveness probe (mfotel-instrument's node agent), answered by the server.
LIVENESS_PATH = "/-/mfotel-liveness"


@dataclass(frozen=True)
class Limits:
    """What one endpoint grants its clients (see the module docstring)."""

    max_connections: int = 100
    max_connections_per_client: int | None = None  # None: max_connections
    reserved: int = 0
    request_timeout: float = 10.0
    header_timeout: float | None = None  # None: request_timeout
    workers: int = 4
    max_head_bytes: int = 8192
    drain_bytes: int = 1 << 20
    drain_idle: float = 1.0
    read_body_bytes: int = 0
    min_body_rate: float = float(1 << 20)
    backlog: int = 128  # socketserver's 5 drops bursts of scrapers
    #: Linux TCP_DEFER_ACCEPT: the kernel hands over a connection once its first bytes came
    #: (after this many seconds without any, it does anyway); 0: at once. The receiver's:
    #: its app needs no time since the connect (a rank's /metrics times a scrape from its
    #: accept, `linger_until_scraped`, and keeps 0)
    defer_accept: int = 0
    client_errors_per_second: float = 1.0
    client_error_burst: int = 20
    close_failing_clients: bool = True

    def __post_init__(self) -> None:
        if self.max_connections < 1 or not 0 <= self.reserved < self.max_connections:
            raise ValueError("max_connections must be >= 1 and 0 <= reserved < max_connections")
        if self.max_connections_per_client is not None and self.max_connections_per_client < 1:
            raise ValueError("max_connections_per_client must be >= 1")
        if not self.request_timeout > 0 or not (self.header_timeout or 1) > 0 \
                or not self.drain_idle > 0 or not self.min_body_rate > 0:
            raise ValueError("timeouts must be > 0")

    @property
    def per_client(self) -> int:
        return self.max_connections_per_client or self.max_connections

    @property
    def head_seconds(self) -> float:
        return min(self.header_timeout or self.request_timeout, self.request_timeout)


DEFAULT_LIMITS = Limits()


class _Closed(Exception):
    """The connection was closed under a coroutine waiting on it."""


class _Connection:
    """One accepted socket and where it is in its lifecycle."""

    __slots__ = ("sock", "fd", "client", "accepted", "arrived", "idle_from", "state", "task",
                 "timer", "closed", "answered_ok", "trusted", "started", "buffer", "body_left",
                 "expect_continue")

    def __init__(self, sock: socket.socket, client: str) -> None:
        self.sock, self.fd, self.client = sock, sock.fileno(), client
        self.accepted, self.state = time.monotonic(), WAITING
        self.arrived = self.accepted     # when its request came (earlier if it waited unaccepted)
        self.idle_from = self.accepted   # the victim rule's age of an idle connection
        self.task: asyncio.Task[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.closed = self.answered_ok = self.trusted = self.expect_continue = False
        self.started = False  # bytes came from the client (WAITING: started, not idle)
        self.buffer = b""   # bytes read past the request head (the start of the body)
        self.body_left = 0  # body bytes not read yet; -1: chunked, unknown


def _plain(status: str) -> Response:
    return status, [("Content-Type", "text/plain; charset=utf-8")], status[4:].encode() + b"\n"


#: The server's own answer on LIVENESS_PATH.
_ALIVE: Response = ("200 OK", [("Content-Type", "text/plain; charset=utf-8")], b"alive\n")


def _readable(conn: _Connection) -> bool:
    """Whether bytes (or the client's close) wait in the kernel's buffer of `conn`, unread."""
    poller = select.poll()
    poller.register(conn.fd, select.POLLIN)
    return bool(poller.poll(0))


#: Where struct tcp_info (linux/tcp.h) holds tcpi_last_data_sent and tcpi_last_data_recv:
#: milliseconds since the connection last sent (nothing yet: since it was set up) and received.
_TCP_INFO_LAST_DATA = 44, 52


def _waited_unaccepted(sock: socket.socket) -> float:
    """Seconds `sock` waited unaccepted, read as it is accepted (Linux's TCP_INFO; 0
    elsewhere): since the kernel set it up (at its handshake; deferred, at its first bytes),
    the time its scraper's clock ran while a busy process had not accepted it yet."""
    option = getattr(socket, "TCP_INFO", None)
    size = max(_TCP_INFO_LAST_DATA) + 4
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, option, size) if option else b""
    except OSError:
        return 0.0
    if len(info) < size:
        return 0.0
    return max(int.from_bytes(info[at:at + 4], sys.byteorder)
               for at in _TCP_INFO_LAST_DATA) / 1000.0


def _defer_accept(sock: socket.socket, seconds: int) -> bool:
    """Ask the kernel to hold a new connection until its first bytes come (at most about
    `seconds`): a client's request is then in the buffer when it is accepted, never on its way
    while a flood of idle sockets from its address takes its place. Whether it is on."""
    option = getattr(socket, "TCP_DEFER_ACCEPT", None)
    if seconds <= 0 or option is None:
        return False
    try:
        sock.setsockopt(socket.IPPROTO_TCP, option, seconds)
    except OSError:
        return False
    return True


def _is_liveness(request: Environ) -> bool:
    return request["PATH_INFO"] == LIVENESS_PATH and request["REQUEST_METHOD"] in ("GET", "HEAD")


class _Workers:
    """A fixed set of daemon threads running the loop's blocking calls.

    Not concurrent.futures: its threads are joined at interpreter exit, so one app call stuck
    behind a lock held by the exiting main thread would hang the end of training.
    """

    def __init__(self, count: int, name: str) -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._run, name=f"{name}-worker-{i}",
                                          daemon=True) for i in range(count)]
        for thread in self._threads:
            thread.start()

    def submit(self, loop: asyncio.AbstractEventLoop, call: Callable[[], Any]
               ) -> asyncio.Future[Any]:
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
            with contextlib.suppress(RuntimeError):  # the loop is closed: the server stopped
                loop.call_soon_threadsafe(_settle, future, result, error)

    def close(self, timeout: float) -> None:
        """Stop the threads once their current call returns (waiting at most `timeout`)."""
        for _ in self._threads:
            self._jobs.put(None)
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))


def _peercert(conn: _Connection) -> Any:
    """The verified client certificate of a TLS connection (None without one)."""
    return conn.sock.getpeercert() if isinstance(conn.sock, ssl.SSLSocket) else None


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if not future.cancelled():
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class _Body(io.RawIOBase):
    """`wsgi.input`: the request body, read from the loop by the app's worker thread, at most
    `Content-Length` bytes, before the request deadline (TimeoutError after it)."""

    def __init__(self, server: Server, conn: _Connection, deadline: float) -> None:
        super().__init__()
        self.server, self.conn, self.deadline = server, conn, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        wanted = min(len(buffer), self.conn.body_left)
        if wanted <= 0:
            return 0
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the client took too long to send its request body")
        future = asyncio.run_coroutine_threadsafe(self.server._read_body(self.conn, wanted),
                                                  self.server._loop)
        try:
            data = future.result(remaining)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError("the client took too long to send its request body") from None
        except (concurrent.futures.CancelledError, _Closed):
            raise ConnectionAbortedError("the connection was closed") from None
        buffer[:len(data)] = data
        return len(data)


class Server:
    """Serve a WSGI `app` on host:port in a daemon thread (TLS when `tls` is given).

    `accept_peer` sees the verified client certificate (`SSLSocket.getpeercert()`) after the
    handshake and may refuse the connection (exporter-toolkit's client_allowed_sans).
    `on_error(stage)` counts an app that raised (stage "scrape"; the client gets a 500) and a
    connection the server dropped on a bug (stage "server").
    """

    def __init__(self, app: WsgiApp, host: str, port: int, tls: ssl.SSLContext | None = None,
                 limits: Limits = DEFAULT_LIMITS, accept_peer: Callable[[Any], bool] | None = None,
                 on_error: Callable[[str], None] = lambda stage: None,
                 headers: Sequence[tuple[str, str]] = SECURITY_HEADERS,
                 name: str = "mfotel-endpoint") -> None:
        self.app, self.host, self.tls, self.limits = app, host, tls, limits
        self.accept_peer, self.on_error, self.name = accept_peer, on_error, name
        self.headers = list(headers)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.create_server((host, port), family=family, backlog=limits.backlog)
        self.socket.setblocking(False)
        self.deferred = _defer_accept(self.socket, limits.defer_accept)
        self._listening = select.poll()  # whether a connection is pending, before an eviction
        self._listening.register(self.socket, select.POLLIN)
        self.port: int = self.socket.getsockname()[1]
        self.scheme = "https" if tls is not None else "http"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._open: dict[_Connection, None] = {}  # in admission order: the oldest first
        self._held: Counter[str] = Counter()      # client -> its connections not at the app
        self._waiting = 0                         # open connections in the WAITING state
        self._workers: _Workers | None = None
        self._errors = Buckets(limits.client_errors_per_second, limits.client_error_burst)
        self._warned: set[str] = set()
        self._stopping = False
        self.refused = 0     # connections closed as soon as accepted (cap, client, failures)
        self.evicted = 0     # connections closed to make room for a new one
        self.timed_out = 0   # connections closed at their deadline

    @property
    def open_connections(self) -> int:
        """Connections accepted and not closed (the number max_connections caps)."""
        return len(self._open)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> Server:
        self._workers = _Workers(self.limits.workers, self.name)
        self._thread.start()
        self._loop.call_soon_threadsafe(self._listen)
        return self

    def _listen(self) -> None:
        if not self._stopping and self.socket.fileno() >= 0:
            self._loop.add_reader(self.socket.fileno(), self._accept)

    def close(self, timeout: float = 5.0) -> None:
        """Stop accepting, finish the answers under way (at most DRAIN_SECONDS), close every
        connection, stop the threads; safe to call twice."""
        if self._thread.is_alive():
            with contextlib.suppress(Exception):  # closing must not raise into training
                asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)
        if not self._thread.is_alive() and not self._loop.is_closed():
            self._loop.close()
        if self._workers is not None:
            self._workers.close(timeout)
            self._workers = None
        self.socket.close()

    async def _stop(self) -> None:
        # Answers under way are finished first: the final scrape, the one that ended the
        # linger, must reach Prometheus whole, not cut by the shutdown. New clients are
        # refused at once (the listening socket is closed), not left waiting.
        self._stopping = True
        with contextlib.suppress(ValueError, OSError):
            self._loop.remove_reader(self.socket.fileno())
        self.socket.close()
        busy = {c.task for c in self._open
                if c.state in (AT_APP, ANSWERING) and c.task is not None}
        if busy:
            await asyncio.wait(busy, timeout=DRAIN_SECONDS)
        tasks = [c.task for c in self._open if c.task is not None]
        for conn in list(self._open):
            self._close(conn)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------------ admission
    def _accept(self) -> None:
        """The listening socket is readable: accept a batch of connections; under pressure
        (an admission closed another connection) one, so that the loop reads the connections
        just admitted before another newcomer may take their place: a client that sent its
        request at once is at the app by then, never closed for a newcomer of its address."""
        for _ in range(ACCEPT_BATCH):
            evicted = self.evicted
            if len(self._open) >= self.limits.max_connections:
                if not self._listening.poll(0):
                    return
                victim = self._victim(self._open)
                if victim is not None:  # closed before the accept: never one over the cap
                    self._evict(victim)
            try:
                sock, peer = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and friends: the process is short of descriptors
                self._warn_once("accept", "mfotel: %s cannot accept connections (%s); retrying",
                                self.name, exc.strerror or exc)
                self._loop.remove_reader(self.socket.fileno())
                self._loop.call_later(0.1, self._listen)
                return
            try:
                self._admit(sock, peer)
            except Exception as exc:  # noqa: BLE001 - the endpoint must keep accepting
                sock.close()
                self.on_error("server")
                self._warn_once("admit", "mfotel: %s dropped a connection (%s: %s)", self.name,
                                type(exc).__name__, exc)
            if self.evicted != evicted:
                return

    def _admit(self, sock: socket.socket, peer: Any) -> None:
        """Serve `sock` unless the cap, its client's share or its client's failures say no."""
        client = client_key(str(peer[0])) if isinstance(peer, tuple) else ""
        if len(self._open) >= self.limits.max_connections or (
                self.limits.close_failing_clients and not self._errors[client].ready()):
            self.refused += 1
            sock.close()
            return
        if self._held[client] >= self.limits.per_client:
            # its own young idle ones newest first: a burst from the address takes its own
            # places, not that of a client of the same address whose request is on its way
            victim = self._victim((c for c in self._open if c.client == client), newest=True)
            if victim is None:
                self.refused += 1
                sock.close()
                return
            self._evict(victim)
        if self._waiting >= self.limits.max_connections - self.limits.reserved:
            victim = self._victim(c for c in self._open if c.state == WAITING)
            if victim is not None:
                self._evict(victim)
        sock.setblocking(False)
        conn = _Connection(sock, client)
        conn.arrived -= _waited_unaccepted(sock)
        if self.deferred and not _readable(conn):
            # held by the kernel until its deferral ran out (or past a full backlog): idle
            # already, not a client whose request is on its way
            conn.idle_from -= IDLE_GRACE_SECONDS
        self._open[conn] = None
        self._hold(client, 1)
        self._waiting += 1
        conn.timer = self._loop.call_at(self._loop.time() + self.limits.head_seconds,
                                        self._expire, conn)
        conn.task = self._loop.create_task(self._serve(conn))

    def _victim(self, candidates: Iterable[_Connection],
                newest: bool = False) -> _Connection | None:
        """The connection whose closing costs least (the module docstring): draining, idle
        waiting, started waiting, young idle (`newest`: the newest of them first), answering
        without credentials; never at the app or answering an authenticated request. None when
        no candidate may be closed."""
        pool = [c for c in candidates
                if c.state != AT_APP and not (c.state == ANSWERING and c.trusted)]
        draining = [c for c in pool if c.state == DRAINING]
        if draining:
            return self._pick(draining)
        waiting = [c for c in pool if c.state == WAITING]
        # an idle connection younger than IDLE_GRACE_SECONDS may be a client whose request is
        # on its way (accepted before its first write): it goes after the started ones
        young = time.monotonic() - IDLE_GRACE_SECONDS
        idle = [c for c in waiting if not c.started]
        for group, order in (([c for c in idle if c.idle_from <= young], False),
                             ([c for c in waiting if c.started], False),
                             ([c for c in idle if c.idle_from > young], newest)):
            while group:
                victim = self._pick(group, order)
                if victim.started or not _readable(victim):
                    return victim
                victim.started = True  # its request is in the kernel's buffer, not read yet
                group.remove(victim)
        return self._pick(pool) if pool else None

    def _pick(self, pool: list[_Connection], newest: bool = False) -> _Connection:
        """A connection of the client holding the most of `pool`; among such clients, the one
        with the fewest failure tokens left; then the oldest (`newest`: the newest)."""
        held = Counter(c.client for c in pool)
        most = max(held.values())
        heavy = {client for client, count in held.items() if count == most}
        if len(heavy) > 1:
            levels = {client: self._errors[client].level() for client in heavy}
            lowest = min(levels.values())
            heavy = {client for client, level in levels.items() if level == lowest}
        return next(c for c in (reversed(pool) if newest else pool) if c.client in heavy)

    def _evict(self, conn: _Connection) -> None:
        self.evicted += 1
        self._close(conn)
        if conn.task is not None:
            conn.task.cancel()

    def _expire(self, conn: _Connection) -> None:
        self.timed_out += 1
        self._close(conn)
        if conn.task is not None:
            conn.task.cancel()

    def _set_state(self, conn: _Connection, state: str, seconds: float | None) -> None:
        """Move `conn` to `state`, with a deadline `seconds` from now (None: no deadline)."""
        if conn.closed:
            raise _Closed
        self._waiting += (state == WAITING) - (conn.state == WAITING)
        if (state == AT_APP) != (conn.state == AT_APP):
            self._hold(conn.client, -1 if state == AT_APP else 1)
        conn.state = state
        if conn.timer is not None:
            conn.timer.cancel()
        conn.timer = None if seconds is None else self._loop.call_at(
            self._loop.time() + seconds, self._expire, conn)

    def _hold(self, client: str, change: int) -> None:
        self._held[client] += change
        if not self._held[client]:
            del self._held[client]

    def _close(self, conn: _Connection) -> None:
        """Close `conn` now (in the loop): unregistered from the selector, then the socket
        closed, so the count of open connections is exact and its descriptor free at once."""
        if conn.closed:
            return
        conn.closed = True
        if conn.timer is not None:
            conn.timer.cancel()
        self._loop.remove_reader(conn.fd)
        self._loop.remove_writer(conn.fd)
        conn.sock.close()
        del self._open[conn]
        if conn.state != AT_APP:
            self._hold(conn.client, -1)
        if conn.state == WAITING:
            self._waiting -= 1
        if not conn.answered_ok:
            self._errors[conn.client].spend()

    # ------------------------------------------------------------------ one connection
    async def _serve(self, conn: _Connection) -> None:
        assert self._workers is not None
        limits = self.limits
        try:
            if self.tls is not None:
                await self._handshake(conn, self.tls)
                if self.accept_peer is not None and not self.accept_peer(_peercert(conn)):
                    return
            request = await self._read_head(conn)
            if request is None:
                return  # closed without a request (e.g. a port check)
            if isinstance(request, dict) and _is_liveness(request):
                response, head_only = _ALIVE, request["REQUEST_METHOD"] == "HEAD"
                trusted = False  # a 2xx: answered_ok, never a failure
            elif isinstance(request, dict):
                if 0 < conn.body_left <= limits.read_body_bytes:
                    request["wsgi.input"] = io.BytesIO(await self._read_whole_body(conn))
                self._set_state(conn, AT_APP, None)
                response = await self._workers.submit(self._loop,
                                                      lambda: self._call_app(request))
                head_only = request["REQUEST_METHOD"] == "HEAD"
                trusted = bool(request.get(AUTHENTICATED))
            else:
                response, head_only, trusted = _plain(request), False, False
            conn.trusted = trusted
            self._set_state(conn, ANSWERING, limits.request_timeout)
            answer_deadline = self._loop.time() + limits.request_timeout
            await self._send(conn, self._encode(response, head_only))
            if isinstance(request, dict):
                self._tell_sent(request, conn)
            conn.answered_ok = response[0][:1] in "23" or trusted
            await self._drain(conn, answer_deadline)
            if isinstance(conn.sock, ssl.SSLSocket):
                with contextlib.suppress(OSError, ValueError):  # close_notify, best effort
                    conn.sock.unwrap()
        except (OSError, EOFError, _Closed, asyncio.CancelledError):
            pass  # client gone, too slow, evicted, or the server stopping: drop the connection
        except Exception as exc:  # noqa: BLE001 - one bad connection must not matter
            self.on_error("server")
            self._warn_once("serve", "mfotel: %s dropped a connection (%s: %s)", self.name,
                            type(exc).__name__, exc)
        finally:
            self._close(conn)

    async def _wait(self, conn: _Connection, writable: bool) -> None:
        """Until `conn` is readable (writable); _Closed if it is closed meanwhile."""
        if conn.closed:
            raise _Closed
        future: asyncio.Future[None] = self._loop.create_future()
        if writable:
            self._loop.add_writer(conn.fd, _wake, future)
        else:
            self._loop.add_reader(conn.fd, _wake, future)
        try:
            await future
        finally:
            if not conn.closed:  # else its descriptor may already serve another connection
                if writable:
                    self._loop.remove_writer(conn.fd)
                else:
                    self._loop.remove_reader(conn.fd)
        if conn.closed:
            raise _Closed

    async def _handshake(self, conn: _Connection, context: ssl.SSLContext) -> None:
        tls = context.wrap_socket(conn.sock, server_side=True, do_handshake_on_connect=False)
        conn.sock = tls  # the same descriptor
        while True:
            try:
                tls.do_handshake()
                return
            except ssl.SSLWantReadError:
                await self._wait(conn, writable=False)
                conn.started = True
            except ssl.SSLWantWriteError:
                await self._wait(conn, writable=True)

    async def _recv(self, conn: _Connection, size: int) -> bytes:
        while True:
            try:
                data = conn.sock.recv(size)
                conn.started = True
                return data
            except (BlockingIOError, InterruptedError, ssl.SSLWantReadError):
                await self._wait(conn, writable=False)
            except ssl.SSLWantWriteError:
                await self._wait(conn, writable=True)

    async def _send(self, conn: _Connection, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[conn.sock.send(view[:1 << 18]):]
            except (BlockingIOError, InterruptedError, ssl.SSLWantWriteError):
                await self._wait(conn, writable=True)
            except ssl.SSLWantReadError:
                await self._wait(conn, writable=False)

    async def _read_head(self, conn: _Connection) -> Environ | str | None:
        """The WSGI environ of the request, the status line of why it is refused, or None
        when the client closed without sending anything."""
        head = bytearray()
        while (end := head.find(b"\r\n\r\n")) < 0:
            if len(head) > self.limits.max_head_bytes:
                return "431 Request Header Fields Too Large"
            data = await self._recv(conn, 1 << 16)
            if not data:
                return "400 Bad Request" if head else None
            head += data
        if end + 4 > self.limits.max_head_bytes:
            return "431 Request Header Fields Too Large"
        conn.buffer = bytes(head[end + 4:])
        return self._environ(bytes(head[:end + 4]), conn)

    def _environ(self, head: bytes, conn: _Connection) -> Environ | str:
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
        peer = conn.sock.getpeername() if not conn.closed else ("", 0)
        environ: Environ = {
            "REQUEST_METHOD": method, "SCRIPT_NAME": "",
            "PATH_INFO": unquote(path, encoding="latin-1"), "QUERY_STRING": query,
            "SERVER_NAME": self.host, "SERVER_PORT": str(self.port), "SERVER_PROTOCOL": version,
            "REMOTE_ADDR": str(peer[0]) if isinstance(peer, tuple) else "",
            "wsgi.version": (1, 0), "wsgi.url_scheme": self.scheme,
            "wsgi.errors": sys.stderr, "wsgi.multithread": True, "wsgi.multiprocess": False,
            "wsgi.run_once": False, "mfotel.peercert": _peercert(conn),
        }
        for name, value in headers.items():
            key = name.upper().replace("-", "_")
            key = key if key in ("CONTENT_TYPE", "CONTENT_LENGTH") else f"HTTP_{key}"
            environ[key] = f"{environ[key]},{value}" if key in environ else value
        if environ.get("HTTP_TRANSFER_ENCODING"):
            conn.body_left = -1
        else:
            try:
                conn.body_left = max(0, int(environ.get("CONTENT_LENGTH") or 0))
            except ValueError:
                conn.body_left = 0
        conn.expect_continue = environ.get("HTTP_EXPECT", "").lower() == "100-continue"
        deadline = conn.accepted + self.limits.request_timeout
        environ["wsgi.input"] = io.BufferedReader(_Body(self, conn, deadline))
        return environ

    async def _read_whole_body(self, conn: _Connection) -> bytes:
        """The declared body, read in the loop before the app (`read_body_bytes`); the
        connection stays waiting, with a deadline for its length (the module docstring)."""
        limits = self.limits
        allowed = min(limits.request_timeout,
                      limits.head_seconds + conn.body_left / limits.min_body_rate)
        self._set_state(conn, WAITING, conn.accepted + allowed - time.monotonic())
        chunks = []
        while conn.body_left > 0:
            data = await self._read_body(conn, min(1 << 16, conn.body_left))
            if not data:
                break  # the client closed: the app sees a short body
            chunks.append(data)
        return b"".join(chunks)

    async def _read_body(self, conn: _Connection, size: int) -> bytes:
        """Up to `size` bytes of the body (for `_Body`, in the loop)."""
        if conn.expect_continue:  # the client waits for this before it sends the body
            conn.expect_continue = False
            await self._send(conn, b"HTTP/1.1 100 Continue\r\n\r\n")
        if conn.buffer:
            data, conn.buffer = conn.buffer[:size], conn.buffer[size:]
        else:
            data = await self._recv(conn, size)
        conn.body_left = conn.body_left - len(data) if data else 0
        return data

    async def _drain(self, conn: _Connection, deadline: float) -> None:
        """Read and drop what is left of the request body (at most `drain_bytes`, before the
        loop time `deadline`, at most `drain_idle` s between two reads), so that closing does
        not reset a client still sending (it would lose the answer). The connection is
        DRAINING meanwhile: the first one closed when a place is needed."""
        budget, left, tail = self.limits.drain_bytes, conn.body_left, b""
        if left == 0 or conn.expect_continue:  # nothing sent, or not sent until told to
            return
        data, conn.buffer = conn.buffer, b""
        while True:
            remaining = deadline - self._loop.time()
            if remaining <= 0:
                return
            self._set_state(conn, DRAINING, min(self.limits.drain_idle, remaining))
            budget -= len(data)
            if left > 0:
                left -= len(data)
                if left <= 0:
                    return
            else:  # chunked (left < 0): up to the last chunk
                tail = (tail + data)[-5:]
                if tail == b"0\r\n\r\n":
                    return
            if budget <= 0:
                return
            data = await self._recv(conn, min(1 << 16, budget, left if left > 0 else budget))
            if not data:
                return

    # ------------------------------------------------------------------ the app
    def _call_app(self, environ: Environ) -> Response:
        """Run the WSGI app (in a worker thread); an app that raises is a 500, counted."""
        started: list[Any] = []
        written: list[bytes] = []

        def start_response(status: str, headers: Headers, exc_info: Any = None
                           ) -> Callable[[bytes], None]:
            started[:] = [status, list(headers)]
            return written.append

        try:
            chunks = self.app(environ, start_response)
            try:
                body = b"".join([*written, *chunks])
            finally:
                getattr(chunks, "close", lambda: None)()
            return started[0], started[1], body
        except Exception as exc:  # noqa: BLE001 - a request must never take the process down
            self.on_error("scrape")
            self._warn_once("app", "mfotel: serving %s failed (%s: %s); answered 500, counted in "
                            "mfotel_export_errors_total{stage=\"scrape\"}",
                            environ.get("PATH_INFO"), type(exc).__name__, exc)
            return _plain("500 Internal Server Error")

    def _tell_sent(self, environ: Environ, conn: _Connection) -> None:
        """The app's SENT callback, if it set one: how long the answer took since its request
        came (waiting to be accepted included)."""
        sent = environ.get(SENT)
        if callable(sent):
            try:
                sent(time.monotonic() - conn.arrived)
            except Exception as exc:  # noqa: BLE001 - an app's callback must not drop answers
                self.on_error("server")
                self._warn_once("sent", "mfotel: %s: %s after an answer (%s)", self.name,
                                type(exc).__name__, exc)

    def _encode(self, response: Response, head_only: bool) -> bytes:
        status, headers, body = response
        names = {name.lower() for name, _ in headers}
        headers = [(n, v) for n, v in headers if n.lower() != "connection"]
        if "content-length" not in names:
            headers.append(("Content-Length", str(len(body))))
        headers += [(n, v) for n, v in self.headers if n.lower() not in names]
        lines = [f"HTTP/1.1 {status}", *(f"{n}: {v}" for n, v in headers), "Connection: close"]
        return "\r\n".join(lines).encode("latin-1") + b"\r\n\r\n" + (b"" if head_only else body)

    def _warn_once(self, what: str, message: str, *args: Any) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning(message, *args)

