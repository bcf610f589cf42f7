"""`mfotel demo --with-alerting`: the shipped Prometheus and Alertmanager configs on loopback,
a NaN injected into a real MindSpore run, and the page arriving at the webhook receiver.

    from mfotel.demo.alerting import run_alerting_demo
    run_alerting_demo(steps=60, nan_at_step=20)

`AlertingStack` is the reusable part (tests and benchmarks use it): it starts the alerts
receiver, Alertmanager and Prometheus with the shipped `alertmanager.yml`, `prometheus.yml`
and rule files (package data, as `mfotel assets` writes them), changed only where an operator wiring
them changes them (`OPERATOR_CHANGES`): the scrape targets, the Alertmanager address, the
webhook URLs, and the scrape and evaluation intervals (1 s here, 15 s shipped). Rules, routes,
group_wait and every `for:` are the shipped ones.
"""
from __future__ import annotations

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


#: What AlertingStack changes in the shipped files, in the words the demo prints.
OPERATOR_CHANGES = (
    "prometheus.yml: scrape_interval and evaluation_interval {interval} (shipped: 15s), the "
    "scrape targets and the Alertmanager address",
    "alertmanager.yml: the webhook URLs (the receiver on loopback)",
    "rules, routes, group_wait and every `for:` as shipped",
)


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
def operator_prometheus_config(text: str, targets: Sequence[str], alertmanager: str,
                               interval: str = "1s") -> str:
    """The shipped prometheus.yml as an operator wires it: the static scrape job pointed at
    `targets`, Alertmanager at `alertmanager`, scrape and evaluation every `interval`.

    Rule files keep their paths (relative to the config file), the file_sd job stays.
    """
    config = yaml.safe_load(text)
    config["global"].update(scrape_interval=interval, evaluation_interval=interval)
    config["alerting"]["alertmanagers"] = [{"static_configs": [{"targets": [alertmanager]}]}]
    job = next(j for j in config["scrape_configs"] if "static_configs" in j)
    job["static_configs"] = [{"targets": list(targets),
                              "labels": job["static_configs"][0].get("labels", {})}]
    return yaml.safe_dump(config, sort_keys=False)


def operator_alertmanager_config(text: str, webhook_url: str,
                                 http_config: dict[str, Any] | None = None) -> str:
    """The shipped alertmanager.yml with every webhook sent to `webhook_url` (and with
    `http_config`, e.g. the receiver's credentials, on every webhook), nothing else."""
    config = yaml.safe_load(text)
    for receiver in config["receivers"]:
        for webhook in receiver.get("webhook_configs", []):
            webhook["url"] = webhook_url
            if http_config:
                webhook["http_config"] = http_config
    return yaml.safe_dump(config, sort_keys=False)


# ---------------------------------------------------------------- the stack
class AlertingStack:
    """Receiver + Alertmanager + Prometheus on 127.0.0.1 with the shipped configs.

        with AlertingStack(targets=["127.0.0.1:9464"]) as stack:
            ... train ...
            stack.receiver.wait_for(lambda a: a.alertname == "MindFormersLossNotFinite")
    """

    def __init__(self, targets: Sequence[str], interval_seconds: int = 1,
                 out: TextIO | None = sys.stdout, workdir: str | Path | None = None,
                 jsonl_path: str | Path | None = None, verbose: bool = False,
                 receiver_auth: WebhookAuth | None = None,
                 webhook_http_config: dict[str, Any] | None = None) -> None:
        """`receiver_auth`: credentials the receiver requires; `webhook_http_config`: what
        Alertmanager sends them with (mfotel.alerting.auth.alertmanager_http_config)."""
        check_binaries()
        self.files = shipped_files()
        self.targets = list(targets)
        self.interval = f"{int(interval_seconds)}s"
        self._own_dir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="mfotel-alerting-"))
        self.receiver = AlertsReceiver(port=0, out=out, jsonl_path=jsonl_path, verbose=verbose,
                                       auth=receiver_auth)
        self.webhook_http_config = webhook_http_config
        self.alertmanager: Alertmanager | None = None
        self.prometheus: Prometheus | None = None

    @property
    def changes(self) -> list[str]:
        """What differs from the shipped files, one line per file."""
        return [line.format(interval=self.interval) for line in OPERATOR_CHANGES]

    def start(self) -> "AlertingStack":
        try:
            self.receiver.start()
            am_dir = self.workdir / "alertmanager"
            write_files(alertmanager_files(), am_dir)  # the templates beside the config
            self.alertmanager = Alertmanager(
                operator_alertmanager_config(self.files["alertmanager"], self.receiver.url,
                                             self.webhook_http_config),
                workdir=am_dir).start()
            prom_dir = self.workdir / "prometheus"
            # the rule files where the shipped config names them, relative to it
            (prom_dir / "rules").mkdir(parents=True, exist_ok=True)
            for key, name in (("recording", rules_module.RECORDING_FILE),
                              ("alerts", rules_module.ALERTS_FILE)):
                (prom_dir / "rules" / name).write_text(self.files[key])
            self.prometheus = Prometheus(
                operator_prometheus_config(self.files["prometheus"], self.targets,
                                           f"127.0.0.1:{self.alertmanager.port}", self.interval),
                workdir=prom_dir).start()
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
