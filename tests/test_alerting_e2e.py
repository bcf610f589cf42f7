"""End to end: real MindSpore training -> real Prometheus -> real Alertmanager -> webhook.

The shipped prometheus.yml, alertmanager.yml and rule files run on 127.0.0.1 with the
intervals shortened (scrape/evaluation 1 s, group_wait 0 s, every `for:` divided by 15, as
the scrape interval is). A NaN injected at step k must page with the right job_name and rank;
a healthy run that completes (status 2) and exits must page nobody. Missing binaries fail
with the install command; they are never skipped.
"""
from __future__ import annotations

import time
from typing import Callable, Iterator

import pytest

from mfotel.alerting import rules
from mfotel.demo.alerting import AlertingStack, duration_seconds, step_clock
from mfotel.demo.stack import free_port

pytestmark = pytest.mark.slow

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
    assert 0 < latency < 30

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


def test_healthy_run_that_completes_pages_nobody(stack: AlertingStack, ports: dict[str, int],
                                                 in_tmp: None) -> None:
    assert stack.prometheus is not None
    train(HEALTHY_JOB, ports[HEALTHY_JOB], steps=40)

    selector = f'job_name="{HEALTHY_JOB}"'
    status = stack.prometheus.wait_for(
        f"last_over_time(mindformers_train_status{{{selector}}}[5m]) == 2", timeout=30)
    assert status, "Prometheus never scraped status 2 (completed)"
    stack.prometheus.wait_for(f'up{{instance="127.0.0.1:{ports[HEALTHY_JOB]}"}} == 0',
                              timeout=30)   # the process has exited: its series are stale

    # Everything that could fire for a finished run (rank down, failed, stalled) must have
    # had time to: wait past the longest scaled `for:` of those alerts, plus a margin.
    longest_for = max(duration_seconds(getattr(rules.RulesConfig(), name))
                      for name in ("rank_down_for", "stall_for")) * stack.for_factor
    with pytest.raises(TimeoutError):
        unexpected = stack.receiver.wait_for(lambda a: a.labels.get("job_name") == HEALTHY_JOB,
                                             timeout=longest_for + 10)
        pytest.fail(f"a healthy, completed run paged: {unexpected.line()}")
    fired = stack.prometheus.query(
        f'count_over_time(ALERTS{{{selector}, alertstate="firing"}}[10m])')
    assert fired == [], f"alerts fired for the healthy run: {fired}"
