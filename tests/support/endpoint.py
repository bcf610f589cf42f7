"""Helpers of the /metrics endpoint tests: a real PKI, a served rank, raw clients."""
from __future__ import annotations

import http.client
import os
import ssl
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import bcrypt

from mfotel.instruments import Instruments
from mfotel.node.procfs import socket_inodes
from mfotel.telemetry import Telemetry
from tests.support.http import Reply, basic_auth
from tests.support.http import request as http_request
from tests.support.ranks import rank_exporter

SCRAPER = "127.0.0.2"  # the legitimate scraper's address; attackers connect from 127.0.0.1


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
    """Rank 0 of job `secure` serving /metrics on 127.0.0.1:port with loss 1.25 (a
    tests.support.ranks exporter); shut it down after use."""
    exporter = rank_exporter({"prometheus": {"host": "127.0.0.1", "port": port, **prometheus}},
                             job_name="secure", serve=False)
    exporter.state.loss = 1.25
    exporter.serve()
    return exporter.telemetry, exporter.instruments


def self_signed(folder: Path) -> Path:
    """`folder` with cert.pem and key.pem: a self-signed RSA certificate for 127.0.0.1."""
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
            "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(folder / "key.pem"),
            "-out", str(folder / "cert.pem"))
    return folder


def basic(user: str, password: str) -> dict[str, str]:
    """The Authorization header of HTTP basic auth, as keyword arguments of `request`."""
    return {"Authorization": basic_auth(user, password)}


def web_config(path: Path, cert: Path, key: Path, users: dict[str, str] | None = None,
               **tls: object) -> Path:
    """Write a web-config file at `path`: TLS with `cert`/`key` and the `tls_server_config`
    settings `tls`; basic-auth `users` (name -> password, stored bcrypt-hashed)."""
    lines = ["tls_server_config:", f"  cert_file: {cert}", f"  key_file: {key}",
             *(f"  {name}: {value}" for name, value in tls.items())]
    if users:
        lines.append("basic_auth_users:")
    for name, password in (users or {}).items():
        hashed = bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=4)).decode()
        lines.append(f"  {name}: '{hashed}'")
    path.write_text("\n".join(lines) + "\n")
    return path


REFUSED = Reply(0, http.client.HTTPMessage(), b"")  # the connection failed (TLS, reset, closed)


def request(port: int, path: str = "/metrics", method: str = "GET",
            context: ssl.SSLContext | None = None, source: str | None = None,
            timeout: float = 10.0, **headers: str) -> Reply:
    """One HTTP(S) request to 127.0.0.1:port from `source` (another loopback address);
    REFUSED when the connection fails."""
    scheme = "https" if context is not None else "http"
    try:
        return http_request(f"{scheme}://127.0.0.1:{port}{path}", method, headers=headers,
                            context=context, timeout=timeout, source=source)
    except (ssl.SSLError, ConnectionError, http.client.RemoteDisconnected):
        return REFUSED


def timed(call: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    result = call()
    return time.perf_counter() - started, result


def proc_status(pid: int, field: str) -> int:
    """A numeric field of /proc/<pid>/status (e.g. Threads)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise KeyError(field)


def open_fds(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


def accepted_sockets(port: int) -> int:
    """Connections to `port` that this process has accepted and not closed, as the kernel
    counts them: this process's socket descriptors whose TCP socket has local port `port`
    (the listening socket and connections still in the accept queue, which own no
    descriptor yet, are not counted).

    The descriptors are read before the kernel's TCP tables, so every socket counted was open
    at one common instant: the count never exceeds what was open at once.
    """
    mine = socket_inodes(os.getpid())
    on_port = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], int(fields[9])
            if int(local.rsplit(":", 1)[1], 16) == port and state != "0A" and inode:  # 0A: LISTEN
                on_port.add(inode)
    return len(mine & on_port)
