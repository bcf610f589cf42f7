"""The alerts receiver keeps answering Alertmanager while unauthenticated clients hold sockets.

The real `mfotel alerts-receiver` (a child process) acts on alerts behind a bearer token; an
attacker process holds idle TCP connections, re-opened as soon as the receiver closes them,
from one loopback address or from many (127.0.0.x: Linux routes all of 127/8 to lo); the
legitimate client posts Alertmanager 0.25's webhook body with the token from 127.0.0.1, one
attempt per webhook (Alertmanager would retry; a retry would hide a refusal).
"""
from __future__ import annotations

import json
import socket
import subprocess
import time
from pathlib import Path

import pytest

from mfotel.actions.control import CONTROL_FILE
from tests.support.idle_flood import IdleFlood, loopback_sources
from tests.support.receiver import (
    child_env,
    notification,
    post,
    receiver_command,
    start_receiver,
)

TOKEN = "flood-token-3f9a1c"
WEBHOOKS = 8


@pytest.fixture
def acting_receiver(tmp_path: Path):
    """The CLI receiver with a bearer token, stopping jobs job-0 .. job-N on alert."""
    (tmp_path / "token").write_text(TOKEN)
    control = tmp_path / "ctl"
    for job in range(2 * WEBHOOKS):
        (control / f"job-{job}").mkdir(parents=True)
    receiver = start_receiver("--bearer-token-file", str(tmp_path / "token"),
                              "--control-dir", str(control / "{job_name}"),
                              "--control-max-actions", "100")
    receiver.control = control  # type: ignore[attr-defined]
    yield receiver
    receiver.stop()


def port_of(url: str) -> int:
    return int(url.split(":")[2].split("/")[0])


def post_webhooks(receiver, jobs: range) -> list[int]:
    """Alertmanager's webhook for each job, one attempt each, 0.3 s apart; the statuses."""
    statuses = []
    for job in jobs:
        status, _ = post(receiver.url, notification(job=f"job-{job}"), token=TOKEN, timeout=10)
        statuses.append(status)
        time.sleep(0.3)
    return statuses


@pytest.mark.parametrize("sources,per_source", [(1, 40), (30, 4)],
                         ids=["one address", "many addresses"])
def test_authenticated_webhooks_are_answered_while_idle_sockets_are_held(
        acting_receiver, sources: int, per_source: int) -> None:
    receiver = acting_receiver
    jobs = range(WEBHOOKS) if sources == 1 else range(WEBHOOKS, 2 * WEBHOOKS)
    with IdleFlood(port_of(receiver.url), loopback_sources(sources), per_source) as flood:
        time.sleep(1.0)  # the attacker holds its sockets before the first webhook
        statuses = post_webhooks(receiver, jobs)
    assert statuses == [200] * WEBHOOKS
    assert flood.stats["closed_by_server"] > 0   # the receiver cut the idle sockets off
    for job in jobs:                              # ... and every webhook acted
        request = json.loads((receiver.control / f"job-{job}" / CONTROL_FILE).read_text())
        assert (request["action"], request["source"]) == ("stop", "alert")
    out, _ = receiver.stop()
    for job in jobs:
        assert f"[FIRING critical] MindFormersLossNotFinite job_name=job-{job} rank=0" in out
        assert f"stop requested for job job-{job}" in out


def test_the_limits_come_from_the_command_line(tmp_path: Path) -> None:
    """--max-connections-per-client and --header-timeout-seconds reach the server; a bad
    value is refused at start, naming the option."""
    receiver = start_receiver("--max-connections-per-client", "2",
                              "--header-timeout-seconds", "1")
    try:
        port = port_of(receiver.url)
        idle = [socket.create_connection(("127.0.0.1", port), timeout=10,
                                         source_address=("127.0.0.2", 0)) for _ in range(3)]
        started = time.monotonic()
        for sock in idle:  # the first for the share of its address, the others at 1 s
            sock.settimeout(10)
            assert sock.recv(1) == b""
        assert time.monotonic() - started < 8
        assert post(receiver.url, notification())[0] == 200
    finally:
        receiver.stop()
    done = subprocess.run(receiver_command("--port", "0", "--max-connections-per-client", "0"),
                          capture_output=True, text=True, timeout=60, env=child_env())
    assert done.returncode == 2
    assert "--max-connections-per-client 0: at least 1" in done.stderr
