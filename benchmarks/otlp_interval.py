"""Training speed against the OTLP push interval and timeout (the floors of those keys).

    .venv/bin/python benchmarks/otlp_interval.py [--steps 3000] [--repeats 3]

Trains the demo network (real MindSpore, CPU) with OTelMonitor pushing to a real OTLP/HTTP
receiver on loopback (tests/support/otlp_receiver.py), for push intervals and timeouts from
below the configuration's floors (built without validation) up to the default; the baseline
is the same monitor without a push, measured in the same run. Prints steps/s against the
baseline, the pushes received, and the export errors counted.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import statistics
import sys
from dataclasses import replace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import mindspore as ms  # noqa: E402
from overhead import ALL_METRICS, train  # noqa: E402

from mfotel.callback import OTelMonitor  # noqa: E402
from mfotel.config import OtlpConfig, parse_config  # noqa: E402
from tests.support.otlp_receiver import OtlpReceiver  # noqa: E402

TINY = 5e-324  # the smallest positive float, which the first version accepted
#: (interval, timeout) in seconds; None: no push (the baseline)
CASES: list[tuple[float, float] | None] = [
    None, (10.0, 5.0), (1.0, 1.0), (0.1, 1.0), (0.01, 1.0), (0.001, 1.0), (TINY, TINY),
    (1.0, 0.5), (1.0, 0.1), (1.0, 0.01), (1.0, 0.001)]


def monitor(case: tuple[float, float] | None, url: str) -> OTelMonitor:
    cfg = parse_config({"metrics": ALL_METRICS, "job_name": "bench", "output": {"console": False},
                        "prometheus": {"port": 0}})
    if case is not None:  # built directly: values below the floors must be measurable
        interval, timeout = case
        cfg = replace(cfg, otlp=OtlpConfig(endpoint=url, interval_seconds=interval,
                                           timeout_seconds=timeout))
    return OTelMonitor(config=cfg)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    logging.disable(logging.CRITICAL)  # the SDK's tracebacks at tiny timeouts: counted below
    speed: dict[object, list[float]] = {}
    pushes: dict[object, list[int]] = {}
    errors: dict[object, list[float]] = {}
    with OtlpReceiver() as receiver, open(os.devnull, "w") as sink:
        for _ in range(args.repeats):   # interleaved, so drift hits every case alike
            for case in CASES:
                before = len(receiver.requests)
                with contextlib.redirect_stderr(sink):
                    callback = monitor(case, receiver.url)
                    timed = train(args.steps, callback)
                speed.setdefault(case, []).append(timed.steps / timed.wall)
                pushes.setdefault(case, []).append(len(receiver.requests) - before)
                errors.setdefault(case, []).append(
                    callback.instruments.state.export_errors.get("otlp", 0))
    base = statistics.median(speed[None])
    print(f"steps per run: {args.steps}, repeats: {args.repeats} (medians)")
    print(f"{'interval s':>12} {'timeout s':>10} {'steps/s':>9} {'vs no push':>11} "
          f"{'pushes':>7} {'errors':>7}")
    for case in CASES:
        interval, timeout = ("-", "-") if case is None else (f"{case[0]:g}", f"{case[1]:g}")
        sps = statistics.median(speed[case])
        print(f"{interval:>12} {timeout:>10} {sps:9.0f} {base / sps:10.2f}x "
              f"{statistics.median(pushes[case]):7.0f} {statistics.median(errors[case]):7.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
