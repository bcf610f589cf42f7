"""`mfotel demo --with-alerting`: the shipped Prometheus and Alertmanager configs on loopback,
a NaN injected into a real MindSpore run, and the page arriving at the webhook receiver.

    from mfotel.demo.alerting import run_alerting_demo
    run_alerting_demo(steps=60, nan_at_step=20)

The stack itself (receiver, Alertmanager, Prometheus with the shipped files) is
mfotel.localstack.alerting.AlertingStack; `step_clock` and `scrape_gate` are the demo's
MindSpore callbacks (the benchmarks and tests use them too).
"""
from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

from ..alerting.receiver import ReceivedAlert
from ..localstack.alerting import AlertingStack
from ..localstack.servers import Prometheus, free_port


# ---------------------------------------------------------------- the demo
@dataclass
class AlertingDemoResult:
    nan_step_time: float | None = None     # unix time the NaN step ended
    page: ReceivedAlert | None = None       # the MindFormersLossNotFinite notification
    alerts: list[ReceivedAlert] = field(default_factory=list)

    @property
    def latency_seconds(self) -> float | None:
        """Seconds from the end of the NaN step to the notification's arrival."""
        if self.page is None or self.nan_step_time is None:
            return None
        return self.page.received_at - self.nan_step_time


def step_clock(step: int, sink: dict[int, float]) -> Any:
    """A MindSpore callback storing the unix time at which `step` ended into sink[step]: the
    time OTelMonitor stamped on it (`mindformers_train_last_step_timestamp_seconds`, before the
    monitor's own work, a fast-path post included), else the time this callback ran."""
    from mindspore.train import Callback

    class StepClock(Callback):
        def on_train_step_end(self, run_context: Any) -> None:
            now = time.time()
            cb = run_context.original_args()
            if int(cb.cur_step_num) != step:
                return
            stamps = [c.instruments.state.last_step_timestamp
                      for c in getattr(cb, "list_callback", None) or ()
                      if getattr(getattr(c, "instruments", None), "state", None) is not None
                      and c.instruments.state.step == step]
            sink[step] = min([now, *(s for s in stamps if s is not None)])
    return StepClock()


def scrape_gate(prometheus: Prometheus, job_name: str, step: int, timeout: float = 60.0) -> Any:
    """A MindSpore callback holding the run at the end of `step` until `prometheus` has
    scraped that step of `job_name`: what follows (a NaN) happens under a live scrape,
    however loaded the machine is. TimeoutError after `timeout` seconds."""
    from mindspore.train import Callback

    class ScrapeGate(Callback):
        def on_train_step_end(self, run_context: Any) -> None:
            if int(run_context.original_args().cur_step_num) == step:
                prometheus.wait_for(f'mindformers_train_step{{job_name="{job_name}"}} >= {step}',
                                    timeout=timeout, interval=0.05)
    return ScrapeGate()


def run_alerting_demo(steps: int = 80, nan_at_step: int = 20, port: int | None = None,
                      job_name: str = "mfotel-alerting-demo", step_seconds: float = 0.1,
                      timeout: float = 60.0, out: TextIO = sys.stdout, fast_path: bool = False,
                      **demo_overrides: Any) -> AlertingDemoResult:
    """Start the stack, train with a NaN at `nan_at_step`, print the page when it arrives.

    `fast_path` also makes the training process post the alert itself (`alertmanager_url`).
    Raises RuntimeError when prometheus/prometheus-alertmanager are not installed, and
    TimeoutError when no page arrives within `timeout` seconds of the end of training.
    """
    from .training import run_demo
    port = port or free_port()
    result = AlertingDemoResult()
    clock: dict[int, float] = {}

    def say(text: str) -> None:
        out.write(f"mfotel alerting demo: {text}\n")
        out.flush()

    with AlertingStack([f"127.0.0.1:{port}"], out=out, verbose=True) as stack:
        assert stack.prometheus is not None and stack.alertmanager is not None
        say(f"Prometheus {stack.prometheus.url}, Alertmanager {stack.alertmanager.url}, "
            f"receiver {stack.receiver.url}; scraping 127.0.0.1:{port}")
        say("the shipped files, changed only in: " + "; ".join(stack.changes))
        path = "the training process posts it (fast path)" if fast_path else \
            f"the rule, after the next scrape and evaluation (every {stack.interval})"
        say(f"training {steps} steps (job_name={job_name}), NaN injected at step {nan_at_step}; "
            f"{path}")
        settings: dict[str, Any] = {"output": {"console": False}, "linger_seconds": 3.0,
                                    **demo_overrides}
        if fast_path:
            settings["alertmanager_url"] = stack.alertmanager.url
        gate = (scrape_gate(stack.prometheus, job_name, nan_at_step - 1),) \
            if nan_at_step > 1 else ()
        run_demo(steps=steps, port=port, nan_at_step=nan_at_step, job_name=job_name,
                 min_step_seconds=step_seconds,
                 extra_callbacks=(*gate, step_clock(nan_at_step, clock)), **settings)
        result.nan_step_time = clock.get(nan_at_step)
        result.page = stack.receiver.wait_for(
            lambda a: a.firing and a.alertname == "MindFormersLossNotFinite"
            and a.labels.get("job_name") == job_name, timeout=timeout)
        result.alerts = stack.receiver.received()
        latency = result.latency_seconds
        say(f"page received {latency:.2f} s after the end of the NaN step"
            if latency is not None else "page received")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    import argparse
    parser = argparse.ArgumentParser(prog="python -m mfotel.demo.alerting",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--nan-at-step", type=int, default=20)
    parser.add_argument("--port", type=int, default=None, help="/metrics port (default: free)")
    parser.add_argument("--job-name", default="mfotel-alerting-demo")
    parser.add_argument("--fast-path", action="store_true",
                        help="the training process also posts the alert to Alertmanager")
    args = parser.parse_args(argv)
    try:
        run_alerting_demo(steps=args.steps, nan_at_step=args.nan_at_step, port=args.port,
                          job_name=args.job_name, fast_path=args.fast_path)
    except (RuntimeError, FileNotFoundError, TimeoutError) as error:
        print(f"mfotel alerting demo: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
