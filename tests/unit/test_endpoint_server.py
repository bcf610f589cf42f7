"""The endpoint server's rules over real sockets: whose connection makes room, the per-client
share, the room kept for requests, the header deadline, request bodies and what is drained.

/metrics-level behaviour (the flood, slowloris, TLS) is in test_endpoint_limits.py; here a
plain WSGI app runs on `mfotel.endpoint.server.Server` directly.
"""
from __future__ import annotations

import http.client
import socket
import threading
import time

import pytest

from mfotel.endpoint.server import IDLE_GRACE_SECONDS, LIVENESS_PATH, Limits, Server
from mfotel.endpoint.wsgi import AUTHENTICATED
from tests.support.http import request
from tests.support.idle_flood import closed_by_peer
from tests.support.waiting import settle, wait_for


def echo(environ, start_response):
    """Answers with the request body it reads (POST), or "ok"; /ignore reads nothing."""
    body = b"ok"
    if environ["REQUEST_METHOD"] == "POST" and environ["PATH_INFO"] != "/ignore":
        body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
    start_response("200 OK", [("Content-Type", "application/octet-stream")])
    return [body]


@pytest.fixture
def server():
    """A factory of started servers, closed after the test."""
    started: list[Server] = []

    def start(app=echo, **limits) -> Server:
        started.append(Server(app, "127.0.0.1", 0, limits=Limits(**limits)).start())
        return started[-1]
    yield start
    for each in started:
        each.close()


def idle(port: int, source: str, count: int = 1) -> list[socket.socket]:
    """Connections from `source` that never send a byte (each connected before the next)."""
    sockets = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10,
                                        source_address=(source, 0))
        sock.setblocking(False)  # closed_by_peer must not wait
        sockets.append(sock)
        time.sleep(0.02)  # admitted in this order
    return sockets


def opened(server: Server, count: int) -> bool:
    return bool(wait_for(lambda: server.open_connections == count, settle(10), 0.05))


def test_a_flood_closes_its_own_connections_not_a_lone_client(server):
    srv = server(max_connections=6, request_timeout=60)
    lone = idle(srv.port, "127.0.0.3")                  # e.g. a scraper between two requests
    flood = idle(srv.port, "127.0.0.2", 5)
    more = idle(srv.port, "127.0.0.4", 3)               # three more clients arrive
    try:
        assert opened(srv, 6)
        # the victims are the oldest connections of the client holding the most
        wait_for(lambda: all(closed_by_peer(s) for s in flood[:3]), settle(10), 0.05)
        assert not any(closed_by_peer(s) for s in [*lone, *flood[3:], *more])
        assert srv.evicted == 3
    finally:
        for sock in [*lone, *flood, *more]:
            sock.close()


def test_one_client_holds_at_most_its_share(server):
    srv = server(max_connections=10, max_connections_per_client=3, request_timeout=60)
    mine = idle(srv.port, "127.0.0.2", 5)
    other = idle(srv.port, "127.0.0.3", 2)
    try:
        assert opened(srv, 5)
        # young idle ones of the client's own share make room newest first: the 3rd, the 4th
        wait_for(lambda: all(closed_by_peer(s) for s in mine[2:4]), settle(10), 0.05)
        assert not any(closed_by_peer(s) for s in [*mine[:2], mine[4], *other])
    finally:
        for sock in [*mine, *other]:
            sock.close()


def test_waiting_connections_leave_the_reserved_places_free(server):
    gate = threading.Event()

    def slow(environ, start_response):
        gate.wait(10)
        return echo(environ, start_response)

    srv = server(slow, max_connections=4, reserved=1, request_timeout=60)
    waiting = [s for i in range(4) for s in idle(srv.port, f"127.0.0.{10 + i}")]
    busy = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    late: list[socket.socket] = []
    try:
        # waiting connections (no request head yet) hold at most 4 - 1 places
        assert opened(srv, 3) and wait_for(lambda: closed_by_peer(waiting[0]), settle(10), 0.05)
        busy.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # a request: at the app
        late = [s for i in range(3) for s in idle(srv.port, f"127.0.0.{20 + i}")]
        assert opened(srv, 4)  # 3 waiting + the request
        assert wait_for(lambda: all(closed_by_peer(s) for s in waiting), settle(10), 0.05)
        assert not any(closed_by_peer(s) for s in late)
        gate.set()  # the request was never closed for a newcomer: it is answered
        assert busy.recv(1 << 16).startswith(b"HTTP/1.1 200 OK")
    finally:
        gate.set()
        for sock in [*waiting, *late, busy]:
            sock.close()


def test_at_the_cap_with_every_place_at_the_app_a_newcomer_is_closed_at_once(server):
    gate = threading.Event()

    def slow(environ, start_response):
        gate.wait(10)
        return echo(environ, start_response)

    srv = server(slow, max_connections=2, workers=2)
    busy = [socket.create_connection(("127.0.0.1", srv.port), timeout=10) for _ in range(2)]
    try:
        for sock in busy:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert opened(srv, 2) and wait_for(lambda: srv._workers is not None, settle(5), 0.05)
        time.sleep(0.2)  # both requests are at the app
        newcomer = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        wait_for(lambda: closed_by_peer(newcomer), settle(10), 0.05)
        assert srv.refused == 1 and srv.open_connections == 2
        gate.set()
        assert all(s.recv(1 << 16).startswith(b"HTTP/1.1 200 OK") for s in busy)
    finally:
        gate.set()
        for sock in busy:
            sock.close()


def test_the_header_deadline_is_shorter_than_the_request_deadline(server):
    srv = server(header_timeout=0.5, request_timeout=30)
    silent = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    slow_body = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    try:
        slow_body.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\nab")
        started = time.monotonic()
        wait_for(lambda: closed_by_peer(silent), settle(10), 0.05)
        assert time.monotonic() - started < 5 and srv.timed_out == 1
        time.sleep(1.0)  # past the header deadline: a body may take the request deadline
        slow_body.sendall(b"cd")
        assert slow_body.recv(1 << 16).endswith(b"\r\n\r\nabcd")
    finally:
        silent.close()
        slow_body.close()


def test_a_body_is_read_by_the_app_and_expect_100_continue_is_honoured(server):
    srv = server()
    body = bytes(range(256)) * 4096  # 1 MiB
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
    conn.request("POST", "/", body)
    reply = conn.getresponse()
    assert reply.status == 200 and reply.read() == body
    conn.close()
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
                     b"Expect: 100-continue\r\n\r\n")
        assert sock.recv(1024) == b"HTTP/1.1 100 Continue\r\n\r\n"  # before the body is sent
        sock.sendall(b"hello")
        assert sock.recv(1 << 16).endswith(b"\r\n\r\nhello")


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_the_app_ignores_is_drained_so_the_client_reads_the_answer(server, chunked):
    srv = server(drain_bytes=8 << 20)
    body = b"x" * (4 << 20)
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
    if chunked:
        conn.request("POST", "/ignore", iter([body[:1 << 20]] * 4), encode_chunked=True)
    else:
        conn.request("POST", "/ignore", body)
    reply = conn.getresponse()  # a reset would raise here
    assert reply.status == 200 and reply.read() == b"ok"
    conn.close()


def test_a_body_beyond_the_drain_budget_is_cut_off(server):
    srv = server(drain_bytes=1 << 20)
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
    with pytest.raises(ConnectionError):  # the server read 1 MiB of 64, then closed
        conn.request("POST", "/ignore", b"x" * (64 << 20))
        conn.getresponse().read()
    conn.close()
    assert wait_for(lambda: srv.open_connections == 0, settle(10), 0.05)


def test_the_liveness_path_is_answered_by_the_server_and_never_counted_as_a_failure(server):
    """The node agent probes every rank once a second at most. Answered 404 (or 401) by the
    app, each probe spent one of its address's failures, as fast as they refill: once a stall
    had spent the rest, that address (a Prometheus on the same node) was refused for minutes
    (seen: rank 1 down in Prometheus for 3 minutes after holding the GIL 60 s). The server
    answers the liveness path itself: no app call, no credentials, no failure."""
    calls: list[str] = []

    def refuses(environ, start_response):  # an app behind authentication, for this client
        calls.append(environ["PATH_INFO"])
        start_response("401 Unauthorized", [("Content-Type", "text/plain")])
        return [b"no"]
    srv = server(refuses, client_error_burst=2, client_errors_per_second=0.001)

    def call(method: str, path: str) -> tuple[int, bytes]:
        reply = request(f"http://127.0.0.1:{srv.port}{path}", method)
        return reply.status, reply.body
    for _ in range(10):
        assert call("HEAD", LIVENESS_PATH) == (200, b"")
    assert call("GET", LIVENESS_PATH) == (200, b"alive\n")
    assert calls == []
    # the budget still holds for the app's failures: two 401s, then closed at accept
    assert [call("GET", "/metrics")[0] for _ in range(2)] == [401, 401]
    with pytest.raises(OSError):  # closed at accept
        call("GET", "/metrics")
    assert calls == ["/metrics", "/metrics"] and srv.refused >= 1


def declared(path: str = LIVENESS_PATH, method: str = "GET", length: int = 4_000_000) -> bytes:
    """A request head declaring a body that is never sent."""
    return f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\n".encode()


def read_to_close(sock: socket.socket, timeout: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes, and how long that took."""
    sock.settimeout(timeout)
    started, received = time.monotonic(), bytearray()
    while chunk := sock.recv(1 << 16):
        received += chunk
    return bytes(received), time.monotonic() - started


@pytest.mark.parametrize("head", [declared(), declared("/ignore", "POST")],
                         ids=["liveness", "an answer that ignores the body"])
def test_a_declared_body_that_never_comes_is_not_waited_for(server, head):
    """Answered at once, the connection was then kept for the body until the request deadline
    (10 s by default; 30 s here): a reconnecting client without credentials held every place.
    The body is drained only while it keeps coming (drain_idle, 1 s, between its bytes)."""
    srv = server(request_timeout=30)
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
        sock.sendall(head)
        answer, took = read_to_close(sock, timeout=20)
    assert answer.startswith(b"HTTP/1.1 200 OK") and answer.endswith((b"alive\n", b"ok"))
    assert took < 1.0 + 2.0, f"closed {took:.1f} s after the request"


def test_a_draining_connection_makes_room_before_a_waiting_one(server):
    """At the cap, a connection whose answer is out (draining a body that does not come) is
    closed for a newcomer, not a client that has not sent its request yet."""
    srv = server(max_connections=2, request_timeout=60, drain_idle=60)
    draining = socket.create_connection(("127.0.0.1", srv.port), timeout=10,
                                        source_address=("127.0.0.2", 0))
    draining.sendall(declared())
    assert draining.recv(1 << 16).startswith(b"HTTP/1.1 200 OK")   # answered, holding on
    draining.setblocking(False)
    waiting = idle(srv.port, "127.0.0.3")
    newcomer = idle(srv.port, "127.0.0.4")
    try:
        wait_for(lambda: closed_by_peer(draining), settle(10), 0.05, "the draining one closed")
        assert not any(closed_by_peer(s) for s in [*waiting, *newcomer])
        assert srv.evicted == 1 and srv.open_connections == 2
    finally:
        for sock in [draining, *waiting, *newcomer]:
            sock.close()


def test_idle_connections_of_an_address_make_room_before_its_started_request(server):
    """Alertmanager on the host of a client holding idle sockets shares its address: at the
    address's share, an idle connection is closed for a newcomer, not the older one whose
    request is under way."""
    srv = server(max_connections=10, max_connections_per_client=2, request_timeout=60)
    started = socket.create_connection(("127.0.0.1", srv.port), timeout=10,
                                       source_address=("127.0.0.2", 0))
    started.sendall(b"POST / HTTP/1.1\r\nHost: x\r\n")  # the first part of its head
    time.sleep(0.05)
    sockets = idle(srv.port, "127.0.0.2", 1)
    time.sleep(IDLE_GRACE_SECONDS + 0.1)  # idle, not a request on its way
    sockets += idle(srv.port, "127.0.0.2", 1)  # closes one of the address's two
    try:
        wait_for(lambda: closed_by_peer(sockets[0]), settle(10), 0.05, "the idle one closed")
        started.sendall(b"Content-Length: 2\r\n\r\nhi")
        answer, _ = read_to_close(started, timeout=10)
        assert answer.startswith(b"HTTP/1.1 200 OK") and answer.endswith(b"\r\n\r\nhi")
        assert not closed_by_peer(sockets[1]) and srv.evicted == 1
    finally:
        for sock in [started, *sockets]:
            sock.close()


def test_a_flood_of_new_idle_connections_takes_its_own_places_not_the_oldest(server):
    """Idle connections younger than IDLE_GRACE_SECONDS make room newest first: a client that
    connected before a burst of idle sockets of its address (Alertmanager on the attacker's
    host) keeps its place until it sends its request."""
    srv = server(max_connections=10, max_connections_per_client=2, request_timeout=60)
    first = socket.create_connection(("127.0.0.1", srv.port), timeout=10,
                                     source_address=("127.0.0.2", 0))
    time.sleep(0.05)
    burst = idle(srv.port, "127.0.0.2", 5)   # each one over the share closes the newest
    try:
        wait_for(lambda: srv.evicted == 4, settle(10), 0.05, "four places taken back")
        first.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi")
        answer, _ = read_to_close(first, timeout=10)
        assert answer.startswith(b"HTTP/1.1 200 OK") and answer.endswith(b"\r\n\r\nhi")
    finally:
        for sock in [first, *burst]:
            sock.close()


def test_a_connection_just_accepted_makes_room_after_started_ones(server):
    """A client's connect completes before its first write: a connection idle for less than
    IDLE_GRACE_SECONDS may be Alertmanager's request on its way, and an attacker's partial
    heads of the same address are closed before it."""
    srv = server(max_connections=10, max_connections_per_client=2, request_timeout=60)
    started = socket.create_connection(("127.0.0.1", srv.port), timeout=10,
                                       source_address=("127.0.0.2", 0))
    started.sendall(b"POST / HTTP/1.1\r\nHost: x\r\n")  # an attacker's partial head
    time.sleep(0.05)
    young = socket.create_connection(("127.0.0.1", srv.port), timeout=10,
                                     source_address=("127.0.0.2", 0))
    newcomer = idle(srv.port, "127.0.0.2", 1)  # the address's share is full: one goes
    try:
        wait_for(lambda: closed_by_peer(started), settle(10), 0.05, "the started one closed")
        young.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi")
        answer, _ = read_to_close(young, timeout=10)
        assert answer.startswith(b"HTTP/1.1 200 OK") and answer.endswith(b"\r\n\r\nhi")
        assert srv.evicted == 1
    finally:
        for sock in [started, young, *newcomer]:
            sock.close()


def test_connections_at_the_app_do_not_count_against_their_clients_share(server):
    """A request at the app is answered in a moment; counted in its address's share, requests
    cycled through the app (a 401 costs nothing) refused every newcomer of that address."""
    gate, called = threading.Event(), threading.Event()

    def slow(environ, start_response):
        called.set()
        gate.wait(10)
        return echo(environ, start_response)

    srv = server(slow, max_connections=4, max_connections_per_client=1, request_timeout=60)
    busy = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    busy.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert called.wait(10)  # the request is at the app
    newcomer = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    try:
        assert opened(srv, 2)
        newcomer.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        gate.set()
        assert all(read_to_close(s, 10)[0].startswith(b"HTTP/1.1 200 OK")
                   for s in (busy, newcomer))
        assert srv.refused == 0 and srv.evicted == 0
    finally:
        gate.set()
        busy.close()
        newcomer.close()


def test_an_answer_to_an_authenticated_request_is_never_closed_for_a_newcomer(server):
    """A verified scraper slow to take a large answer keeps its place; the newcomer is closed."""
    body = b"m" * (32 << 20)  # more than the socket buffers hold

    def authenticated(environ, start_response):
        environ[AUTHENTICATED] = True
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [body]

    srv = server(authenticated, max_connections=1, request_timeout=60)
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as scraper:
        scraper.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        scraper.recv(1024)   # its answer is under way, mostly unsent
        newcomer = socket.create_connection(("127.0.0.1", srv.port), timeout=10,
                                            source_address=("127.0.0.2", 0))
        newcomer.setblocking(False)
        try:
            wait_for(lambda: closed_by_peer(newcomer), settle(10), 0.05, "the newcomer closed")
            received, _ = read_to_close(scraper, timeout=30)
        finally:
            newcomer.close()
    assert len(received) + 1024 >= len(body) and received.endswith(b"m" * 1024)
    assert srv.evicted == 0 and srv.refused == 1


def test_a_body_read_before_the_app_holds_no_worker_and_is_cut_at_its_deadline(server):
    """read_body_bytes: the server reads the body before calling the app, the connection
    still waiting; a body declared and not sent is cut at header_timeout + length /
    min_body_rate, and the app's one worker serves the others meanwhile."""
    srv = server(workers=1, read_body_bytes=1 << 20, header_timeout=1, request_timeout=30,
                 min_body_rate=1 << 20)
    stalled = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    stalled.sendall(declared("/", "POST", length=1 << 20))   # 1 s + 1 MiB at 1 MiB/s: 2 s
    try:
        reply = request(f"http://127.0.0.1:{srv.port}/", "POST", b"hello")
        assert (reply.status, reply.body) == (200, b"hello")
        answer, took = read_to_close(stalled, timeout=20)
        assert answer == b"" and took < 2 + 2, f"cut {took:.1f} s after the request"
        assert srv.timed_out == 1
    finally:
        stalled.close()


def test_the_kernel_holds_idle_connections_and_hands_over_requests_at_once(server):
    """With the deferral (the receiver's), an idle socket takes no place until it ran out;
    a client's request is accepted as it comes, its bytes already in the buffer; an idle one
    handed over later counts as idle beyond IDLE_GRACE_SECONDS (the first to make room)."""
    srv = server(max_connections=10, max_connections_per_client=2, request_timeout=60,
                 defer_accept=2)
    assert srv.deferred
    sleepers = idle(srv.port, "127.0.0.2", 2)
    try:
        time.sleep(1.0)
        assert srv.open_connections == 0   # held by the kernel, not by the server
        answer = request(f"http://127.0.0.1:{srv.port}/", "POST", b"hi", source="127.0.0.2")
        assert answer.status == 200 and answer.body == b"hi"
        assert srv.evicted == 0
        assert opened(srv, 2)   # the deferral ran out: handed over without a byte
        late = idle(srv.port, "127.0.0.2", 1)[0]   # the share is full: an old idle one goes
        wait_for(lambda: srv.evicted == 1, settle(10), 0.05, "one idle place taken back")
        # counted as it is closed: its end reaches the client a moment later (under load)
        wait_for(lambda: any(closed_by_peer(s) for s in sleepers), settle(5), 0.05,
                 "the old idle one's end at the client")
        assert sum(closed_by_peer(s) for s in sleepers) == 1 and srv.evicted == 1
        late.close()
    finally:
        for sock in sleepers:
            sock.close()
