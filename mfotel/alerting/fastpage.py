"""Optional fast path: post the loss-not-finite alert straight to Alertmanager.

Paging then does not wait for the next scrape and rule evaluation. The alert carries exactly
the labels of the `MindFormersLossNotFinite` rule (`max by (job_name, rank)` plus severity),
so Alertmanager deduplicates it with the rule's own alert. Posting runs in a daemon thread:
a slow or absent Alertmanager never stalls training.

An Alertmanager behind basic auth (its `--web.config.file`) is written as Alertmanager users
write it, `http://user:password@alertmanager:9093` (reserved characters percent-encoded): the
credentials go in an `Authorization: Basic` header, never in the request line, and every
message shows the URL with the password masked.
"""
from __future__ import annotations

import base64
import json
import logging
import math
import threading
import urllib.request
from collections.abc import Callable
from datetime import datetime, timezone
from urllib.parse import unquote, urlsplit, urlunsplit

from ..config.redact import redact_text, redact_url
from ..listeners import StepListener, StepSample
from .rules import RulesConfig

log = logging.getLogger("mfotel")
ALERTNAME = "MindFormersLossNotFinite"


def loss_alert(job_name: str, rank: int, step: int, value: float) -> dict:
    """The Alertmanager v2 alert for a non-finite loss at `step` (same labels as the rule)."""
    runbook = RulesConfig().runbook_url(ALERTNAME)
    return {
        "labels": {"alertname": ALERTNAME, "severity": "critical", "job_name": job_name,
                   "rank": str(rank)},
        "annotations": {
            "summary": "Training loss is NaN or Inf.",
            "description": f"The loss of job {job_name} rank {rank} is {value} at step {step} "
                           f"(posted by the training process). First non-finite loss at step "
                           f"{step}.",
            "runbook_url": runbook},
        "startsAt": datetime.now(timezone.utc).isoformat(),
    }


def split_credentials(url: str) -> tuple[str, str | None]:
    """(`url` without its `user:password@`, the Basic Authorization header value or None)."""
    parts = urlsplit(url)
    userinfo, at, hostport = parts.netloc.rpartition("@")
    if not at:
        return url, None
    user, _, password = userinfo.partition(":")
    token = base64.b64encode(f"{unquote(user)}:{unquote(password)}".encode()).decode("ascii")
    return urlunsplit(parts._replace(netloc=hostport)), f"Basic {token}"


def post_alerts(url: str, alerts: list[dict], timeout: float = 5.0) -> None:
    """POST to `{url}/api/v2/alerts` (credentials in the URL: basic auth); raises on failure."""
    base, authorization = split_credentials(url)
    headers = {"Content-Type": "application/json"}
    if authorization:
        headers["Authorization"] = authorization
    request = urllib.request.Request(f"{base.rstrip('/')}/api/v2/alerts",
                                     data=json.dumps(alerts).encode(), method="POST",
                                     headers=headers)
    with urllib.request.urlopen(request, timeout=timeout) as response:
        response.read()


def page_async(url: str, alert: dict, on_error: Callable[[], None]) -> threading.Thread:
    """Post `alert` from a daemon thread; a failure is logged and counted, never raised."""
    def run() -> None:
        try:
            post_alerts(url, [alert])
        except Exception as exc:  # noqa: BLE001 - paging must never break training
            on_error()
            log.warning("mfotel: could not post the alert to Alertmanager at %s (%s); the "
                        "Prometheus rule will still page", redact_url(url), redact_text(str(exc)))
    thread = threading.Thread(target=run, name="mfotel-fastpage", daemon=True)
    thread.start()
    return thread


class FastPage(StepListener):
    """Pages at the run's first non-finite loss (attached by the callback when
    `alertmanager_url` is set); `on_error()` counts a post that failed."""

    def __init__(self, url: str, job_name: str, rank: int, on_error: Callable[[], None]) -> None:
        self.url, self.job_name, self.rank, self.on_error = url, job_name, rank, on_error
        self.posted = False

    def on_nonfinite(self, sample: StepSample) -> None:
        loss = sample.outputs.loss
        if self.posted or loss is None or math.isfinite(loss):
            return
        self.posted = True
        page_async(self.url, loss_alert(self.job_name, self.rank, sample.step, loss),
                   self.on_error)
