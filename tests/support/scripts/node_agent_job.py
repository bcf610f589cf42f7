"""A job of N small ranks, launched as msrun launches its workers (tests of the node agent).

    python tests/support/scripts/node_agent_job.py --ranks 3 --port 9464 --job-name j --control DIR

What the node agent meets under msrun, without MindSpore's minute of start-up: a scheduler
process (`MS_ROLE=MS_SCHED`, `RANK_ID=0`, the same script), each worker in a session of its
own with msrun's variables, a `tail -f` per worker carrying that worker's environment, a
launcher that reaps its workers once a second and SIGKILLs the others' process groups when
one fails (exit 1), or exits 0 when all completed. Each worker serves a prometheus_client
/metrics (with `mindformers_train_rank_info`, as a rank does) on port + rank, forks a helper
(a dataset worker's place in the tree), writes DIR/pid-<rank> and obeys files in DIR:

- hold-<rank> (seconds): hold the GIL that long in one C call (`ctypes.PyDLL` keeps it);
- alloc-<rank> (MiB): allocate and touch that much memory (to meet a cgroup's limit);
- exit-<rank> (a status): exit with it; done: every worker exits 0.

With `--cgroup RANK=DIR` that worker starts in the cgroup DIR (before it runs Python, so the
node agent meets it there from its first look).
"""
from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from handover import write_atomically

_PR_SET_PDEATHSIG = 1
#: A rank forks its helper this long after it started, as a rank starts its dataset workers
#: at train begin: after the node agent knew it.
HELPER_AFTER_SECONDS = 3.0


def fork_helper(orphan: bool) -> int:
    """A helper process below the rank (a dataset worker's place): gone with the rank, or
    with `orphan`, left orphaned for a minute."""
    helper = os.fork()
    if helper == 0:
        if not orphan:
            libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        time.sleep(60 if orphan else 3600)
        os._exit(0)
    return helper


def worker(args: argparse.Namespace) -> int:
    from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

    rank, control = int(os.environ["RANK_ID"]), Path(args.control)
    registry = CollectorRegistry()
    Gauge("mindformers_train_rank_info", "identity", ["job_name", "rank", "local_rank"],
          registry=registry).labels(args.job_name, str(rank), str(rank)).set(1)
    steps = Counter("mindformers_train_steps", "steps", ["job_name", "rank"], registry=registry)
    start_http_server(args.port + rank, addr="127.0.0.1", registry=registry)
    write_atomically(control / f"pid-{rank}", str(os.getpid()))
    started, helper = time.monotonic(), 0
    hold = ctypes.PyDLL(ctypes.util.find_library("c")).sleep  # never releases the GIL
    hoard: list[bytearray] = []
    while not (control / "done").exists():
        steps.labels(args.job_name, str(rank)).inc()
        if not helper and time.monotonic() - started > HELPER_AFTER_SECONDS:
            helper = fork_helper(args.orphan_helpers)
            write_atomically(control / f"helper-{rank}", str(helper))
        if (control / f"hold-{rank}").exists():
            seconds = int((control / f"hold-{rank}").read_text())
            (control / f"hold-{rank}").unlink()
            write_atomically(control / f"held-{rank}", str(time.time()))
            hold(seconds)
            write_atomically(control / f"released-{rank}", str(time.time()))
        if (control / f"alloc-{rank}").exists():
            mebibytes = int((control / f"alloc-{rank}").read_text())
            (control / f"alloc-{rank}").unlink()
            hoard.append(bytearray(b"\x01") * (mebibytes << 20))  # filled: resident
        if (control / f"exit-{rank}").exists():
            return int((control / f"exit-{rank}").read_text())
        time.sleep(0.1)
    return 0


def launcher(args: argparse.Namespace) -> int:
    script = [sys.executable, os.path.abspath(__file__), *sys.argv[1:]]
    base = {**os.environ, "RANK_SIZE": str(args.ranks), "MS_WORKER_NUM": str(args.ranks)}
    scheduler = subprocess.Popen([*script, "--role", "scheduler"],
                                 env={**base, "MS_ROLE": "MS_SCHED", "RANK_ID": "0"})
    workers, tails = [], []
    for rank in range(args.ranks):
        env = {**base, "MS_ROLE": "MS_WORKER", "RANK_ID": str(rank), "DEVICE_ID": str(rank),
               "MS_NODE_ID": str(rank)}
        folder = dict(args.cgroup).get(rank)
        workers.append(subprocess.Popen([*script, "--role", "worker"], env=env,
                                        start_new_session=True,
                                        preexec_fn=folder and _join(Path(folder))))
        tails.append(subprocess.Popen(["tail", "-f", "/dev/null"], env=env))
    status = 0
    while True:
        codes = [w.poll() for w in workers]
        if any(code not in (None, 0) for code in codes):
            status = 1
            for w in workers:
                if w.poll() is None:
                    os.killpg(os.getpgid(w.pid), signal.SIGKILL)
            break
        if all(code == 0 for code in codes):
            break
        time.sleep(1)  # as msrun: its workers stay zombies up to a second
    for process in (*tails, scheduler):
        process.kill()
        process.wait()
    return status  # as msrun: the workers it killed are left for its parent to reap


def _join(folder: Path) -> Callable[[], None]:
    """For preexec_fn: move the child into the cgroup `folder` ("0": the writer)."""
    def join() -> None:
        (folder / "cgroup.procs").write_text("0")
    return join


def _cgroup(text: str) -> tuple[int, str]:
    rank, _, folder = text.partition("=")
    return int(rank), folder


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--job-name", default="node-agent-test")
    parser.add_argument("--control", required=True)
    parser.add_argument("--role", choices=("launcher", "scheduler", "worker"), default="launcher")
    parser.add_argument("--orphan-helpers", action="store_true",
                        help="the ranks' helpers outlive them (a minute), orphaned")
    parser.add_argument("--cgroup", type=_cgroup, action="append", default=[],
                        metavar="RANK=DIR", help="start that worker in the cgroup DIR")
    args = parser.parse_args()
    if args.role == "scheduler":
        time.sleep(3600)  # msrun's scheduler waits for the workers; killed by the launcher
        return 0
    return worker(args) if args.role == "worker" else launcher(args)


if __name__ == "__main__":
    sys.exit(main())
