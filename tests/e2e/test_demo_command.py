"""`mfotel demo` says where its endpoint really is: the bound port, never a port another
program holds (and never scrapes that program), nothing when --port 0 turns it off."""
from __future__ import annotations

import http.server
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from mfotel.demo.command import port_in_use
from mfotel.localstack.servers import free_port_block

pytestmark = pytest.mark.slow


def demo(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, "-m", "mfotel", "demo", "--steps", "6",
                           "--step-interval", "2", "--step-sleep", "0", *args],
                          capture_output=True, text=True, cwd=cwd, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


class Other(http.server.BaseHTTPRequestHandler):
    """Another program's server on the demo's port: answers 404 and counts requests."""
    requests: list[str] = []

    def do_GET(self) -> None:
        Other.requests.append(self.path)
        self.send_error(404)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def other_server() -> Iterator[int]:
    port = free_port_block(3)     # the port and the two after it free: the demo takes the next
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Other)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    Other.requests = []
    try:
        yield port
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_port_zero_prints_no_address(tmp_path):
    out = demo("--port", "0", cwd=tmp_path).stdout
    assert ":0/" not in out and "live page on" not in out
    assert "mfotel demo: no /metrics endpoint (--port 0)" in out
    assert "/metrics at the last step" not in out


def test_the_address_printed_is_the_one_bound(tmp_path):
    port = free_port_block(1)
    out = demo("--port", str(port), cwd=tmp_path).stdout
    lines = out.splitlines()
    metrics = lines.index(f"mfotel demo: metrics on http://127.0.0.1:{port}/metrics")
    assert lines[metrics + 1].startswith(f"mfotel demo: live page on http://127.0.0.1:{port}/ ")
    assert 'mindformers_train_step{job_name="mfotel-demo",rank="0"} 6.0' in out


def test_a_taken_port_is_said_and_the_next_free_one_served(tmp_path, other_server):
    assert port_in_use("127.0.0.1", other_server)
    out = demo("--port", str(other_server), cwd=tmp_path).stdout
    served = other_server + 1
    assert (f"mfotel demo: port {other_server} on 127.0.0.1 is taken by another program (not "
            f"this demo's); serving on port {served} instead") in out
    assert f"mfotel demo: metrics on http://127.0.0.1:{served}/metrics" in out
    assert f":{other_server}/" not in re.sub(r"port \d+ on", "", out)
    # the excerpt is the demo's own /metrics; the other server was never asked
    assert 'mindformers_train_step{job_name="mfotel-demo",rank="0"} 6.0' in out
    assert Other.requests == []
