"""The live page's cost to training, against the page off, in one run; and its memory.

    .venv/bin/python benchmarks/live_page.py [--steps 3000] [--repeats 3]

Part 1 trains the demo network (real MindSpore, CPU, graph mode, step_interval 1, five seed
metrics) with OTelMonitor, the page off (`prometheus.ui: false`) and on: nobody watching,
one client polling as the page does (`/api/history` deltas every second, `/api/overview`
every 3 s, from another process), ten such clients, and a real headless Chromium with the
page open (Debian's chromium, driven by Playwright in another process). It prints the time
spent inside the callback per step on the training thread and the training throughput,
each against the page off. Variants are interleaved, so machine drift hits all alike.
Then the callback's own CPU time per step without a network, page off and on (precise where
the training runs are noisy), and the history's memory (fixed at start) and what a new
viewer costs the training process (encoding the full history, 10k points).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
import tracemalloc
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from overhead import ALL_METRICS, train

from mfotel.callback import OTelMonitor
from mfotel.config import parse_config
from mfotel.identity import RankIdentity
from mfotel.instruments import TrainState
from mfotel.localstack.servers import free_port
from mfotel.ui import History, live_page

CHROMIUM = "/usr/bin/chromium"
#: what app.js does: history deltas every second, the overview every 3 s
POLLER = """
import json, sys, threading, time, urllib.request
port, clients = int(sys.argv[1]), int(sys.argv[2])
base = f"http://127.0.0.1:{port}"
def get(path):
    with urllib.request.urlopen(base + path, timeout=30) as reply:
        return json.loads(reply.read())
def client():
    query, ticks = "", 0
    while True:
        try:
            data = get("/api/history" + query)
            query = f"?since={data['committed'] if data['committed'] is not None else -1}" \\
                    f"&generation={data['generation']}&marks={data['marks_version']}"
            if ticks % 3 == 0:
                get("/api/overview")
        except OSError:
            query = ""
        ticks += 1
        time.sleep(1.0)
for _ in range(clients):
    threading.Thread(target=client, daemon=True).start()
time.sleep(3600)
"""
BROWSER = """
import sys, time
from playwright.sync_api import sync_playwright
port = int(sys.argv[1])
flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
with sync_playwright() as p:
    browser = p.chromium.launch(executable_path=sys.argv[2], args=flags)
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    while True:
        try:
            page.goto(f"http://127.0.0.1:{port}/")
            break
        except Exception:
            time.sleep(0.2)
    print("open", flush=True)
    time.sleep(3600)
"""


def monitor(port: int, ui: bool) -> OTelMonitor:
    return OTelMonitor(step_interval=1, metrics=ALL_METRICS, job_name="bench",
                       output={"console": False},
                       prometheus={"host": "127.0.0.1", "port": port, "linger_seconds": 0,
                                   "ui": ui})


@contextlib.contextmanager
def watcher(kind: str, port: int) -> Any:
    """A process watching the page during the run: `poll:N` clients, or `browser`."""
    if kind == "none":
        yield
        return
    if kind == "browser":
        argv = [sys.executable, "-c", BROWSER, str(port), CHROMIUM]
    else:
        argv = [sys.executable, "-c", POLLER, str(port), kind.split(":")[1]]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        yield
    finally:
        process.kill()
        process.wait()


def variants() -> dict[str, tuple[bool, str]]:
    table = {"page off (prometheus.ui: false)": (False, "none"),
             "page on, nobody watching": (True, "none"),
             "page on, 1 client polling like the page": (True, "poll:1"),
             "page on, 10 clients polling": (True, "poll:10")}
    if os.path.exists(CHROMIUM):
        table["page on, headless Chromium showing it"] = (True, "browser")
    return table


def part1(steps: int, repeats: int) -> None:
    results: dict[str, list[tuple[float, float]]] = {}
    table = variants()
    for _ in range(repeats):
        for name, (ui, kind) in table.items():
            port = free_port()
            with watcher(kind, port), open(os.devnull, "w") as sink, \
                    contextlib.redirect_stdout(sink):
                if kind == "browser":
                    time.sleep(3.0)  # Chromium starts, and reloads until the endpoint is up
                timed = train(steps, monitor(port, ui))
            results.setdefault(name, []).append(
                (timed.seconds / timed.steps * 1e6, timed.steps / timed.wall))
    base_us = statistics.median(us for us, _ in results["page off (prometheus.ui: false)"])
    base_sps = statistics.median(s for _, s in results["page off (prometheus.ui: false)"])
    print(f"## training with the page ({steps} steps per run, {repeats} repeats, medians; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    print(f"{'variant':44} {'us/step in callback':>20} {'x off':>6} {'steps/s':>8} {'x off':>6}")
    for name, runs in results.items():
        us = statistics.median(u for u, _ in runs)
        sps = statistics.median(s for _, s in runs)
        print(f"{name:44} {us:20.1f} {us / base_us:6.2f} {sps:8.0f} {sps / base_sps:6.3f}")
    if not os.path.exists(CHROMIUM):
        print(f"(no {CHROMIUM}: the browser variant was not measured)")


def callback_alone(steps: int = 20_000, repeats: int = 5) -> None:
    """The callback's own CPU time per step, page off and on, without a network: MindSpore's
    RunContext and callback parameters with numpy outputs (the difference is the ring)."""
    import numpy as np
    from mindspore.train.callback import RunContext, _InternalCallbackParam
    losses = np.random.default_rng(0).random(1000).astype(np.float32)
    results: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(repeats):
        for ui in (False, True):
            callback = OTelMonitor(step_interval=1, metrics=ALL_METRICS, job_name="bench",
                                   batch_size=8, output={"console": False},
                                   prometheus={"host": "127.0.0.1", "port": free_port(),
                                               "linger_seconds": 0, "ui": ui})
            cb = _InternalCallbackParam()
            cb.epoch_num, cb.batch_num, cb.cur_epoch_num = 1, steps, 1
            cb.optimizer, cb.train_network = None, None
            context = RunContext(cb)
            callback.on_train_begin(context)
            started = time.thread_time()
            for step in range(1, steps + 1):
                cb.cur_step_num, cb.net_outputs = step, (losses[step % 1000], losses[step % 999])
                callback.on_train_step_begin(context)
                callback.on_train_step_end(context)
            results[ui].append((time.thread_time() - started) / steps * 1e6)
            callback.close()
    off, on = (statistics.median(results[ui]) for ui in (False, True))
    print(f"\n## the callback alone ({steps} synthetic record steps, {repeats} repeats, CPU "
          f"time on the training thread, medians)")
    print(f"page off: {off:.2f} us/step; page on: {on:.2f} us/step ({on - off:+.2f} us, "
          f"x{on / off:.3f})")


def part2(points: int = 10_000, records: int = 1_000_000) -> None:
    history = History(points)
    values = {name: 1.0 for name in ALL_METRICS}
    for step in range(points):  # fill (and thin) once, then measure what a long run adds
        history.append(step, values)
    started = time.thread_time()
    for step in range(points, points + records):
        history.append(step, values)
    append_us = (time.thread_time() - started) / records * 1e6
    tracemalloc.start()  # (it slows allocations: not on while timing)
    before = tracemalloc.take_snapshot()
    for step in range(points + records, points + 2 * records):
        history.append(step, values)
    grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(before, "filename"))
    tracemalloc.stop()
    print(f"\n## history memory ({points} points, then {records} more records)")
    print(f"point arrays: {history.nbytes} bytes ({history.nbytes / points:.0f} per point), "
          f"allocated at start; after {records} more records: {grown:+d} bytes traced "
          f"(snapshot bookkeeping included), {history.points} points shown, every "
          f"{history.stride}th record")
    print(f"append: {append_us:.2f} us CPU per record (thinning included)")
    cfg = parse_config({"metrics": ALL_METRICS, "prometheus": {"ui_history_points": points}})
    page = live_page(cfg, RankIdentity(), "bench", TrainState())
    for step in range(points - 2):  # nearly full: the next record does not thin it
        page.history.append(step, {name: 1.0 + step * 1e-4 for name in ALL_METRICS})
    app = page.routes()["/api/history"]
    def new_viewer(numbers: bool) -> tuple[float, bytes]:
        """CPU seconds (the GIL held) to answer a new viewer after a change, and the body."""
        timings = []
        for _ in range(5):
            page._full[numbers] = (-1, 0.0, 0.0, b"")  # the history changed since last time
            started = time.thread_time()
            body = b"".join(app({"REQUEST_METHOD": "GET", "QUERY_STRING":
                                 "format=numbers" if numbers else ""}, lambda *a: None))
            timings.append(time.thread_time() - started)
        return statistics.median(timings), body
    seconds, body = new_viewer(False)
    plain_seconds, plain = new_viewer(True)
    full = json.loads(body)
    query = (f"since={full['committed']}&generation={full['generation']}"
             f"&marks={full['marks_version']}")
    page.history.append(points - 2, {name: 1.0 for name in ALL_METRICS})
    delta = b"".join(app({"REQUEST_METHOD": "GET", "QUERY_STRING": query}, lambda *a: None))
    print(f"a new viewer ({full['points']} points): {seconds * 1e3:.1f} ms CPU, "
          f"{len(body) / 1024:.0f} KiB (series as base64 float64, what the page asks for); "
          f"as JSON numbers (format=numbers): {plain_seconds * 1e3:.1f} ms, "
          f"{len(plain) / 1024:.0f} KiB ({plain_seconds / seconds:.0f}x). At most once per "
          f"50 x that time whatever the number of viewers (2% budget). A poll after one "
          f"record: {len(delta)} bytes")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=3000, help="training steps per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per variant, interleaved")
    parser.add_argument("--points", type=int, default=10_000, help="ui_history_points (part 2)")
    args = parser.parse_args()
    import mindspore as ms
    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    part1(args.steps, args.repeats)
    callback_alone()
    part2(args.points)
    return 0


if __name__ == "__main__":
    sys.exit(main())
