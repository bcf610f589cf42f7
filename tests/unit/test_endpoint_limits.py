"""Availability of /metrics against its network clients: idle, slow and flooding connections.

Real sockets against the real server. tests/e2e/test_endpoint_limits_e2e.py floods the endpoint
of a real MindSpore run.
"""
from __future__ import annotations

import os
import socket
import time

import pytest

from mfotel.endpoint.ratelimit import client_key
from tests.support.endpoint import (
    SCRAPER,
    accepted_sockets,
    proc_status,
    request,
    serve,
)
from tests.support.idle_flood import IdleFlood, closed_by_peer, idle_connections, loopback_sources
from tests.support.metrics import samples, value
from tests.support.waiting import settle, wait_for


@pytest.fixture
def tls_web_config(tmp_path, pki):
    path = tmp_path / "web.yml"
    path.write_text(f"tls_server_config:\n  cert_file: {pki.cert('server')}\n"
                    f"  key_file: {pki.key('server')}\n")
    return path


@pytest.fixture
def endpoint(port):
    """A factory of served Telemetry objects, shut down after the test."""
    started = []

    def start(**prometheus):
        telemetry, _ = serve(port, **prometheus)
        started.append(telemetry)
        return telemetry
    yield start
    for telemetry in started:
        telemetry.shutdown()


def test_idle_tcp_connection_does_not_block_tls_scrapes(endpoint, port, pki, tls_web_config):
    endpoint(web_config_file=str(tls_web_config))
    idle = idle_connections(port, 3)  # connected, never starting the TLS handshake
    half = socket.create_connection(("127.0.0.1", port))
    half.sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")  # the start of a ClientHello
    try:
        reply = request(port, context=pki.client_context(), timeout=5)
        assert reply.status == 200
        assert value(samples(reply.body.decode()), "mindformers_train_loss") == 1.25
    finally:
        for sock in [*idle, half]:
            sock.close()


def test_stalled_handshake_is_closed_after_the_request_timeout(endpoint, port, tls_web_config):
    endpoint(web_config_file=str(tls_web_config), request_timeout_seconds=1)
    stalled = socket.create_connection(("127.0.0.1", port))
    try:
        stalled.sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")
        assert not closed_by_peer(stalled)
        wait_for(lambda: closed_by_peer(stalled), settle(1), 0.05, "the stalled handshake closed")
    finally:
        stalled.close()


def test_slowloris_request_head_is_cut_at_the_request_timeout(endpoint, port):
    endpoint(request_timeout_seconds=1)
    slow = socket.create_connection(("127.0.0.1", port))
    slow.settimeout(5)
    try:
        slow.sendall(b"GET /metrics HTTP/1.1\r\n")

        def dribble_closed() -> bool:  # one header byte every 0.2 s until the server closes
            try:
                slow.sendall(b"X")
            except OSError:
                return True
            return closed_by_peer(slow)
        # a timeout per read would keep this client forever: only a deadline cuts it
        wait_for(dribble_closed, settle(1), 0.2, "the server to cut a dribbling client")
    finally:
        slow.close()


def test_oversized_request_head_gets_431(endpoint, port):
    endpoint()
    reply = request(port, **{"X-Padding": "a" * 20000})
    assert reply.status == 431


def test_connection_cap_closes_the_oldest_idle_connections_first(endpoint, port):
    endpoint(max_connections=8, request_timeout_seconds=60)
    first = idle_connections(port, 12)
    wait_for(lambda: all(closed_by_peer(s) for s in first[:4]), settle(), 0.05,
             "the 4 oldest connections closed")
    last = idle_connections(port, 8)
    try:
        # the 8 newest connections take the 8 places; every older one was closed, oldest first
        wait_for(lambda: all(closed_by_peer(s) for s in first), settle(), 0.05,
                 "every older connection closed")
        assert not any(closed_by_peer(s) for s in last)
        reply = request(port, source=SCRAPER, timeout=5)  # gets in, in place of the oldest idle
        assert reply.status == 200
        wait_for(lambda: closed_by_peer(last[0]), settle(), 0.05, "the oldest idle one closed")
        assert not any(closed_by_peer(s) for s in last[1:])
    finally:
        for sock in [*first, *last]:
            sock.close()


def test_connection_cap_is_exact_under_a_flood_from_many_addresses(endpoint, port):
    """max_connections counts the sockets the process has accepted: under a flood from 40
    addresses (8 idle connections each, re-opened as soon as closed) the server never holds
    more than the cap, counted by the kernel, and a scraper is still served."""
    cap = 50
    server = endpoint(max_connections=cap, request_timeout_seconds=60).endpoint.server
    peak, full_since = 0, None
    with IdleFlood(port, loopback_sources(40, first=10), per_source=8):
        deadline = time.monotonic() + 60  # under load the kernel hands over the flood slowly
        while time.monotonic() < deadline and (
                full_since is None or time.monotonic() - full_since < 3):
            peak = max(peak, accepted_sockets(port))
            if full_since is None and server.evicted:  # the cap was reached: 3 s more
                full_since = time.monotonic()
        assert request(port, source=SCRAPER, timeout=10).status == 200
    assert peak <= cap, f"{peak} sockets open against max_connections {cap}"
    assert full_since is not None, f"the flood never reached the cap (peak {peak})"
    wait_for(lambda: accepted_sockets(port) == 0, settle(10), 0.05, "the flood's sockets closed")


def test_client_whose_connections_fail_is_closed_at_accept_others_are_served(endpoint, port):
    endpoint()  # 20 failed connections, then one per second
    statuses = [request(port, path="/nowhere", source="127.0.0.3").status for _ in range(25)]
    assert statuses[:20] == [404] * 20 and statuses[-1] == 0  # closed before any parsing
    assert request(port, source=SCRAPER).status == 200
    wait_for(lambda: request(port, source="127.0.0.3").status == 200, settle(1), 0.05,
             "the failing client served again (one connection per second)")


def test_server_threads_stay_fixed_under_a_thousand_idle_connections(endpoint, port):
    endpoint(request_timeout_seconds=60)
    assert request(port).status == 200
    before = proc_status(os.getpid(), "Threads")
    flood = idle_connections(port, 1000)
    try:
        assert request(port, source=SCRAPER, timeout=10).status == 200
        assert proc_status(os.getpid(), "Threads") <= before  # on main: one more per connection
    finally:
        for sock in flood:
            sock.close()


@pytest.mark.parametrize("address,client", [
    ("192.0.2.7", "192.0.2.7"),
    ("2001:db8:1:2:aaaa::1", "2001:db8:1:2::/64"),  # a host owns its /64: one client
    ("2001:db8:1:2:bbbb::9", "2001:db8:1:2::/64"),
    ("::ffff:192.0.2.7", "192.0.2.7"),               # IPv4 on a dual-stack socket
    ("fe80::1%eth0", "fe80::/64"),
])
def test_client_key_groups_addresses_by_client(address, client):
    assert client_key(address) == client


def test_close_lets_the_answer_under_way_reach_its_client_whole():
    """The linger ends at the scrape that served the final status, and the endpoint closes
    right after: that answer must still arrive whole (a cut one is a failed scrape, and the
    rank would vanish with status running). Real server, a body larger than the socket
    buffers, a client that starts reading only after close() began."""
    import threading

    from mfotel.endpoint.server import Server

    body, served = os.urandom(32 * 2**20), threading.Event()

    def app(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/plain"),
                                  ("Content-Length", str(len(body)))])
        served.set()
        return [body]

    server = Server(app, "127.0.0.1", 0).start()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as client:
        client.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert served.wait(10)
        closing = threading.Thread(target=server.close)
        closing.start()

        def refused() -> bool:  # a new client is refused, not kept waiting
            try:
                socket.create_connection(("127.0.0.1", server.port), timeout=5).close()
            except ConnectionRefusedError:
                return True
            return False
        # while close() is under way: the client has read nothing, most of the body is unsent
        wait_for(refused, settle(10), 0.05, "close() refusing new clients")
        received = bytearray()
        while chunk := client.recv(1 << 20):
            received += chunk
        closing.join(10)
    head, _, got = bytes(received).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert len(got) == len(body) and got == body
