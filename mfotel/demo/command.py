"""`mfotel demo` (without --with-alerting): train the demo network and say where to look.

The addresses printed are those the endpoint actually bound, read from the monitor once
training has begun: a port another program holds is never shown as the demo's, nor scraped.
When the asked port is taken before the start, the next free one is used and printed.
"""
from __future__ import annotations

import argparse
import socket
import urllib.request
from collections.abc import Callable
from typing import Any

from .training import run_demo

#: ports tried after a taken --port, upwards
PORT_TRIES = 20


def port_in_use(host: str, port: int) -> bool:
    """Whether a server listens on host:port now (bound as the endpoint binds: reuse-address,
    so sockets in TIME_WAIT do not count)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def choose_port(host: str, port: int, say: Callable[[str], None]) -> int:
    """`port`, or when a server already listens there the next free one (said); 0 if none."""
    if not port or not port_in_use(host, port):
        return port
    for candidate in range(port + 1, min(port + 1 + PORT_TRIES, 65536)):
        if not port_in_use(host, candidate):
            say(f"mfotel demo: port {port} on {host} is taken by another program (not this "
                f"demo's); serving on port {candidate} instead (--port N chooses another)")
            return candidate
    say(f"mfotel demo: port {port} and the {PORT_TRIES} after it on {host} are taken; "
        f"serving no /metrics (--port N chooses a free port)")
    return 0


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


def _callbacks(announce: Callable[[Any], None], sink: list[str]) -> tuple[Any, ...]:
    """After the monitor in the callback list: at train begin, say what the endpoint bound;
    after the last step, scrape it (only it) for the excerpt."""
    from mindspore.train import Callback

    from ..callback import OTelMonitor

    class Announce(Callback):
        def __init__(self) -> None:
            self.monitor: Any = None

        def on_train_begin(self, run_context: Any) -> None:
            self.monitor = next((c for c in run_context.original_args().list_callback
                                 if isinstance(c, OTelMonitor)), None)
            announce(self.monitor)

        def on_train_step_end(self, run_context: Any) -> None:
            cb = run_context.original_args()
            endpoint = getattr(getattr(self.monitor, "telemetry", None), "endpoint", None)
            if cb.cur_step_num != cb.epoch_num * cb.batch_num or endpoint is None:
                return
            try:
                body = _scrape(endpoint.url)
            except OSError as exc:
                sink.append(f"  (scrape failed: {exc})")
                return
            sink.extend("  " + line for line in body.splitlines()
                        if line.startswith("mindformers_train_") and "_bucket" not in line)
    return (Announce(),)


def addresses(monitor: Any, asked_port: int, host: str) -> list[str]:
    """The lines saying where /metrics and the live page are (or why they are not)."""
    endpoint = getattr(getattr(monitor, "telemetry", None), "endpoint", None)
    if not asked_port:
        return ["mfotel demo: no /metrics endpoint (--port 0); the [Monitor] lines below"]
    if endpoint is None:
        return [f"mfotel demo: not serving /metrics: port {asked_port} on {host} could not be "
                f"bound (see the warning above); --port N chooses another"]
    lines = [f"mfotel demo: metrics on {endpoint.url}"]
    if getattr(monitor, "live", None) is not None:
        lines.append(f"mfotel demo: live page on {endpoint.page_url} (open it in a browser; "
                     f"--linger-seconds N keeps it up N s after the last step)")
    return lines


def demo_command(args: argparse.Namespace, overrides: dict[str, Any]) -> int:
    """Train, print the bound addresses at train begin, the result and a /metrics excerpt."""
    def say(text: str) -> None:
        print(text, flush=True)
    host = "127.0.0.1" if args.host in ("0.0.0.0", "") else args.host
    port = choose_port(args.host or "0.0.0.0", args.port, say)
    say(f"mfotel demo: {args.steps} steps (job_name={args.job_name})")
    excerpt: list[str] = []

    def announce(monitor: Any) -> None:
        for line in addresses(monitor, port, host):
            say(line)
    result = run_demo(steps=args.steps, step_interval=args.step_interval, port=port,
                      nan_at_step=args.nan_at_step, job_name=args.job_name,
                      linger_seconds=args.linger_seconds, batch_size=args.batch_size,
                      lr_schedule=args.lr_schedule, min_step_seconds=args.step_sleep,
                      extra_callbacks=_callbacks(announce, excerpt),
                      prometheus={"host": args.host, "port": port,
                                  "linger_seconds": args.linger_seconds},
                      **overrides)
    say(f"mfotel demo: trained {len(result.losses)} steps in {result.seconds:.1f} s; "
        f"last loss {result.losses[max(result.losses)]:.6g}")
    if excerpt:
        say("mfotel demo: /metrics at the last step (excerpt):")
        say("\n".join(excerpt))
    return 0
