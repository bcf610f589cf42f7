"""What runs: processes read from /proc (state, group, session, descendants, environment),
and processes found by a tag in their environment, which every descendant inherits, orphans
included (an orphan is no one's child any more: only its environment still says whose it is).

A pid alone names no process for long: the kernel reuses pids (32768 of them here, and every
thread of a MindSpore rank takes one), so a pid a test saw earlier may name another process by
the time it is killed. What this module kills, it reaches through a pidfd opened before it
checked that the process is still the one meant (its start time, or its tag): a reused pid is
never hit.
"""
from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterable
from pathlib import Path

from mfotel.node.procfs import read_stat

#: The environment variable a test sets on what it starts, to find it again (`kill_tagged`).
TAG = "MFOTEL_TEST_TAG"


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, process group) of `pid`, None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[2])


def session(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[3])
    except (OSError, IndexError):
        return None


def running(pid: int) -> bool:
    stat = proc_stat(pid)
    return stat is not None and stat[0] != "Z"


def children(pid: int) -> list[int]:
    """The children of `pid` (from /proc/PID/task/TID/children)."""
    found: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return found
    for task in tasks:
        try:
            found += [int(child) for child in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


def tree(pid: int) -> list[int]:
    """Every descendant of `pid`."""
    return [found for child in children(pid) for found in (child, *tree(child))]


def _status(path: Path) -> dict[str, str]:
    """The fields of a /proc/.../status file, by name."""
    return dict(line.replace("\t", " ").split(":", 1) for line in path.read_text().splitlines()
                if ":" in line)


def signal_states(pids: list[int]) -> str:
    """Each process's state, group, signal masks and, per thread, where it waits (what a
    signal that changed nothing needs explained); one line a process, threads indented."""
    keep = ("State", "SigQ", "SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt")
    lines = []
    for pid in pids:
        proc = Path(f"/proc/{pid}")
        try:
            status = _status(proc / "status")
        except OSError:
            continue
        lines.append(f"pid {pid} group {(proc_stat(pid) or ('?', '?'))[1]} {cmdline(pid)[:80]}: "
                     + ", ".join(f"{key}:{status[key]}" for key in keep if key in status))
        for task in sorted((proc / "task").glob("*")):
            try:
                lines.append(f"  thread {task.name}: wchan {(task / 'wchan').read_text()}, "
                             f"syscall {(task / 'syscall').read_text().split()[0]}, "
                             f"SigBlk {_status(task / 'status')['SigBlk'].strip()}")
            except (OSError, KeyError, IndexError):
                continue
    return "\n".join(lines)


def running_in_groups(groups: set[int]) -> list[int]:
    """Pids of running processes whose process group is one of `groups`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = proc_stat(int(entry.name))
            if stat is not None and stat[0] != "Z" and stat[1] in groups:
                found.append(int(entry.name))
    return found


def pids() -> list[int]:
    return [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]


def environ_has(pid: int, name: str, value: str) -> bool:
    """Whether `pid` was started with `name=value` in its environment."""
    try:
        return f"{name}={value}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


def carrying(name: str, value: str) -> list[int]:
    """Running processes (zombies left out) started with `name=value` in their environment."""
    return [pid for pid in pids() if pid != os.getpid() and environ_has(pid, name, value)
            and running(pid)]


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return "?"


def identities(pids_: Iterable[int]) -> dict[int, int]:
    """pid -> start time (clock ticks after boot) of each that runs: a process, not a number."""
    found = {}
    for pid in pids_:
        stat = read_stat(pid)
        if stat is not None and not stat.ended:
            found[pid] = stat.start_ticks
    return found


def _kill_if(pid: int, still_it: Callable[[int], bool]) -> bool:
    """SIGKILL `pid` if `still_it(pid)` holds once a pidfd on it is open; whether it was sent."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:   # gone
        return False
    try:
        if not still_it(pid):
            return False   # another process took the pid meanwhile
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        return True
    except OSError:
        return False
    finally:
        os.close(pidfd)


def _reap(pids_: Iterable[int]) -> None:
    for pid in pids_:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:  # not ours (init or another subreaper reaps it)
            pass


def signal_all(pids_: Iterable[int], signum: int) -> int:
    """Send `signum` to each process, held by pidfds opened before the first is sent: a death
    the signal causes cannot hand a pid on to a process it then reaches. How many got it."""
    fds = []
    for pid in pids_:
        try:
            fds.append(os.pidfd_open(pid))
        except OSError:   # gone
            continue
    sent = 0
    try:
        for fd in fds:
            try:
                signal.pidfd_send_signal(fd, signum)
                sent += 1
            except ProcessLookupError:
                pass
    finally:
        for fd in fds:
            os.close(fd)
    return sent


def kill_same(seen: dict[int, int]) -> None:
    """SIGKILL each process of `identities()` that is still the one seen (same start time);
    reap those that are this process's children."""
    def same(pid: int) -> bool:
        stat = read_stat(pid)
        return stat is not None and stat.start_ticks == seen[pid]
    _reap([pid for pid in seen if _kill_if(pid, same)])


def kill_tagged(tag: str) -> list[str]:
    """Kill every process started with TAG=`tag` (checked again through its pidfd); their
    command lines."""
    found = carrying(TAG, tag)
    lines = [cmdline(pid) for pid in found]
    _reap([pid for pid in found if _kill_if(pid, lambda p: environ_has(p, TAG, tag))])
    return lines
