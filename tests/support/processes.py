"""What runs: processes read from /proc (state, group, session, descendants, environment),
and processes found by a tag in their environment, which every descendant inherits, orphans
included (an orphan is no one's child any more: only its environment still says whose it is).
"""
from __future__ import annotations

import os
import signal
from pathlib import Path

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


def kill(pids_: list[int]) -> None:
    """SIGKILL each process; reap those that are this process's children."""
    for pid in pids_:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
    for pid in pids_:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:  # not ours (init or another subreaper reaps it)
            pass


def kill_tagged(tag: str) -> list[str]:
    """Kill every process started with TAG=`tag`; their command lines."""
    found = carrying(TAG, tag)
    lines = [cmdline(pid) for pid in found]
    kill(found)
    return lines
