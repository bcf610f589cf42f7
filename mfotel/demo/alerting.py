"""`mfotel demo --with-alerting`: the shipped Prometheus and Alertmanager configs on loopback,
a NaN injected into a real MindSpore run, and the page arriving at the webhook receiver.

    from mfotel.demo.alerting import run_alerting_demo
    run_alerting_demo(steps=60, nan_at_step=20)

`AlertingStack` is the reusable part (tests use it): it starts the alerts receiver, Alertmanager
and Prometheus with the shipped `alertmanager.yml`, `prometheus.yml` and rule files (package
data, as `mfotel assets` writes them), rewritten only where a loopback demo needs it: target and
receiver addresses, 1 s scrape and evaluation intervals, no group_wait, and every `for:`
scaled down by the same factor as the scrape interval (15 s -> 1 s: 2m becomes 8s).
"""
from __future__ import annotations

import math
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence, TextIO

import yaml

from ..alerting import rules as rules_module
from ..alerting.auth import WebhookAuth
from ..alerting.receiver import AlertsReceiver, ReceivedAlert
from ..assets import alertmanager_files, prometheus_files, rule_files, write_files
from .stack import (ALERTMANAGER_BINARIES, PROMETHEUS_BINARIES, Alertmanager, Prometheus,
                    find_binary, free_port)

SHIPPED_SCRAPE_SECONDS = 15.0

_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}


def duration_seconds(text: str) -> float:
    """Seconds of a Prometheus duration ("1h30m", "90s")."""
    parts = re.findall(r"([0-9]+)(ms|s|m|h|d|w|y)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"{text!r} is not a Prometheus duration")
    return sum(int(n) * _UNITS[u] for n, u in parts)


def _seconds(value: float) -> str:
    return f"{max(1, math.ceil(value))}s"


def shipped_files() -> dict[str, str]:
    """The shipped configs this module starts the servers with (YAML text, from the package)."""
    rules, prometheus = rule_files(), prometheus_files()
    return {"prometheus": prometheus["prometheus.yml"].decode(),
            "alertmanager": alertmanager_files()["alertmanager.yml"].decode(),
            "alerts": rules[rules_module.ALERTS_FILE].decode(),
            "recording": rules[rules_module.RECORDING_FILE].decode()}


def check_binaries() -> None:
    """RuntimeError naming the packages to install when a server binary is missing."""
    missing = [pkg for names, pkg in ((PROMETHEUS_BINARIES, "prometheus"),
                                      (ALERTMANAGER_BINARIES, "prometheus-alertmanager"))
               if find_binary(names) is None]
    if missing:
        raise RuntimeError(f"{' and '.join(missing)} not found on PATH; the alerting demo "
                           f"starts the real servers. Install: apt-get install {' '.join(missing)}")


# ---------------------------------------------------------------- config rewriting
def loopback_prometheus_config(text: str, targets: Sequence[str], alertmanager: str,
                               interval: str = "1s") -> str:
    """The shipped prometheus.yml pointed at `targets` and `alertmanager`, rules beside it."""
    config = yaml.safe_load(text)
    config["global"].update(scrape_interval=interval, evaluation_interval=interval,
                            scrape_timeout=interval)
    config["rule_files"] = [Path(p).name for p in config["rule_files"]]
    config["alerting"]["alertmanagers"] = [{"static_configs": [{"targets": [alertmanager]}]}]
    job = next(j for j in config["scrape_configs"] if "static_configs" in j)
    job["static_configs"] = [{"targets": list(targets),
                              "labels": job["static_configs"][0].get("labels", {})}]
    config["scrape_configs"] = [job]     # the file_sd job has no files here
    return yaml.safe_dump(config, sort_keys=False)


def loopback_alertmanager_config(text: str, webhook_url: str,
                                 http_config: dict[str, Any] | None = None) -> str:
    """The shipped alertmanager.yml with every webhook sent to `webhook_url`, no waiting
    (and with `http_config`, e.g. the receiver's credentials, on every webhook)."""
    config = yaml.safe_load(text)

    def fast(route: dict[str, Any]) -> None:
        route["group_wait"], route["group_interval"] = "0s", "1s"
        for child in route.get("routes", []):
            fast(child)

    fast(config["route"])
    for receiver in config["receivers"]:
        for webhook in receiver.get("webhook_configs", []):
            webhook["url"] = webhook_url
            if http_config:
                webhook["http_config"] = http_config
    return yaml.safe_dump(config, sort_keys=False)


def scale_for_durations(rule_text: str, factor: float) -> str:
    """Rule file text with every `for:` multiplied by `factor` (rounded up to whole seconds)."""
    data = yaml.safe_load(rule_text)
    for group in data["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = _seconds(duration_seconds(rule["for"]) * factor)
    return yaml.safe_dump(data, sort_keys=False, width=120)


# ---------------------------------------------------------------- the stack
class AlertingStack:
    """Receiver + Alertmanager + Prometheus on 127.0.0.1 with the shipped configs.

        with AlertingStack(targets=["127.0.0.1:9464"]) as stack:
            ... train ...
            stack.receiver.wait_for(lambda a: a.alertname == "MindFormersLossNotFinite")
    """

    def __init__(self, targets: Sequence[str], interval_seconds: float = 1.0,
                 out: TextIO | None = sys.stdout, workdir: str | Path | None = None,
                 jsonl_path: str | Path | None = None, verbose: bool = False,
                 receiver_auth: WebhookAuth | None = None,
                 webhook_http_config: dict[str, Any] | None = None) -> None:
        """`receiver_auth`: credentials the receiver requires; `webhook_http_config`: what
        Alertmanager sends them with (mfotel.alerting.auth.alertmanager_http_config)."""
        check_binaries()
        self.files = shipped_files()
        self.targets = list(targets)
        self.interval = _seconds(interval_seconds)
        self.for_factor = interval_seconds / SHIPPED_SCRAPE_SECONDS
        self._own_dir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="mfotel-alerting-"))
        self.receiver = AlertsReceiver(port=0, out=out, jsonl_path=jsonl_path, verbose=verbose,
                                       auth=receiver_auth)
        self.webhook_http_config = webhook_http_config
        self.alertmanager: Alertmanager | None = None
        self.prometheus: Prometheus | None = None

    def start(self) -> "AlertingStack":
        try:
            self.receiver.start()
            am_dir = self.workdir / "alertmanager"
            write_files(alertmanager_files(), am_dir)  # the templates beside the config
            self.alertmanager = Alertmanager(
                loopback_alertmanager_config(self.files["alertmanager"], self.receiver.url,
                                             self.webhook_http_config),
                workdir=am_dir).start()
            rules_dir = self.workdir / "rules"
            rules_dir.mkdir(parents=True, exist_ok=True)
            rule_paths = []
            for key, name in (("recording", rules_module.RECORDING_FILE),
                              ("alerts", rules_module.ALERTS_FILE)):
                path = rules_dir / name
                path.write_text(scale_for_durations(self.files[key], self.for_factor))
                rule_paths.append(path)
            self.prometheus = Prometheus(
                loopback_prometheus_config(self.files["prometheus"], self.targets,
                                           f"127.0.0.1:{self.alertmanager.port}", self.interval),
                rule_files=rule_paths, workdir=self.workdir / "prometheus").start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for server in (self.prometheus, self.alertmanager):
            if server is not None:
                server.stop()
        self.receiver.stop()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "AlertingStack":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def firing_alerts(self, job_name: str) -> list[dict]:
        """Prometheus' firing ALERTS series of `job_name` right now."""
        assert self.prometheus is not None
        return self.prometheus.query(f'ALERTS{{job_name="{job_name}", alertstate="firing"}}')


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
    """A MindSpore callback storing the unix time at which `step` ended into sink[step]."""
    from mindspore.train import Callback

    class StepClock(Callback):
        def on_train_step_end(self, run_context: Any) -> None:
            if int(run_context.original_args().cur_step_num) == step:
                sink[step] = time.time()
    return StepClock()


def run_alerting_demo(steps: int = 80, nan_at_step: int = 20, port: int | None = None,
                      job_name: str = "mfotel-alerting-demo", step_seconds: float = 0.1,
                      timeout: float = 60.0, out: TextIO = sys.stdout,
                      **demo_overrides: Any) -> AlertingDemoResult:
    """Start the stack, train with a NaN at `nan_at_step`, print the page when it arrives.

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
            f"receiver {stack.receiver.url}; scraping 127.0.0.1:{port} every {stack.interval}")
        say(f"training {steps} steps (job_name={job_name}), NaN injected at step {nan_at_step}")
        settings: dict[str, Any] = {"output": {"console": False}, "linger_seconds": 3.0,
                                    **demo_overrides}
        run_demo(steps=steps, port=port, nan_at_step=nan_at_step, job_name=job_name,
                 min_step_seconds=step_seconds,
                 extra_callbacks=(step_clock(nan_at_step, clock),), **settings)
        result.nan_step_time = clock.get(nan_at_step)
        result.page = stack.receiver.wait_for(
            lambda a: a.firing and a.alertname == "MindFormersLossNotFinite"
            and a.labels.get("job_name") == job_name, timeout=timeout)
        result.alerts = stack.receiver.received()
        latency = result.latency_seconds
        say(f"page received {latency:.1f} s after the NaN step" if latency is not None
            else "page received")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    import argparse
    parser = argparse.ArgumentParser(prog="python -m mfotel.demo.alerting",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--nan-at-step", type=int, default=20)
    parser.add_argument("--port", type=int, default=None, help="/metrics port (default: free)")
    parser.add_argument("--job-name", default="mfotel-alerting-demo")
    args = parser.parse_args(argv)
    try:
        run_alerting_demo(steps=args.steps, nan_at_step=args.nan_at_step, port=args.port,
                          job_name=args.job_name)
    except (RuntimeError, FileNotFoundError, TimeoutError) as error:
        print(f"mfotel alerting demo: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
