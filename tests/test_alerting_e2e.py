"""End to end: real MindSpore training -> real Prometheus -> real Alertmanager -> webhook.

The shipped prometheus.yml, alertmanager.yml and rule files run on 127.0.0.1 changed only where
an operator changes them (mfotel.demo.alerting.OPERATOR_CHANGES): targets, addresses, webhook
URLs, and 1 s scrape and evaluation intervals. Routes, group_wait and every `for:` are the
shipped ones. A NaN injected at step k must page with the right job_name and rank; a healthy
run that completes (status 2) and exits must page nobody. Missing binaries fail with the
install command; they are never skipped.
"""
from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import yaml

from mfotel.alerting import rules
from mfotel.alerting.fastpage import loss_alert
from mfotel.demo.alerting import (AlertingStack, operator_prometheus_config, shipped_files,
                                  step_clock)
from mfotel.demo.stack import find_binary, free_port

ROOT = Path(__file__).resolve().parents[1]
NAN_JOB, HEALTHY_JOB = "e2e-nan", "e2e-healthy"
NAN_AT_STEP = 15


@pytest.fixture(scope="module")
def ports() -> dict[str, int]:
    return {NAN_JOB: free_port(), HEALTHY_JOB: free_port()}


@pytest.fixture(scope="module")
def stack(ports: dict[str, int], tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[AlertingStack]:
    workdir = tmp_path_factory.mktemp("alerting")
    with AlertingStack([f"127.0.0.1:{port}" for port in ports.values()], out=None,
                       workdir=workdir, jsonl_path=workdir / "alerts.jsonl") as running:
        yield running


def train(job_name: str, port: int, steps: int, nan_at_step: int | None = None,
          clock: dict[int, float] | None = None) -> None:
    from mfotel.demo.training import run_demo
    extra = (step_clock(nan_at_step, clock),) if nan_at_step and clock is not None else ()
    # linger: keep /metrics up for a few scrapes after the end, so status 2 is seen
    run_demo(steps=steps, port=port, nan_at_step=nan_at_step, job_name=job_name,
             linger_seconds=3.0, min_step_seconds=0.1, extra_callbacks=extra,
             output={"console": False})


@pytest.mark.slow
def test_nan_loss_pages_with_job_name_and_rank(stack: AlertingStack, ports: dict[str, int],
                                               in_tmp: None,
                                               record_property: pytest.RecordProperty) -> None:
    clock: dict[int, float] = {}
    train(NAN_JOB, ports[NAN_JOB], steps=50, nan_at_step=NAN_AT_STEP, clock=clock)

    page = stack.receiver.wait_for(
        lambda a: a.firing and a.alertname == "MindFormersLossNotFinite"
        and a.labels.get("job_name") == NAN_JOB, timeout=60)
    assert page.labels["rank"] == "0"
    assert page.labels["severity"] == "critical"
    assert page.receiver == "mfotel-pager"
    assert f"job {NAN_JOB} rank 0 is not finite" in page.annotations["description"]
    assert f"First non-finite loss at step {NAN_AT_STEP}." in page.annotations["description"]
    assert page.annotations["runbook_url"] == rules.RulesConfig().runbook_url(page.alertname)
    assert page.line().startswith(
        f"[FIRING critical] MindFormersLossNotFinite job_name={NAN_JOB} rank=0: ")

    latency = page.received_at - clock[NAN_AT_STEP]
    record_property("nan_to_notification_seconds", round(latency, 2))
    print(f"\nNaN at step {NAN_AT_STEP} -> notification in {latency:.2f} s "
          f"(scrape and evaluation every {stack.interval})")
    assert 0 < latency < 30   # a bound for a loaded machine; benchmarks/paging_latency.py measures

    # The NaN also makes the gradient norm non-finite: that warning reaches Alertmanager and
    # is inhibited by the critical page of the same job_name.
    warning = wait_for_am_alert(stack, "MindFormersGradNormNotFinite", NAN_JOB,
                                lambda a: a["status"]["state"] == "suppressed")
    assert warning["status"]["inhibitedBy"], warning


def wait_for_am_alert(stack: AlertingStack, alertname: str, job_name: str,
                      predicate: Callable[[dict], bool], timeout: float = 30) -> dict:
    """Poll Alertmanager's API until an alert of `job_name` satisfies `predicate`."""
    assert stack.alertmanager is not None
    deadline = time.monotonic() + timeout
    seen: list[dict] = []
    while time.monotonic() < deadline:
        seen = [a for a in stack.alertmanager.alerts()
                if a["labels"].get("alertname") == alertname
                and a["labels"].get("job_name") == job_name]
        for alert in seen:
            if predicate(alert):
                return alert
        time.sleep(0.25)
    raise TimeoutError(f"{alertname} for {job_name} never matched; last seen: {seen}")


@pytest.mark.slow
def test_healthy_run_that_completes_pages_nobody(stack: AlertingStack, ports: dict[str, int],
                                                 in_tmp: None) -> None:
    """With the shipped `for:` durations (minutes), waiting them out is not needed: once the
    finished run's series are stale, the only alert inputs left are last-seen values (status
    2, progress 1), so an alert that is neither pending nor firing then never fires."""
    assert stack.prometheus is not None
    train(HEALTHY_JOB, ports[HEALTHY_JOB], steps=40)

    selector = f'job_name="{HEALTHY_JOB}"'
    status = stack.prometheus.wait_for(
        f"last_over_time(mindformers_train_status{{{selector}}}[5m]) == 2", timeout=30)
    assert status, "Prometheus never scraped status 2 (completed)"
    stack.prometheus.wait_for(f'up{{instance="127.0.0.1:{ports[HEALTHY_JOB]}"}} == 0',
                              timeout=30)   # the process has exited: its series are stale
    stack.prometheus.wait_for_evaluation(after=time.time() + 1, timeout=30)

    assert stack.prometheus.query(f"ALERTS{{{selector}}}") == [], "pending or firing after the end"
    fired = stack.prometheus.query(
        f'count_over_time(ALERTS{{{selector}, alertstate="firing"}}[10m])')
    assert fired == [], f"alerts fired for the healthy run: {fired}"
    assert stack.receiver.received(lambda a: a.labels.get("job_name") == HEALTHY_JOB) == []


# ---------------------------------------------------------------- the shipped files

def test_shipped_prometheus_yml_loads_with_only_the_intervals_lowered(tmp_path: Path) -> None:
    """An operator lowering both intervals to 1s changes nothing else (no scrape_timeout)."""
    promtool = find_binary(("promtool",))
    assert promtool, "promtool not found on PATH; install it: apt-get install prometheus"
    files = shipped_files()
    config = yaml.safe_load(files["prometheus"])
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    (tmp_path / "rules").mkdir()
    for key, name in (("recording", rules.RECORDING_FILE), ("alerts", rules.ALERTS_FILE)):
        (tmp_path / "rules" / name).write_text(files[key])
    result = subprocess.run([promtool, "check", "config", str(tmp_path / "prometheus.yml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    # and what the demo and the benchmark run differs from it in targets and addresses only
    ours = yaml.safe_load(operator_prometheus_config(files["prometheus"], ["127.0.0.1:1"],
                                                     "127.0.0.1:2"))
    assert ours["global"] == config["global"] and ours["rule_files"] == config["rule_files"]


def _route(config: dict[str, Any], labels: dict[str, str]) -> dict[str, Any]:
    """The first child route of the root whose `name = "value"` matchers all match `labels`
    (the shipped routes use only those), with the root's settings inherited."""
    root = config["route"]
    for child in root.get("routes", []):
        pairs = [m.split("=", 1) for m in child.get("matchers", [])]
        if all(labels.get(k.strip()) == v.strip().strip('"') for k, v in pairs):
            return {**{k: v for k, v in root.items() if k != "routes"}, **child}
    return root


@pytest.mark.parametrize("path", ["alertmanager/alertmanager.yml", "docker/alertmanager.yml"])
def test_nan_alert_routes_without_group_wait_and_other_alerts_keep_theirs(path: str) -> None:
    config = yaml.safe_load((ROOT / path).read_text())
    posted = loss_alert("llama", 0, 1, float("nan"))["labels"]   # what the fast path posts
    nan_route = _route(config, posted)
    assert nan_route["group_wait"] == "0s" and nan_route["receiver"] == "mfotel-pager"
    assert nan_route["group_by"] == ["job_name", "alertname"]
    stall = _route(config, {"alertname": "MindFormersTrainingStalled", "severity": "critical"})
    assert stall["group_wait"] == "10s" and stall["receiver"] == "mfotel-pager"
    spike = _route(config, {"alertname": "MindFormersLossSpike", "severity": "warning"})
    assert spike["group_wait"] == "30s" and spike["receiver"] == "mfotel-tickets"
    amtool = find_binary(("amtool",))
    assert amtool, "amtool not found on PATH; install it: apt-get install prometheus-alertmanager"
    labels = [f"{k}={v}" for k, v in posted.items()]
    routed = subprocess.run([amtool, "config", "routes", "test", f"--config.file={ROOT / path}",
                             *labels], capture_output=True, text=True, timeout=60)
    assert routed.stdout.strip() == "mfotel-pager", routed.stdout + routed.stderr
