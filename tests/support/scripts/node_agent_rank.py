"""One small process of a job, as wrapper scripts start them (tests of the node agent's
rendezvous): a rank that tells the agent who it is, or the other Python processes of a
wrapper that carry the rank's environment (a sidecar, a later log upload).

    python tests/support/scripts/node_agent_rank.py --name rank --control DIR --port 9600 \
        --job-name j --announce [--announce-when-told] [--exit-after 3]

Without MindSpore (a second of start-up): it writes DIR/pid-<name> at start; with `--port`
it serves a prometheus_client /metrics holding `mindformers_train_rank_info` (as a rank does)
on 127.0.0.1; with `--announce` it joins the node agent as OTelMonitor does at train begin
(`mfotel.node_link.NodeLink.join`: job, rank from `--rank` or RANK_ID, local rank, its
endpoint), at start, or with `--announce-when-told` once DIR/announce-<name> exists (a real
rank's train begin comes after MindSpore's import and the job's set-up: until then the
agent guesses). It writes DIR/announced-<name> then, and runs until DIR/done exists, or
`--exit-after` seconds.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from handover import write_atomically

from mfotel.node_link import Announcement, NodeLink


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", required=True, help="DIR/pid-<name> gets the pid")
    parser.add_argument("--control", required=True)
    parser.add_argument("--port", type=int, default=0, help="serve /metrics here (0: none)")
    parser.add_argument("--job-name", default="node-agent-rank")
    parser.add_argument("--rank", type=int, default=None, help="default: RANK_ID, else 0")
    parser.add_argument("--announce", action="store_true")
    parser.add_argument("--announce-when-told", action="store_true")
    parser.add_argument("--exit-after", type=float, default=0.0)
    args = parser.parse_args()
    control = Path(args.control)
    rank = args.rank if args.rank is not None else int(os.environ.get("RANK_ID", "0") or 0)
    local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    if args.port:
        from prometheus_client import CollectorRegistry, Gauge, start_http_server
        registry = CollectorRegistry()
        Gauge("mindformers_train_rank_info", "identity", ["job_name", "rank", "local_rank"],
              registry=registry).labels(args.job_name, str(rank), str(local_rank)).set(1)
        start_http_server(args.port, addr="127.0.0.1", registry=registry)
    write_atomically(control / f"pid-{args.name}", str(os.getpid()))
    started = time.monotonic()
    announced = False
    while not (control / "done").exists():
        elapsed = time.monotonic() - started
        if args.announce and not announced and (
                not args.announce_when_told or (control / f"announce-{args.name}").exists()):
            link = NodeLink.join(Announcement(
                os.getpid(), args.job_name, rank, local_rank, 1,
                "127.0.0.1" if args.port else "", args.port))
            announced = True  # None without MFOTEL_NODE_DIR (no launcher): nothing to tell
            write_atomically(control / f"announced-{args.name}",
                             str(link.directory) if link else "")
        if args.exit_after and elapsed >= args.exit_after:
            break
        time.sleep(0.1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
