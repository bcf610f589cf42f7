"""The shipped Prometheus and Alertmanager configs running on loopback, with a receiver.

    with AlertingStack(targets=["127.0.0.1:9464"]) as stack:
        ... train ...
        stack.receiver.wait_for(lambda a: a.alertname == "MindFormersLossNotFinite")

`AlertingStack` starts the alerts receiver, Alertmanager and Prometheus with the shipped
`alertmanager.yml`, `prometheus.yml` and rule files (package data, as `mfotel assets` writes
them), changed only where an operator wiring them changes them (`OPERATOR_CHANGES`): the scrape
targets, the Alertmanager address, the webhook URLs, and the scrape and evaluation intervals
(1 s here, 15 s shipped). Rules, routes, group_wait and every `for:` are the shipped ones.
`mfotel demo --with-alerting`, the cluster simulation and the tests use it.
"""
from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import yaml

from ..alerting import rules as rules_module
from ..alerting.receiver import AlertsReceiver
from ..assets import alertmanager_files, prometheus_files, rule_files, write_files
from ..endpoint.auth import Credentials
from .servers import (
    ALERTMANAGER_BINARIES,
    PROMETHEUS_BINARIES,
    Alertmanager,
    Prometheus,
    find_binary,
    free_port,
)

#: The shipped prometheus.yml's job scraping Prometheus itself (mfotel.alerting.rule_health).
SELF_JOB = "prometheus"


def self_scrape_job(config: dict[str, Any], address: str) -> dict[str, Any]:
    """The `SELF_JOB` scrape job of a loaded prometheus.yml, pointed at `address` (host:port,
    where that Prometheus listens: its rule-health alerts name it)."""
    own = next(job for job in config["scrape_configs"] if job["job_name"] == SELF_JOB)
    own["static_configs"] = [{"targets": [address]}]
    return own
#: What AlertingStack changes in the shipped files, in the words the demo prints.
OPERATOR_CHANGES = (
    "prometheus.yml: scrape_interval and evaluation_interval {interval} (shipped: 15s), the "
    "scrape targets (its own address too) and the Alertmanager address",
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
                               interval: str = "1s", itself: str | None = None) -> str:
    """The shipped prometheus.yml as an operator wires it: the static scrape job pointed at
    `targets`, Alertmanager at `alertmanager`, scrape and evaluation every `interval`, and its
    `prometheus` job at its own address `itself` (host:port) when given.

    Rule files keep their paths (relative to the config file), the file_sd job stays.
    """
    config = yaml.safe_load(text)
    config["global"].update(scrape_interval=interval, evaluation_interval=interval)
    config["alerting"]["alertmanagers"] = [{"static_configs": [{"targets": [alertmanager]}]}]
    job = next(j for j in config["scrape_configs"] if "static_configs" in j)
    job["static_configs"] = [{"targets": list(targets),
                              "labels": job["static_configs"][0].get("labels", {})}]
    if itself is not None:
        self_scrape_job(config, itself)
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

    def __init__(self, targets: Sequence[str], interval_seconds: float = 1,
                 out: TextIO | None = sys.stdout, workdir: str | Path | None = None,
                 jsonl_path: str | Path | None = None, verbose: bool = False,
                 receiver_auth: Credentials | None = None,
                 webhook_http_config: dict[str, Any] | None = None) -> None:
        """`receiver_auth`: credentials the receiver requires; `webhook_http_config`: what
        Alertmanager sends them with (mfotel.alerting.credentials.alertmanager_http_config)."""
        check_binaries()
        self.files = shipped_files()
        self.targets = list(targets)
        self.interval = f"{interval_seconds:g}s"
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

    def start_alertmanager(self) -> Alertmanager:
        """The receiver, then Alertmanager with the shipped config, paging the receiver."""
        self.receiver.start()
        am_dir = self.workdir / "alertmanager"
        write_files(alertmanager_files(), am_dir)  # the templates beside the config
        self.alertmanager = Alertmanager(
            operator_alertmanager_config(self.files["alertmanager"], self.receiver.url,
                                         self.webhook_http_config),
            workdir=am_dir).start()
        return self.alertmanager

    def start(self) -> AlertingStack:
        try:
            alertmanager = self.start_alertmanager()
            prom_dir = self.workdir / "prometheus"
            # the rule files where the shipped config names them, relative to it
            (prom_dir / "rules").mkdir(parents=True, exist_ok=True)
            for key, name in (("recording", rules_module.RECORDING_FILE),
                              ("alerts", rules_module.ALERTS_FILE)):
                (prom_dir / "rules" / name).write_text(self.files[key])
            port = free_port()
            self.prometheus = Prometheus(
                operator_prometheus_config(self.files["prometheus"], self.targets,
                                           f"127.0.0.1:{alertmanager.port}", self.interval,
                                           itself=f"127.0.0.1:{port}"),
                workdir=prom_dir, port=port).start()
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

    def __enter__(self) -> AlertingStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
