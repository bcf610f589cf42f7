"""Scrape cost of /metrics, and training slowdown while scraped, against baselines in one run.

    .venv/bin/python benchmarks/scrape.py [--sizes 100 1000 10000 50000] [--train-steps 3000]

Part 1 serves N per-parameter series (`mindformers_train_local_norm{param}`) four ways and
times HTTP scrapes: plain prometheus_client (the baseline), the stock OTel Prometheus reader,
mfotel right after a native value changed (re-collect and re-render; in a run this happens at
most once per cost/2% seconds), and mfotel with nothing changed (cached bytes).
Part 2 trains the demo network with 10k native series exposed while scrapers hit /metrics, and
compares steps/s with an unscraped run.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics import ObservableGauge as SdkObservableGauge
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from mfotel.config import parse_config
from mfotel.identity import RankIdentity
from mfotel.instruments import Instruments
from mfotel.localstack.servers import free_port
from mfotel.telemetry import Telemetry

LABELS = {"job_name": "bench", "rank": "0"}
SCRAPER = """
import sys, threading, time, urllib.request
port, n, interval = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
def loop():
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read()
        except OSError:
            pass
        time.sleep(interval)
for _ in range(n):
    threading.Thread(target=loop, daemon=True).start()
time.sleep(3600)
"""


def scrape(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=60) as response:
        return response.read()


def time_scrapes(url: str, repeats: int, before: Callable[[], None] = lambda: None
                 ) -> tuple[float, int]:
    """Median seconds of one scrape, and the body size."""
    scrape(url)  # warm-up
    times, size = [], 0
    for _ in range(repeats):
        before()
        started = time.perf_counter()
        size = len(scrape(url))
        times.append(time.perf_counter() - started)
    return statistics.median(times), size


class Served:
    """A server plus a way to stop it."""

    def __init__(self, url: str, stop: Callable[[], None],
                 change: Callable[[], None] = lambda: None) -> None:
        self.url, self.stop, self.change = url, stop, change


def plain(n: int) -> Served:
    registry = CollectorRegistry(auto_describe=False)
    gauge = Gauge("mindformers_train_local_norm", "local norm", ["job_name", "rank", "param"],
                  registry=registry)
    for i in range(n):
        gauge.labels("bench", "0", f"layers.{i}.weight").set(i * 0.001)
    port = free_port()
    server, _ = start_http_server(port, "127.0.0.1", registry)
    return Served(f"http://127.0.0.1:{port}/metrics",
                  lambda: (server.shutdown(), server.server_close()))


def stock_otel(n: int) -> Served:
    registry = CollectorRegistry(auto_describe=False)
    reader = PrometheusMetricReader(registry=registry,
                                    cardinality_limits={SdkObservableGauge: n + 10})
    provider = MeterProvider(metric_readers=[reader])
    points = [(i * 0.001, {**LABELS, "param": f"layers.{i}.weight"}) for i in range(n)]
    provider.get_meter("bench").create_observable_gauge(
        "mindformers_train_local_norm",
        callbacks=[lambda o: [Observation(v, a) for v, a in points]])
    port = free_port()
    server, _ = start_http_server(port, "127.0.0.1", registry)
    return Served(f"http://127.0.0.1:{port}/metrics",
                  lambda: (server.shutdown(), server.server_close(), provider.shutdown()))


def mfotel(n: int, port: int | None = None) -> tuple[Served, Instruments]:
    cfg = parse_config({"native_series_limit": n + 10, "metrics": ["loss"],
                        "prometheus": {"host": "127.0.0.1", "port": port or free_port()}})
    telemetry = Telemetry(cfg, RankIdentity(), "bench")
    inst = Instruments(telemetry.start(), LABELS, cfg.metrics, native_meter=telemetry.native_meter)
    for i in range(n):
        inst.set_native("local_norm", i * 0.001, {"param": f"layers.{i}.weight"})
    telemetry.serve(lambda: inst.version, lambda: inst.native_version)
    tick = [0]

    def change() -> None:
        tick[0] += 1
        inst.set_native("local_norm", tick[0], {"param": "layers.0.weight"})
        inst.touch()
    served = Served(telemetry.endpoint.url, telemetry.shutdown, change)
    served.telemetry = telemetry
    return served, inst


def part1(sizes: list[int]) -> None:
    print("## /metrics scrape: median seconds and body size (ratio vs plain prometheus_client)")
    print(f"{'series':>7} {'plain s':>9} {'stock OTel':>16} {'mfotel changed':>18} "
          f"{'mfotel cached':>17} {'body KB':>8}")
    for n in sizes:
        repeats = 5 if n >= 50000 else 15
        rows: dict[str, tuple[float, int]] = {}
        for name, make in (("plain", plain), ("stock", stock_otel)):
            served = make(n)
            rows[name] = time_scrapes(served.url, repeats)
            served.stop()
        served, _ = mfotel(n)
        served.telemetry.app.collectors[1].budget = None  # measure every re-collection
        rows["changed"] = time_scrapes(served.url, repeats, served.change)
        rows["cached"] = time_scrapes(served.url, repeats)
        served.stop()
        base = rows["plain"][0]
        cells = [f"{rows[k][0]:8.4f}s ({rows[k][0] / base:4.2f}x)"
                 for k in ("stock", "changed", "cached")]
        print(f"{n:7d} {base:8.4f}s {cells[0]:>16} {cells[1]:>18} {cells[2]:>17} "
              f"{rows['plain'][1] / 1024:8.0f}")


def part2(steps: int, series: int) -> None:
    import mindspore as ms
    import mindspore.dataset as ds
    from mindspore.train import Callback

    from mfotel.callback import OTelMonitor
    from mfotel.demo.training import SyntheticRegression, build_model
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")

    class Native(Callback):
        """Exposes `series` native series, refreshed every 100 steps like a record interval."""

        def __init__(self, monitor: OTelMonitor) -> None:
            super().__init__()
            self.monitor = monitor

        def on_train_step_end(self, run_context: Any) -> None:
            step = int(run_context.original_args().cur_step_num)
            if step == 1 or step % 100 == 0:
                for i in range(series):
                    self.monitor.instruments.set_native("local_norm", step + i * 1e-3,
                                                        {"param": f"layers.{i}.weight"})

    def run(scrapers: int, interval: float) -> float:
        port = free_port()
        monitor = OTelMonitor(step_interval=10, metrics=["loss", "learning_rate", "step_time"],
                              native_series_limit=series + 10, output={"console": False},
                              prometheus={"host": "127.0.0.1", "port": port, "linger_seconds": 0})
        source = SyntheticRegression(steps, 8)
        dataset = ds.GeneratorDataset(source, ["x", "y"], shuffle=False).batch(8)
        model = build_model(steps, 8, "constant")
        # the scrapers are another process, as Prometheus is: their HTTP parsing must not
        # take this process's GIL
        scraper = subprocess.Popen([sys.executable, "-c", SCRAPER, str(port), str(scrapers),
                                    str(interval)]) if scrapers else None
        started = time.perf_counter()
        model.train(1, dataset, callbacks=[monitor, Native(monitor)], dataset_sink_mode=False)
        elapsed = time.perf_counter() - started
        if scraper is not None:
            scraper.terminate()
            scraper.wait(10)
        return steps / elapsed

    print(f"\n## training while scraped: {series} native series, {steps} steps (steps/s, ratio)")
    results: dict[str, list[float]] = {}
    for _ in range(1):
        for name, scrapers, interval in (("unscraped", 0, 1.0), ("1 scraper every 1 s", 1, 1.0),
                                         ("10 concurrent scrapers every 1 s", 10, 1.0)):
            results.setdefault(name, []).append(run(scrapers, interval))
    base = statistics.median(results["unscraped"])
    for name, runs in results.items():
        sps = statistics.median(runs)
        print(f"{name:36} {sps:8.0f} steps/s  {sps / base:6.3f}  "
              f"(slowdown {100 * (1 - sps / base):5.1f}%)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 1000, 10000, 50000])
    parser.add_argument("--train-steps", type=int, default=20000,
                        help="long enough to span several native re-collection windows")
    parser.add_argument("--train-series", type=int, default=10000)
    parser.add_argument("--skip-training", action="store_true")
    args = parser.parse_args()
    part1(args.sizes)
    if not args.skip_training:
        part2(args.train_steps, args.train_series)
    return 0


if __name__ == "__main__":
    sys.exit(main())
