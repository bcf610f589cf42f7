"""Whether a port can be served on this machine now, and who holds it when it cannot.

    port_in_use("0.0.0.0", 9464)   # None (free), or "pid 4242, prometheus"

The port is bound the way the /metrics endpoint binds it (socket.create_server: SO_REUSEADDR,
so a port in TIME_WAIT counts as free), then released. The holder is looked up in /proc (Linux:
the listening socket's inode in /proc/net/tcp{,6}, then the process whose descriptor it is);
where /proc cannot tell (another user's process without root, another network namespace), the
message says so.
"""
from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

PROC = Path("/proc")
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's st column


def port_in_use(host: str, port: int) -> str | None:
    """Who holds `port` on `host` when it cannot be bound now (EADDRINUSE), else None.

    Other bind errors (an address of another machine, a privileged port) raise OSError: they
    are not "in use" and are reported (or not) by the caller.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        socket.create_server((host, port), family=family).close()
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        return holder(port) or "its process is not visible here"
    return None


def holder(port: int) -> str | None:
    """"pid N, name" of the process listening on TCP `port`, when /proc tells."""
    inodes = {inode for table in ("tcp", "tcp6") for inode in _listening(PROC / "net" / table,
                                                                         port)}
    if not inodes:
        return None
    links = {f"socket:[{inode}]" for inode in inodes}
    for pid_dir in PROC.iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            for fd in (pid_dir / "fd").iterdir():
                if os.readlink(fd) in links:
                    name = (pid_dir / "comm").read_text(errors="replace").strip()
                    return f"pid {pid_dir.name}, {name}"
        except OSError:  # gone, or another user's process: not ours to read
            continue
    return None


def _listening(table: Path, port: int) -> list[str]:
    """Inodes of the sockets listening on `port` in one /proc/net table."""
    try:
        lines = table.read_text().splitlines()[1:]
    except OSError:
        return []
    inodes = []
    for line in lines:
        fields = line.split()
        if len(fields) > 9 and fields[3] == _LISTEN \
                and int(fields[1].rsplit(":", 1)[1], 16) == port:
            inodes.append(fields[9])
    return inodes
