"""An attacker process holding idle TCP connections from several loopback addresses.

    with IdleFlood(port, sources=["127.0.0.2", "127.0.0.3"], per_source=4) as flood:
        ...                      # every source holds 4 connections that never send a byte,
    flood.stats                  # re-opened as soon as the server closes them

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


def flood(port: int, sources: list[str], per_source: int) -> dict[str, int]:
    """Hold the connections until stdin closes; (opened, closed by the server) counts."""
    import threading
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    held = [(source, idle_connection(port, source)) for source in sources
            for _ in range(per_source)]
    opened, closed = len(held), 0
    print("holding", flush=True)
    while not done.wait(0.02):
        for index, (source, sock) in enumerate(held):
            if closed_by_peer(sock):
                sock.close()
                held[index] = (source, idle_connection(port, source))
                opened, closed = opened + 1, closed + 1
    for _, sock in held:
        sock.close()
    return {"opened": opened, "closed_by_server": closed}


class IdleFlood:
    """The flood as a child process, started on enter and stopped (stats read) on exit."""

    def __init__(self, port: int, sources: list[str], per_source: int) -> None:
        self.args = [str(port), ",".join(sources), str(per_source)]
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
    print(json.dumps(flood(port, sources, per_source)), flush=True)
