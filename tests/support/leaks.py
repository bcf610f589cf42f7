"""Nothing a test starts may outlive it: a guard that finds, kills and reports survivors.

Every pytest process of a run (the one process, or each xdist worker) puts a marker of its own
in its environment (OWNER=<uuid>) when it starts, so that everything the tests start inherits
it, orphans reparented to init included; and it becomes a child subreaper, so that orphans of
its descendants are reparented to it rather than to init. After each test module the process
looks for survivors: processes carrying its marker, and its descendants; it kills them and
fails the module, naming their command lines. The process that started the run (the xdist
controller, or the one process) also marks the whole run (SESSION=<uuid>) and checks once more
at its end, for what a crashed worker could not clean up.
"""
from __future__ import annotations

import ctypes
import os
import time
import uuid

from tests.support.processes import (
    carrying,
    children,
    cmdline,
    identities,
    kill_same,
    proc_stat,
    tree,
)

OWNER = "MFOTEL_TEST_OWNER"
SESSION = "MFOTEL_TEST_SESSION"
#: What a test stopped just before it ended may need a moment to exit (signal handlers, a
#: final flush, a browser closing its renderers); a survivor is one still there after this.
GRACE_SECONDS = 5.0
PR_SET_CHILD_SUBREAPER = 36
#: Started by the standard library on first use and kept until the interpreter exits (its
#: helpers end with it): not started by a test.
INTERPRETER_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def mark_this_process(runs_tests: bool) -> None:
    """Give this process its markers (everything it starts inherits them); make it a
    subreaper. The xdist controller, which runs no test, marks the run only."""
    os.environ.setdefault(SESSION, uuid.uuid4().hex)
    if runs_tests:
        os.environ[OWNER] = uuid.uuid4().hex
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def _alive(pids: set[int]) -> set[int]:
    return {pid for pid in pids if (stat := proc_stat(pid)) is not None and stat[0] != "Z"
            and not any(name in cmdline(pid) for name in INTERPRETER_HELPERS)}


def _reap_zombie_children() -> None:
    """Orphans reparented to this subreaper end as its zombies: reap them."""
    for pid in children(os.getpid()):
        stat = proc_stat(pid)
        if stat is not None and stat[0] == "Z":
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass


def survivors(grace: float = GRACE_SECONDS) -> dict[int, str]:
    """Processes this one's tests started that still run (after `grace` s): pid -> command."""
    owner = os.environ.get(OWNER)
    if owner is None:  # the xdist controller: no test ran here
        return {}
    deadline = time.monotonic() + grace
    while True:
        _reap_zombie_children()
        found = _alive({*carrying(OWNER, owner), *tree(os.getpid())})
        if not found or time.monotonic() >= deadline:
            return {pid: cmdline(pid) for pid in sorted(found)}
        time.sleep(0.1)


def session_survivors(grace: float = GRACE_SECONDS) -> dict[int, str]:
    """Like `survivors`, for the whole run (by its SESSION marker), from the process that
    started it. Its xdist workers (children started without OWNER) are not survivors."""
    session = os.environ[SESSION]
    deadline = time.monotonic() + grace
    while True:
        _reap_zombie_children()
        workers = {pid for pid in children(os.getpid()) if OWNER not in _environ_names(pid)}
        found = _alive(set(carrying(SESSION, session)) - workers)
        if not found or time.monotonic() >= deadline:
            return {pid: cmdline(pid) for pid in sorted(found)}
        time.sleep(0.1)


def _environ_names(pid: int) -> set[str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            return {item.split(b"=", 1)[0].decode(errors="replace")
                    for item in handle.read().split(b"\0") if item}
    except OSError:
        return set()


def end(found: dict[int, str]) -> str:
    """Kill `found`; a report naming them."""
    kill_same(identities(found))
    return "\n".join(f"  pid {pid}: {line}" for pid, line in found.items())
