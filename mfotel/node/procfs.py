"""What Linux's /proc says about a process: state, exit status, CPU, memory, environment,
listening TCP ports, and the kernel's OOM-kill count of its memory cgroup.

Every reader returns None (or an empty result) for a process that is gone or not ours to
read: processes end between two reads, and the caller decides what that means.

    stat = read_stat(pid)          # ProcStat(state="S", cpu_seconds=12.5, ...)
    listening_ports(pid)           # [("127.0.0.1", 9465)]
    oom_kill_count(memory_cgroup_file(pid))  # 0: the kills its memory cgroup counted
"""
from __future__ import annotations

import fcntl
import functools
import ipaddress
import os
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_TCP_LISTEN = 10
# netlink sock_diag (linux/inet_diag.h, linux/netlink.h)
_NETLINK_SOCK_DIAG, _SOCK_DIAG_BY_FAMILY = 4, 20
_NLM_F_REQUEST, _NLM_F_DUMP, _NLMSG_ERROR, _NLMSG_DONE = 0x1, 0x300, 2, 3
_NLMSG_HEADER, _SOCKID_BYTES = 16, 48
# pidfd information (linux/pidfd.h, 6.15+): struct pidfd_info, its exit_code at byte 60
_PIDFD_INFO_BYTES, _PIDFD_INFO_EXIT = 72, 1 << 3
_PIDFD_GET_INFO = (3 << 30) | (_PIDFD_INFO_BYTES << 16) | (0xFF << 8) | 11
#: /proc/PID/stat fields after the name, 0-based: state is field 3 of proc(5), so field N is
#: at N - 3.
_PPID, _PGRP, _UTIME, _STIME, _START, _RSS, _EXIT_CODE = 1, 2, 11, 12, 19, 21, 49


@dataclass(frozen=True)
class ProcStat:
    """One process as /proc/PID/stat has it."""

    pid: int
    ppid: int
    pgid: int
    state: str              # ps(1)'s letter: R, S, D, T, t, Z, X, ...
    cpu_seconds: float      # user + system time
    start_ticks: int        # start time after boot, in clock ticks: a pid's identity with pid
    rss_bytes: int
    exit_status: int | None  # a zombie's wait status (waitpid(2) form); None while it runs
    name: str = ""          # the command name (comm): exec changes it, pid and start stay

    @property
    def ended(self) -> bool:
        """Exited, waiting for its parent to reap it."""
        return self.state in ("Z", "X")


def parse_stat(pid: int, text: str) -> ProcStat | None:
    """A /proc/PID/stat line; None if it is cut short."""
    head, _, tail = text.rpartition(")")  # the name in parentheses may hold anything
    fields = tail.split()
    if len(fields) <= _RSS:
        return None
    state = fields[0]
    exit_status = int(fields[_EXIT_CODE]) if state in ("Z", "X") and len(fields) > _EXIT_CODE \
        else None
    return ProcStat(pid, int(fields[_PPID]), int(fields[_PGRP]), state,
                    (int(fields[_UTIME]) + int(fields[_STIME])) / CLOCK_TICKS,
                    int(fields[_START]), int(fields[_RSS]) * PAGE_BYTES, exit_status,
                    head.partition("(")[2])


def pidfd_exit_status(fd: int) -> int | None:
    """The wait status of the process a pidfd refers to, once it was reaped (by anyone):
    Linux 6.15+ `PIDFD_GET_INFO` with `PIDFD_INFO_EXIT`; None before, or on older kernels."""
    request = bytearray(struct.pack("=QQ", _PIDFD_INFO_EXIT, 0) + bytes(_PIDFD_INFO_BYTES - 16))
    try:
        fcntl.ioctl(fd, _PIDFD_GET_INFO, request)
    except OSError:
        return None
    mask, status = struct.unpack_from("=Q", request)[0], struct.unpack_from("=i", request, 60)[0]
    return status if mask & _PIDFD_INFO_EXIT else None


def uptime_ticks() -> int:
    """Clock ticks since boot now (the unit of ProcStat.start_ticks)."""
    try:
        with open("/proc/uptime", "rb") as handle:
            return int(float(handle.read().split()[0]) * CLOCK_TICKS)
    except (OSError, ValueError, IndexError):
        return 0


def read_stat(pid: int) -> ProcStat | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return parse_stat(pid, handle.read().decode("ascii", "replace"))
    except (OSError, ValueError):
        return None


def processes() -> dict[int, ProcStat]:
    """Every process of the system (none where there is no /proc)."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return {}
    table = {}
    for entry in entries:
        if entry.isdigit():
            stat = read_stat(int(entry))
            if stat is not None:  # it ended meanwhile
                table[stat.pid] = stat
    return table


def children(pid: int) -> list[int] | None:
    """The children of `pid` (/proc/PID/task/*/children); None where the kernel does not
    list them (CONFIG_PROC_CHILDREN)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    found: list[int] = []
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children", "rb") as handle:
                found += [int(child) for child in handle.read().split()]
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            continue  # the thread ended meanwhile
    return found


def descendants(root: int, table: dict[int, ProcStat] | None = None,
                prune: frozenset[int] = frozenset()) -> list[ProcStat]:
    """The processes below `root`, parents before their children: from `table`, else by
    walking the children lists down from `root` (the cost is the job's processes, not the
    system's; not below the processes in `prune`), else from every process of the system."""
    if table is None:
        walked = _walk(root, prune)
        if walked is not None:
            return walked
        table = processes()
    below: dict[int, list[ProcStat]] = {}
    for proc in table.values():
        below.setdefault(proc.ppid, []).append(proc)
    found: list[ProcStat] = []
    todo = [root]
    while todo:
        for child in below.get(todo.pop(), ()):
            found.append(child)
            todo.append(child.pid)
    return found


def _walk(root: int, prune: frozenset[int]) -> list[ProcStat] | None:
    found: list[ProcStat] = []
    todo = [root]
    while todo:
        pids = children(todo.pop())
        if pids is None:
            return None
        for pid in pids:
            stat = read_stat(pid)
            if stat is not None:  # it ended meanwhile
                found.append(stat)
                if pid not in prune:
                    todo.append(pid)
    return found


def read_environ(pid: int) -> dict[str, str] | None:
    """The environment the process was started with (what exec gave it)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            raw = handle.read()
    except OSError:
        return None
    env = {}
    for item in raw.split(b"\0"):
        name, sep, value = item.partition(b"=")
        if sep:
            env[name.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
    return env


def exe_name(pid: int) -> str:
    """The base name of the process's executable ("" when unreadable)."""
    try:
        return os.path.basename(os.readlink(f"/proc/{pid}/exe"))
    except OSError:
        return ""


def caught_signals(pid: int) -> frozenset[int] | None:
    """The signals the process has a handler for (`SigCgt` of /proc/PID/status: one bit per
    signal, process-wide); None when unreadable."""
    try:
        with open(f"/proc/{pid}/status", "rb") as handle:
            text = handle.read().decode("ascii", "replace")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("SigCgt:"):
            try:
                mask = int(line.split(":", 1)[1].strip(), 16)
            except ValueError:
                return None
            return frozenset(bit + 1 for bit in range(mask.bit_length()) if mask >> bit & 1)
    return None


# ---------------------------------------------------------------- sockets
def socket_inodes(pid: int) -> set[int]:
    """The inodes of the sockets process `pid` holds descriptors of (empty when unreadable)."""
    inodes: set[int] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def listening_sockets() -> list[tuple[str, int, int]]:
    """(address, port, socket inode) of every TCP socket listening in this network namespace.

    Asked of the kernel's sock_diag netlink interface, which lists listening sockets only (as
    `ss -ltn` does): /proc/net/tcp lists every connection of the host as well, and reading it
    costs the kernel 150 ms per 9000 sockets. Falls back to /proc/net/tcp{,6}.
    """
    try:
        return [found for family in (socket.AF_INET, socket.AF_INET6)
                for found in _diag_listening(family)]
    except OSError:
        return _proc_net_listening()


def _diag_listening(family: int) -> list[tuple[str, int, int]]:
    request = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 1 << _TCP_LISTEN) + \
        bytes(_SOCKID_BYTES)
    header = struct.pack("=IHHII", _NLMSG_HEADER + len(request), _SOCK_DIAG_BY_FAMILY,
                         _NLM_F_REQUEST | _NLM_F_DUMP, 1, 0)
    found: list[tuple[str, int, int]] = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as sock:
        sock.settimeout(5.0)
        sock.sendto(header + request, (0, 0))
        while True:
            data = sock.recv(1 << 16)
            offset = 0
            while offset + _NLMSG_HEADER <= len(data):
                length, kind = struct.unpack_from("=IH", data, offset)
                if kind == _NLMSG_DONE:
                    return found
                if kind == _NLMSG_ERROR or length < _NLMSG_HEADER:
                    raise OSError("sock_diag refused the request")
                body = offset + _NLMSG_HEADER
                port = struct.unpack_from("!H", data, body + 4)[0]
                raw = data[body + 8: body + 8 + (4 if family == socket.AF_INET else 16)]
                inode = struct.unpack_from("=I", data, body + 4 + _SOCKID_BYTES + 16)[0]
                found.append((str(ipaddress.ip_address(raw)), port, inode))
                offset += (length + 3) & ~3
            if not data:
                return found


def _proc_net_listening() -> list[tuple[str, int, int]]:
    found = []
    for name in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A":
                address, _, port = fields[1].rpartition(":")
                found.append((_address(address), int(port, 16), int(fields[9])))
    return found


def _address(hex_address: str) -> str:
    """/proc/net/tcp{,6}'s host-order hex address as text."""
    raw = bytes.fromhex(hex_address)
    if len(raw) == 4:
        return ".".join(str(b) for b in reversed(raw))
    # IPv6: four 32-bit words, each in host (little-endian) order
    return ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))).compressed


def listening_ports(pid: int) -> list[tuple[str, int]]:
    """(address, port) of the TCP sockets this process itself listens on."""
    mine = socket_inodes(pid)
    return sorted({(address, port) for address, port, inode in listening_sockets()
                   if inode in mine})


# ---------------------------------------------------------------- OOM kills
@functools.lru_cache(maxsize=1)
def _mount_points() -> dict[str, str]:
    """cgroup2 -> its mount point, and each cgroup v1 controller -> its mount point (read
    once: cgroup file systems are mounted at boot)."""
    found: dict[str, str] = {}
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        left, _, right = line.partition(" - ")
        parts, kind = left.split(), right.split()
        if len(parts) < 5 or len(kind) < 3:
            continue
        if kind[0] == "cgroup2":
            found.setdefault("cgroup2", parts[4])
        elif kind[0] == "cgroup":
            for option in kind[2].split(","):
                found.setdefault(option, parts[4])
    return found


def memory_cgroup_file(pid: int) -> Path | None:
    """The file that counts the OOM kills of the process's memory cgroup: cgroup v2
    `memory.events` of the nearest cgroup up from its own that has the memory controller, or v1
    `memory.oom_control`. The kernel counts a kill in the victim's memory cgroup whichever
    limit was met (v2 also adds it to every parent's, v1 does not): a parent's count would
    tell a sibling's kill as this process's."""
    mounts = _mount_points()
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "memory" and "memory" in mounts:
            root, name = Path(mounts["memory"]), "memory.oom_control"
        elif controllers == "" and "cgroup2" in mounts:
            root, name = Path(mounts["cgroup2"]), "memory.events"
        else:
            continue
        folder = root / path.lstrip("/")
        while True:
            if (folder / name).is_file():
                return folder / name
            if folder == root or root not in folder.parents:
                break
            folder = folder.parent
    return None


def oom_kill_count(path: Path | None) -> int | None:
    """The `oom_kill` line of a memory.events / memory.oom_control file."""
    if path is None:
        return None
    try:
        for line in path.read_text().splitlines():
            key, _, count = line.partition(" ")
            if key == "oom_kill":
                return int(count)
    except (OSError, ValueError):
        return None
    return None
