"""End to end: real MindSpore training -> real Prometheus -> real Alertmanager -> webhook.

The shipped prometheus.yml, alertmanager.yml and rule files run on 127.0.0.1 changed only where
an operator changes them (mfotel.localstack.alerting.OPERATOR_CHANGES): targets, addresses, webhook
URLs, and 1 s scrape and evaluation intervals. Routes, group_wait and every `for:` are the
shipped ones. A NaN injected at step k must page with the right job_name and rank; a healthy
run that completes (status 2) and exits must page nobody. Missing binaries fail with the
install command; they are never skipped.
"""
from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from mfotel.alerting import rules
from mfotel.demo.alerting import scrape_gate, step_clock
from mfotel.localstack.alerting import AlertingStack
from mfotel.localstack.servers import free_port
from tests.support.training import wait_at_step
from tests.support.waiting import settle, startup

NAN_JOB, HEALTHY_JOB = "e2e-nan", "e2e-healthy"
NAN_AT_STEP = 15
#: The scrape and evaluation interval of the stack (AlertingStack's default).
INTERVAL = 1.0
#: A page of an alert without `for:`: the next scrape, the next evaluation, Alertmanager's
#: group_wait (0s on the NaN route; the API shows an alert as soon as it arrives).
def paged() -> float:
    return settle(INTERVAL, INTERVAL)


@pytest.fixture(scope="module")
def ports() -> dict[str, int]:
    return {NAN_JOB: free_port(), HEALTHY_JOB: free_port()}


@pytest.fixture(scope="module")
def stack(ports: dict[str, int], tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[AlertingStack]:
    workdir = tmp_path_factory.mktemp("alerting")
    with AlertingStack([f"127.0.0.1:{port}" for port in ports.values()], out=None,
                       interval_seconds=int(INTERVAL), workdir=workdir,
                       jsonl_path=workdir / "alerts.jsonl") as running:
        yield running


def train(stack: AlertingStack, job_name: str, port: int, steps: int,
          nan_at_step: int | None = None, clock: dict[int, float] | None = None,
          held: tuple = ()) -> None:
    """`held`: further callbacks (after the monitor), e.g. holding a step."""
    from mfotel.demo.training import run_demo
    assert stack.prometheus is not None
    extra = list(held)
    if nan_at_step:
        # Held at the step before the NaN until Prometheus has scraped it, however loaded the
        # machine: the rules' increase() of the non-finite counters needs a sample from before.
        extra.append(scrape_gate(stack.prometheus, job_name, nan_at_step - 1,
                                 timeout=startup() + settle(INTERVAL)))
        if clock is not None:
            extra.append(step_clock(nan_at_step, clock))
    # linger: keep /metrics up until the scrape that served the final status
    run_demo(steps=steps, port=port, nan_at_step=nan_at_step, job_name=job_name,
             linger_seconds=settle(INTERVAL), min_step_seconds=0.1, extra_callbacks=tuple(extra),
             output={"console": False})


def alerts_seen(stack: AlertingStack, job_name: str) -> str:
    """What Alertmanager and Prometheus hold for `job_name` (for a failure's message)."""
    assert stack.alertmanager is not None and stack.prometheus is not None
    held = [(a["labels"]["alertname"], a["status"]) for a in stack.alertmanager.alerts()
            if a["labels"].get("job_name") == job_name]
    counted = stack.prometheus.query(
        f'mindformers_train_nonfinite_total{{job_name="{job_name}"}}[5m]')
    return f"Alertmanager: {held}\nPrometheus non-finite counters: {counted}"


@pytest.mark.slow
def test_nan_loss_pages_with_job_name_and_rank(stack: AlertingStack, ports: dict[str, int],
                                               in_tmp: None,
                                               record_property: pytest.RecordProperty) -> None:
    clock: dict[int, float] = {}
    # Prometheus stores the loss as /metrics shows it, NaN: PromQL's NaN test finds it (held
    # two steps after the NaN until a scrape has brought it in)
    loss = f'mindformers_train_loss{{job_name="{NAN_JOB}"}}'
    stored: list[dict] = []
    nan_stored = wait_at_step(
        NAN_AT_STEP + 2, lambda: stored.extend(stack.prometheus.query(f"{loss} != {loss}"))
        or stored, settle(INTERVAL), "Prometheus to store the NaN loss")
    train(stack, NAN_JOB, ports[NAN_JOB], steps=50, nan_at_step=NAN_AT_STEP, clock=clock,
          held=(nan_stored,))
    assert [(r["metric"]["rank"], r["value"][1]) for r in stored] == [("0", "NaN")]

    page = stack.receiver.wait_for(
        lambda a: a.firing and a.alertname == "MindFormersLossNotFinite"
        and a.labels.get("job_name") == NAN_JOB, timeout=paged())
    assert page.labels["rank"] == "0"
    assert page.labels["severity"] == "critical"
    assert page.receiver == "mfotel-pager"
    assert (f"The loss of job {NAN_JOB} rank 0 went NaN/Inf first, at step {NAN_AT_STEP} "
            in page.annotations["description"])
    assert page.annotations["runbook_url"] == rules.RulesConfig().runbook_url(page.alertname)
    assert page.line().startswith(
        f"[FIRING critical] MindFormersLossNotFinite job_name={NAN_JOB} rank=0: ")

    latency = page.received_at - clock[NAN_AT_STEP]
    record_property("nan_to_notification_seconds", round(latency, 2))
    print(f"\nNaN at step {NAN_AT_STEP} -> notification in {latency:.2f} s "
          f"(scrape and evaluation every {stack.interval})")
    assert 0 < latency < paged()   # a bound, not a measure: benchmarks/paging_latency.py measures

    # The NaN also makes the gradient norm non-finite, which the loss page explains: the
    # grad-norm alert (for weights turning NaN behind a finite loss) stays out of it, neither
    # pending in Prometheus nor in Alertmanager, with the evaluations since the NaN done.
    assert stack.alertmanager is not None and stack.prometheus is not None
    stack.prometheus.wait_for_evaluation(after=time.time() + INTERVAL, timeout=settle(INTERVAL))
    grad = f'ALERTS{{alertname="MindFormersGradNormNotFinite", job_name="{NAN_JOB}"}}'
    assert stack.prometheus.query(grad) == [], alerts_seen(stack, NAN_JOB)
    assert [a for a in stack.alertmanager.alerts()
            if a["labels"].get("alertname") == "MindFormersGradNormNotFinite"] == []


@pytest.mark.slow
def test_healthy_run_that_completes_pages_nobody(stack: AlertingStack, ports: dict[str, int],
                                                 in_tmp: None) -> None:
    """With the shipped `for:` durations (minutes), waiting them out is not needed: once the
    finished run's series are stale, the only alert inputs left are last-seen values (status
    2, progress 1), so an alert that is neither pending nor firing then never fires."""
    assert stack.prometheus is not None
    train(stack, HEALTHY_JOB, ports[HEALTHY_JOB], steps=40)

    selector = f'job_name="{HEALTHY_JOB}"'
    status = stack.prometheus.wait_for(
        f"last_over_time(mindformers_train_status{{{selector}}}[5m]) == 2",
        timeout=settle(INTERVAL))
    assert status, "Prometheus never scraped status 2 (completed)"
    stack.prometheus.wait_for(f'up{{instance="127.0.0.1:{ports[HEALTHY_JOB]}"}} == 0',
                              timeout=settle(INTERVAL))   # the process has exited: stale series
    stack.prometheus.wait_for_evaluation(after=time.time() + INTERVAL, timeout=settle(INTERVAL))

    assert stack.prometheus.query(f"ALERTS{{{selector}}}") == [], "pending or firing after the end"
    fired = stack.prometheus.query(
        f'count_over_time(ALERTS{{{selector}, alertstate="firing"}}[10m])')
    assert fired == [], f"alerts fired for the healthy run: {fired}"
    assert stack.receiver.received(lambda a: a.labels.get("job_name") == HEALTHY_JOB) == []
