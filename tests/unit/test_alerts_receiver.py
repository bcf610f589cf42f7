"""The webhook receiver over real HTTP, with Alertmanager-shaped payloads."""
from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from mfotel.alerting.receiver import AlertsReceiver, ReceivedAlert, parse_notification
from tests.support import http
from tests.support.paths import ROOT

RUNBOOK = "https://github.com/mfotel/mfotel/blob/main/prometheus/runbook.md"


def notification(status: str = "firing", rank: str = "0",
                 alertname: str = "MindFormersLossNotFinite",
                 severity: str = "critical") -> dict:
    """A webhook body as Alertmanager 0.25 posts it (version 4)."""
    labels = {"alertname": alertname, "severity": severity, "job": "mindformers",
              "instance": "127.0.0.1:9464", "job_name": "llama", "rank": rank}
    return {
        "receiver": "mfotel-pager", "status": status, "version": "4",
        "groupKey": f'{{}}/{{severity="critical"}}:{{alertname="{alertname}", job_name="llama"}}',
        "truncatedAlerts": 0, "externalURL": "http://127.0.0.1:9093",
        "groupLabels": {"alertname": alertname, "job_name": "llama"},
        "commonLabels": labels, "commonAnnotations": {},
        "alerts": [{
            "status": status, "labels": labels,
            "annotations": {"summary": "Training loss is NaN or Inf.",
                            "description": f"The loss of job llama rank {rank} is not finite.",
                            "runbook_url": f"{RUNBOOK}#{alertname.lower()}"},
            "startsAt": "2025-01-01T00:00:00Z",
            "endsAt": "0001-01-01T00:00:00Z" if status == "firing" else "2025-01-01T00:05:00Z",
            "generatorURL": "http://127.0.0.1:9090/graph", "fingerprint": "abc" + rank,
        }],
    }


def post(url: str, body: bytes) -> int:
    return http.post(url, body, headers={"Content-Type": "application/json"}, timeout=5).status


@pytest.fixture
def receiver(tmp_path: Path):
    out = io.StringIO()
    with AlertsReceiver(port=0, jsonl_path=tmp_path / "alerts.jsonl", out=out) as rec:
        rec.test_out = out   # type: ignore[attr-defined]
        yield rec


def test_firing_and_resolved_alerts_print_one_line_each(receiver: AlertsReceiver) -> None:
    assert post(receiver.url, json.dumps(notification("firing")).encode()) == 200
    assert post(receiver.url, json.dumps(notification("resolved")).encode()) == 200

    lines = receiver.test_out.getvalue().splitlines()   # type: ignore[attr-defined]
    assert lines == [
        "[FIRING critical] MindFormersLossNotFinite job_name=llama rank=0: "
        "Training loss is NaN or Inf.",
        "[RESOLVED] MindFormersLossNotFinite job_name=llama rank=0: Training loss is NaN or Inf.",
    ]


def test_received_alerts_are_kept_in_memory_and_appended_as_json_lines(
        receiver: AlertsReceiver) -> None:
    body = notification()
    body["alerts"].append(notification(rank="3")["alerts"][0])
    post(receiver.url, json.dumps(body).encode())

    alert = receiver.wait_for(lambda a: a.labels.get("rank") == "3", timeout=5)
    assert alert.firing and alert.alertname == "MindFormersLossNotFinite"
    assert alert.labels["job_name"] == "llama" and alert.receiver == "mfotel-pager"
    assert alert.annotations["runbook_url"].endswith("#mindformerslossnotfinite")
    assert receiver.notifications == 1 and len(receiver.received()) == 2

    rows = [json.loads(line) for line in
            receiver.jsonl_path.read_text().splitlines()]   # type: ignore[union-attr]
    assert [row["labels"]["rank"] for row in rows] == ["0", "3"]
    assert rows[0]["status"] == "firing" and rows[0]["received_at"] > 0


def test_get_alerts_lists_what_was_received(receiver: AlertsReceiver) -> None:
    post(receiver.url, json.dumps(notification()).encode())
    base = receiver.url.rsplit("/", 1)[0]
    listed = http.get_json(f"{base}/alerts")
    assert [a["labels"]["alertname"] for a in listed] == ["MindFormersLossNotFinite"]
    assert http.get(f"{base}/-/healthy").status == 200


def test_malformed_bodies_are_rejected_with_400_and_not_recorded(
        receiver: AlertsReceiver) -> None:
    assert post(receiver.url, b"not json") == 400
    assert post(receiver.url, json.dumps({"status": "firing"}).encode()) == 400
    assert post(receiver.url, json.dumps({"alerts": ["x"]}).encode()) == 400
    assert post(receiver.url, b"") == 400
    assert receiver.received() == [] and receiver.notifications == 0


def test_wait_for_times_out_naming_what_arrived(receiver: AlertsReceiver) -> None:
    post(receiver.url, json.dumps(notification(alertname="MindFormersLossSpike",
                                               severity="warning")).encode())
    with pytest.raises(TimeoutError, match="MindFormersLossSpike"):
        receiver.wait_for(lambda a: a.alertname == "MindFormersRankDown", timeout=0.2)


def test_concurrent_posts_are_all_recorded(receiver: AlertsReceiver) -> None:
    from concurrent.futures import ThreadPoolExecutor
    bodies = [json.dumps(notification(rank=str(r))).encode() for r in range(16)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        codes = list(pool.map(lambda b: post(receiver.url, b), bodies))
    assert codes == [200] * 16
    assert sorted(int(a.labels["rank"]) for a in receiver.received()) == list(range(16))


def test_lines_without_severity_or_rank_stay_readable() -> None:
    alert = ReceivedAlert("firing", {"alertname": "Watchdog"}, {"summary": "ok"})
    assert alert.line() == "[FIRING] Watchdog: ok"
    [parsed] = parse_notification({"status": "resolved", "alerts": [
        {"labels": {"alertname": "X", "job_name": "j"}, "annotations": {"description": "d"}}]})
    assert parsed.line() == "[RESOLVED] X job_name=j: d"


def test_command_line_receiver_prints_alerts(tmp_path: Path) -> None:
    from mfotel.localstack.servers import free_port
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "mfotel.alerting.receiver", "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=ROOT)
    try:
        assert "listening on" in process.stderr.readline()   # bound before this line
        assert post(f"http://127.0.0.1:{port}/alerts",
                    json.dumps(notification(rank="5")).encode()) == 200
        line = process.stdout.readline()
        assert line.startswith("[FIRING critical] MindFormersLossNotFinite job_name=llama rank=5")
    finally:
        process.terminate()
        process.wait(timeout=10)
