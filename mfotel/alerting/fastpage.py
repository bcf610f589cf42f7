"""Optional fast path: post the loss-not-finite alert straight to Alertmanager.

Paging then does not wait for the next scrape and rule evaluation. The alert carries exactly
the labels of the `MindFormersLossNotFinite` rule (`max by (job_name, rank)` plus severity),
so Alertmanager deduplicates it with the rule's own alert. Posting runs in a daemon thread:
a slow or absent Alertmanager never stalls training.
"""
from __future__ import annotations

import json
import logging
import threading
import urllib.request
from datetime import datetime, timezone
from typing import Callable

from ..config.redact import redact_text, redact_url
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


def post_alerts(url: str, alerts: list[dict], timeout: float = 5.0) -> None:
    """POST to `{url}/api/v2/alerts`; raises on failure."""
    request = urllib.request.Request(f"{url.rstrip('/')}/api/v2/alerts",
                                     data=json.dumps(alerts).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
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
