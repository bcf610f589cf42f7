"""Helpers of the /metrics endpoint tests: a real PKI, a served Telemetry, raw clients."""
from __future__ import annotations

import base64
import http.client
import socket
import ssl
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from mfotel.config import parse_config
from mfotel.identity import RankIdentity
from mfotel.instruments import Instruments
from mfotel.telemetry import Telemetry


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


@dataclass(frozen=True)
class Pki:
    """A CA, a server certificate for 127.0.0.1 and client certificates, made by the openssl CLI.

    clients: "scraper" (SAN DNS:scraper.example, signed by the CA), "other" (DNS:other.example,
    signed by the CA), "rogue" (signed by a CA the server does not trust).
    """
    folder: Path

    @property
    def ca(self) -> Path:
        return self.folder / "ca.pem"

    def cert(self, name: str) -> Path:
        return self.folder / f"{name}.pem"

    def key(self, name: str) -> Path:
        return self.folder / f"{name}.key"

    def client_context(self, client: str | None = None) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.ca))
        if client:
            context.load_cert_chain(self.cert(client), self.key(client))
        return context


def make_pki(folder: Path) -> Pki:
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for ca in ("ca", "rogue-ca"):
        openssl("req", "-x509", *ec, "-days", "1", "-subj", f"/CN=mfotel test {ca}",
                "-keyout", str(folder / f"{ca}.key"), "-out", str(folder / f"{ca}.pem"))
    for name, ca, san in (("server", "ca", "IP:127.0.0.1,DNS:localhost"),
                          ("scraper", "ca", "DNS:scraper.example"),
                          ("other", "ca", "DNS:other.example"),
                          ("rogue", "rogue-ca", "DNS:scraper.example")):
        (folder / f"{name}.ext").write_text(f"subjectAltName={san}\n")
        openssl("req", *ec, "-subj", f"/CN={name}", "-keyout", str(folder / f"{name}.key"),
                "-out", str(folder / f"{name}.csr"))
        openssl("x509", "-req", "-in", str(folder / f"{name}.csr"), "-days", "1",
                "-CA", str(folder / f"{ca}.pem"), "-CAkey", str(folder / f"{ca}.key"),
                "-CAcreateserial", "-extfile", str(folder / f"{name}.ext"),
                "-out", str(folder / f"{name}.pem"))
    return Pki(folder)


def serve(port: int, **prometheus: Any) -> tuple[Telemetry, Instruments]:
    """A Telemetry serving /metrics on 127.0.0.1:port with loss 1.25; shut it down after use."""
    cfg = parse_config({"prometheus": {"host": "127.0.0.1", "port": port, **prometheus}})
    telemetry = Telemetry(cfg, RankIdentity(), "secure")
    inst = Instruments(telemetry.start(), {"job_name": "secure", "rank": "0"}, cfg.metrics)
    inst.state.loss = 1.25
    telemetry.serve(lambda: inst.version)
    return telemetry, inst


def basic(user: str, password: str) -> dict[str, str]:
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"Authorization": f"Basic {token}"}


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes


REFUSED = Reply(0, {}, b"")  # the connection failed (TLS refused, reset, closed)


def request(port: int, path: str = "/metrics", method: str = "GET",
            context: ssl.SSLContext | None = None, source: str | None = None,
            timeout: float = 10.0, **headers: str) -> Reply:
    """One HTTP(S) request to 127.0.0.1:port from `source` (another loopback address)."""
    address = (source, 0) if source else None
    if context is not None:
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(
            "127.0.0.1", port, timeout=timeout, context=context, source_address=address)
    else:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout, source_address=address)
    try:
        conn.request(method, path, headers=headers)
        response = conn.getresponse()
        return Reply(response.status, dict(response.headers), response.read())
    except (ssl.SSLError, ConnectionError, http.client.RemoteDisconnected):
        return REFUSED
    finally:
        conn.close()


def timed(call: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    result = call()
    return time.perf_counter() - started, result


def idle_connections(port: int, count: int) -> list[socket.socket]:
    """`count` TCP connections that never send a byte (non-blocking connects)."""
    sockets = []
    for _ in range(count):
        sock = socket.socket()
        sock.setblocking(False)
        sock.connect_ex(("127.0.0.1", port))
        sockets.append(sock)
    return sockets


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the server closed this connection (EOF or reset), without blocking."""
    try:
        return sock.recv(1, socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def wait_until(condition: Callable[[], Any], timeout: float, step: float = 0.05) -> Any:
    """Poll `condition` until it is truthy (returned) or `timeout` seconds pass (None)."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result or time.monotonic() > deadline:
            return result
        time.sleep(step)


def proc_status(pid: int, field: str) -> int:
    """A numeric field of /proc/<pid>/status (e.g. Threads)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise KeyError(field)


def open_fds(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))
