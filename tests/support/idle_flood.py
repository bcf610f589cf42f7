"""An attacker process holding idle TCP connections from several loopback addresses.

    with IdleFlood(port, sources=["127.0.0.2", "127.0.0.3"], per_source=4) as flood:
        ...                      # every source holds 4 connections that never send a byte,
    flood.stats                  # re-opened as soon as the server closes them

    with IdleFlood(port, ["127.0.0.2"], 100, send=declared_body("GET", LIVENESS_PATH)):
        ...                      # each connection sends a request head declaring a body that
                                 # never comes, reads what the server answers, and holds on

The attacker is another process (as it would be on a network), so it competes with the server
for neither the GIL nor the test's file descriptors. Run as a script, it floods until its stdin
closes and then prints its counts as JSON. Idle connections from the test's own process:
`idle_connections(port, count)`, and `closed_by_peer(sock)` for either.
"""
from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any


def idle_connection(port: int, source: str | None = None) -> socket.socket:
    """A TCP connection to 127.0.0.1:`port` (from `source`) that never sends a byte
    (non-blocking connect)."""
    sock = socket.socket()
    sock.setblocking(False)
    if source is not None:
        sock.bind((source, 0))
    sock.connect_ex(("127.0.0.1", port))
    return sock


def idle_connections(port: int, count: int) -> list[socket.socket]:
    """`count` idle connections from this process."""
    return [idle_connection(port) for _ in range(count)]


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the server closed this connection (EOF or reset), without blocking."""
    try:
        return sock.recv(1, socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def declared_body(method: str, path: str, length: int = 4_000_000, **headers: str) -> bytes:
    """A request head declaring a `length`-byte body (that the flood never sends)."""
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Length: {length}",
             *(f"{name.replace('_', '-')}: {value}" for name, value in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def sending_connection(port: int, source: str | None, send: bytes) -> socket.socket | None:
    """A connection that sent `send` and then stays silent (non-blocking from then on); None
    when it could not be made now (the server's backlog full: the next round tries again)."""
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=1,
                                        source_address=(source, 0) if source else None)
    except OSError:
        return None
    try:
        sock.sendall(send)
    except OSError:
        pass  # closed at once by the server: seen closed below, and opened again
    sock.setblocking(False)
    return sock


def answered_and_closed(sock: socket.socket) -> bool:
    """Whether the server closed this connection, reading (and dropping) its answer."""
    try:
        while sock.recv(1 << 16, socket.MSG_DONTWAIT):
            pass
        return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def flood(port: int, sources: list[str], per_source: int, send: bytes = b"") -> dict[str, int]:
    """Hold the connections until stdin closes; (opened, closed by the server) counts. With
    `send`, each connection sends it first (e.g. a `declared_body` head). A connection the
    server closes is opened again at once (the flood waits on all of them in one poll)."""
    import selectors
    import threading
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    closed_now = answered_and_closed if send else closed_by_peer
    selector = selectors.DefaultSelector()
    unconnected: list[str] = []
    counts = {"opened": 0, "closed_by_server": 0}

    def connect(source: str) -> None:
        sock = sending_connection(port, source, send) if send else idle_connection(port, source)
        if sock is None:
            unconnected.append(source)
            return
        counts["opened"] += 1
        selector.register(sock, selectors.EVENT_READ, source)

    for source in sources:
        for _ in range(per_source):
            connect(source)
    print("holding", flush=True)
    while not done.is_set():
        retry, unconnected[:] = list(unconnected), []
        for source in retry:
            connect(source)
        for key, _ in selector.select(0.02):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            if closed_now(sock):
                selector.unregister(sock)
                sock.close()
                counts["closed_by_server"] += 1
                connect(key.data)
    for key in list(selector.get_map().values()):
        key.fileobj.close()  # type: ignore[union-attr]
    return counts


class IdleFlood:
    """The flood as a child process, started on enter and stopped (stats read) on exit."""

    def __init__(self, port: int, sources: list[str], per_source: int, send: bytes = b"") -> None:
        self.args = [str(port), ",".join(sources), str(per_source), send.hex()]
        self.idle = not send   # its connections never send a byte
        self.stats: dict[str, Any] = {}
        self._process: subprocess.Popen[str] | None = None

    def __enter__(self) -> IdleFlood:
        self._process = subprocess.Popen([sys.executable, str(Path(__file__)), *self.args],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self._process.stdout is not None
        assert self._process.stdout.readline() == "holding\n", "the flood did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._process is not None
        try:
            out, _ = self._process.communicate("", timeout=60)
            self.stats = json.loads(out) if out.strip() else {}
        finally:
            if self._process.poll() is None:
                self._process.kill()
                self._process.wait(30)


def loopback_sources(count: int, first: int = 2) -> list[str]:
    """127.0.0.<first> .. : distinct client addresses on loopback (Linux routes 127/8 to lo)."""
    return [f"127.0.0.{first + i}" for i in range(count)]


if __name__ == "__main__":
    port, sources, per_source = int(sys.argv[1]), sys.argv[2].split(","), int(sys.argv[3])
    sent = bytes.fromhex(sys.argv[4]) if len(sys.argv) > 4 else b""
    print(json.dumps(flood(port, sources, per_source, sent)), flush=True)
