"""Availability of /metrics against its network clients: idle, slow and flooding connections.

Real sockets against the real server; the flood test trains a real MindSpore network in a
subprocess limited to 1024 file descriptors.
"""
from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import samples, value
from endpoint_support import (closed_by_peer, idle_connections, make_pki, open_fds,
                              proc_status, request, serve, wait_until)
from mfotel.demo.stack import free_port
from mfotel.ratelimit import client_key

ROOT = Path(__file__).resolve().parent.parent
SCRAPER = "127.0.0.2"  # the legitimate scraper's address; attackers connect from 127.0.0.1


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


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
        assert wait_until(lambda: closed_by_peer(stalled), timeout=10)
    finally:
        stalled.close()


def test_slowloris_request_head_is_cut_at_the_request_timeout(endpoint, port):
    endpoint(request_timeout_seconds=1)
    slow = socket.create_connection(("127.0.0.1", port))
    slow.settimeout(5)
    try:
        slow.sendall(b"GET /metrics HTTP/1.1\r\n")
        started, closed = time.monotonic(), False
        while time.monotonic() - started < 8 and not closed:  # one header byte every 0.2 s
            try:
                slow.sendall(b"X")
            except OSError:
                closed = True
            closed = closed or closed_by_peer(slow)
            time.sleep(0.2)
        assert closed, "the server kept a dribbling client for 8 s"
        assert time.monotonic() - started < 5
    finally:
        slow.close()


def test_oversized_request_head_gets_431(endpoint, port):
    endpoint()
    reply = request(port, **{"X-Padding": "a" * 20000})
    assert reply.status == 431


def test_connection_cap_closes_the_oldest_idle_connections_first(endpoint, port):
    endpoint(max_connections=8, request_timeout_seconds=60)
    first = idle_connections(port, 12)
    assert wait_until(lambda: all(closed_by_peer(s) for s in first[:4]), timeout=10)
    last = idle_connections(port, 8)
    try:
        # the 8 newest connections take the 8 places; every older one was closed, oldest first
        assert wait_until(lambda: all(closed_by_peer(s) for s in first), timeout=10)
        assert not any(closed_by_peer(s) for s in last)
        reply = request(port, source=SCRAPER, timeout=5)  # gets in, in place of the oldest idle
        assert reply.status == 200
        assert wait_until(lambda: closed_by_peer(last[0]), timeout=10)
        assert not any(closed_by_peer(s) for s in last[1:])
    finally:
        for sock in [*first, *last]:
            sock.close()


def test_client_whose_connections_fail_is_closed_at_accept_others_are_served(endpoint, port):
    endpoint()  # 20 failed connections, then one per second
    statuses = [request(port, path="/nowhere", source="127.0.0.3").status for _ in range(25)]
    assert statuses[:20] == [404] * 20 and statuses[-1] == 0  # closed before any parsing
    assert request(port, source=SCRAPER).status == 200
    assert wait_until(lambda: request(port, source="127.0.0.3").status == 200, timeout=10)


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


TRAINER = """
import sys
from pathlib import Path
from mindspore.train import Callback
from mfotel.demo.training import run_demo

port, folder = int(sys.argv[1]), Path(sys.argv[2])

class Work(Callback):
    '''Opens files every step, as data loading and checkpointing do; stops when told.'''
    def on_train_step_end(self, run_context):
        step = run_context.original_args().cur_step_num
        (folder / "progress").write_text(str(step))
        if (folder / "stop").exists():
            run_context.request_stop()

result = run_demo(steps=50000, port=port, extra_callbacks=(Work(),), lr_schedule="constant",
                  output={"console": False})
print("trained", len(result.losses), "steps", flush=True)
"""


def _limit_files() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))


@pytest.mark.slow
def test_training_survives_1000_idle_connections_with_1024_file_descriptors(tmp_path):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "GLOG_v": "3"}
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(port), str(tmp_path)],
                               cwd=tmp_path, env=env, preexec_fn=_limit_files,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    flood: list[socket.socket] = []
    progress = tmp_path / "progress"

    def step() -> int:
        try:
            return int(progress.read_text() or 0)
        except (OSError, ValueError):
            return 0
    try:
        assert wait_until(lambda: step() > 0 and request(port, timeout=2).status == 200, 180), \
            "the trainer did not start serving"
        threads, fds = proc_status(trainer.pid, "Threads"), open_fds(trainer.pid)
        flood = idle_connections(port, 1100)
        at_flood, seen = step(), {"threads": threads, "fds": fds}

        def trained_on() -> bool:  # and note the most threads and descriptors seen meanwhile
            seen["threads"] = max(seen["threads"], proc_status(trainer.pid, "Threads"))
            seen["fds"] = max(seen["fds"], open_fds(trainer.pid))
            return step() >= at_flood + 500
        assert wait_until(trained_on, 120), "training stalled under the flood"
        reply = request(port, source=SCRAPER, timeout=10)  # within Prometheus' default timeout
        assert reply.status == 200
        assert value(samples(reply.body.decode()), "mindformers_train_step") >= at_flood
        assert seen["threads"] <= threads + 5, seen  # not one per connection
        assert seen["fds"] <= fds + 100 + 5, seen   # max_connections (100) and a few
        (tmp_path / "stop").write_text("")
        output, _ = trainer.communicate(timeout=120)
        assert trainer.returncode == 0, output[-3000:]
        assert "trained" in output
    finally:
        for sock in flood:
            sock.close()
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait(30)



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

    from mfotel.metrics_server import MetricsServer

    body, served = os.urandom(32 * 2**20), threading.Event()

    def app(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/plain"),
                                  ("Content-Length", str(len(body)))])
        served.set()
        return [body]

    server = MetricsServer(app, "127.0.0.1", 0).start()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as client:
        client.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert served.wait(10)
        closing = threading.Thread(target=server.close)
        closing.start()
        time.sleep(0.2)  # close() is under way; most of the body is not sent yet
        with pytest.raises(ConnectionRefusedError):  # a new client is refused, not kept waiting
            socket.create_connection(("127.0.0.1", server.port), timeout=5).close()
        received = bytearray()
        while chunk := client.recv(1 << 20):
            received += chunk
        closing.join(10)
    head, _, got = bytes(received).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert len(got) == len(body) and got == body
