"""Every HTTP surface keeps answering its authenticated clients while an attacker without
credentials holds connections: the alerts receiver (the real `mfotel alerts-receiver`), a
rank's `/metrics` and the node endpoint (basic auth).

Two floods, each another process re-opening its connections as soon as the server closes
them, from one loopback address or many (127.0.0.x: Linux routes 127/8 to lo):
- *declared body*: each connection sends a request head declaring a 4 MB body
  (`Content-Length: 4000000`) that never comes; the server can answer at once (the liveness
  path's 200, an unauthenticated request's 401) and must not then keep the place waiting for
  the body;
- *idle*: connections that never send a byte, from 127.0.0.1, the address every local
  process shares with Alertmanager when both run on one host.

The legitimate client makes one attempt per request (Alertmanager and Prometheus would retry;
a retry would hide a refusal), spaced REQUEST_GAP_SECONDS apart, and every one must be answered.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import bcrypt
import pytest

from mfotel.config.settings import PrometheusConfig
from mfotel.endpoint.server import LIVENESS_PATH
from mfotel.localstack.servers import free_port
from mfotel.node.endpoint import NodeEndpoint
from mfotel.node.metrics import NodeCollector
from tests.support.endpoint import SCRAPER, basic, request, serve
from tests.support.idle_flood import IdleFlood, declared_body, loopback_sources
from tests.support.metrics import samples, value
from tests.support.receiver import notification, post, start_receiver

REQUESTS = 20
REQUEST_GAP_SECONDS = 0.1
TOKEN = "flood-token-5b2e"
ALERTMANAGER = "127.0.0.1"   # the receiver's default bind: Alertmanager on the same host
LIVENESS = declared_body("GET", LIVENESS_PATH)
UNAUTHENTICATED_POST = declared_body("POST", "/alerts", Content_Type="application/json")
UNAUTHENTICATED_SCRAPE = declared_body("GET", "/metrics")
#: The kernel hands an idle socket over only after the server's deferral (TCP_DEFER_ACCEPT:
#: 2 s, then the next SYN-ACK retransmission, ~3 s) and the server closes it at its header
#: time-out (the receiver's 3 s): an idle flood is held until then.
IDLE_HOLD_SECONDS = 8.0


def answered_while(flood: IdleFlood, attempt: Callable[[int], bool]) -> tuple[int, int]:
    """(answered, total) of REQUESTS attempts made while `flood` holds its connections; an
    idle flood is held IDLE_HOLD_SECONDS at least, until the server closed its sockets."""
    started = time.monotonic()
    with flood:
        time.sleep(1.0)  # the attacker holds its places before the first request
        answered = 0
        for index in range(REQUESTS):
            answered += attempt(index)
            time.sleep(REQUEST_GAP_SECONDS)
        if flood.idle:
            time.sleep(max(started + IDLE_HOLD_SECONDS - time.monotonic(), 0.0))
    return answered, REQUESTS


@pytest.fixture(scope="module")
def receiver(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """The CLI receiver behind a bearer token, stopping job-N on alert (one per webhook)."""
    folder = tmp_path_factory.mktemp("receiver")
    (folder / "token").write_text(TOKEN)
    control = folder / "ctl"
    for job in range(REQUESTS):
        (control / f"job-{job}").mkdir(parents=True)
    started = start_receiver("--bearer-token-file", str(folder / "token"),
                             "--control-dir", str(control / "{job_name}"),
                             "--control-max-actions", "1000")
    yield started
    started.stop()


def port_of(url: str) -> int:
    return int(url.split(":")[2].split("/")[0])


def webhook(receiver, failures: list[str]) -> Callable[[int], bool]:
    """Alertmanager's webhook from 127.0.0.1 with the token: answered 200? (each attempt a
    new episode: a new startsAt); what went wrong with each other attempt, in `failures`"""
    def attempt(index: int) -> bool:
        body = notification(job=f"job-{index}", starts_at=f"2025-01-01T00:{index:02d}:"
                            f"{int(time.time()) % 60:02d}Z")
        started = time.monotonic()
        try:
            status = post(receiver.url, body, token=TOKEN, timeout=10)[0]
        except OSError as exc:
            status = exc
        if status != 200:
            failures.append(f"#{index}: {status!r} after {time.monotonic() - started:.1f} s")
        return status == 200
    return attempt


@pytest.mark.parametrize("flood,sources,per_source", [
    (UNAUTHENTICATED_POST, loopback_sources(2), 8),
    (UNAUTHENTICATED_POST, loopback_sources(4), 4),
    (LIVENESS, loopback_sources(2), 8),
    (LIVENESS, [ALERTMANAGER], 16),
    (UNAUTHENTICATED_POST, [ALERTMANAGER], 16),
    (b"", [ALERTMANAGER], 8),
    (b"", [ALERTMANAGER], 16),
    (b"", [ALERTMANAGER], 200),
], ids=["declared body, POST, 2 addresses", "declared body, POST, 4 addresses",
        "declared body, liveness, 2 addresses", "declared body, liveness, Alertmanager's",
        "declared body, POST, Alertmanager's", "idle, 8 on Alertmanager's",
        "idle, 16 on Alertmanager's", "idle, 200 on Alertmanager's"])
def test_the_receiver_answers_every_authenticated_webhook(receiver, flood: bytes,
                                                          sources: list[str],
                                                          per_source: int) -> None:
    attacker = IdleFlood(port_of(receiver.url), sources, per_source, send=flood)
    failures: list[str] = []
    answered, total = answered_while(attacker, webhook(receiver, failures))
    assert (answered, total) == (total, total), \
        f"{answered} of {total} webhooks answered: {failures}; {attacker.stats}"
    assert attacker.stats["closed_by_server"] > 0   # the receiver closed the attacker's places


@pytest.fixture(scope="module")
def print_only_receiver() -> Iterator:
    """The CLI receiver without --control-dir: no credentials, it prints what anyone posts
    (as `mfotel simulate --webhook` and the demo's receiver do)."""
    started = start_receiver()
    yield started
    started.stop()


@pytest.mark.parametrize("sources,per_source", [(loopback_sources(2), 8), ([ALERTMANAGER], 16)],
                         ids=["2 addresses", "Alertmanager's"])
def test_a_receiver_without_credentials_answers_every_webhook(print_only_receiver,
                                                              sources: list[str],
                                                              per_source: int) -> None:
    """Without credentials the app reads any client's body: a declared body that never comes
    held one of the 4 workers and a place at the app for the whole request deadline."""
    receiver = print_only_receiver

    def attempt(index: int) -> bool:
        try:
            return post(receiver.url, notification(job=f"print-{index}"), timeout=10)[0] == 200
        except OSError:
            return False
    attacker = IdleFlood(port_of(receiver.url), sources, per_source, send=UNAUTHENTICATED_POST)
    answered, total = answered_while(attacker, attempt)
    assert (answered, total) == (total, total), f"{answered} of {total} webhooks answered"
    assert attacker.stats["closed_by_server"] > 0


@pytest.fixture(scope="module")
def rank() -> Iterator[int]:
    """Rank 0 serving /metrics without credentials (max_connections: 100, the default)."""
    port = free_port()
    telemetry, _ = serve(port)
    yield port
    telemetry.shutdown()


@pytest.mark.parametrize("sources,per_source", [(loopback_sources(25, first=10), 4),
                                                 (loopback_sources(1, first=10), 100)],
                         ids=["25 addresses", "one address"])
def test_a_rank_answers_every_scrape(rank: int, sources: list[str], per_source: int) -> None:
    def scrape(_: int) -> bool:
        reply = request(rank, source=SCRAPER, timeout=10)
        return reply.status == 200 and value(samples(reply.body.decode()),
                                             "mindformers_train_loss") == 1.25
    attacker = IdleFlood(rank, sources, per_source, send=LIVENESS)
    answered, total = answered_while(attacker, scrape)
    assert (answered, total) == (total, total), f"{answered} of {total} scrapes answered"
    assert attacker.stats["closed_by_server"] > 0


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A node endpoint behind basic auth (the ranks' web-config)."""
    web = tmp_path_factory.mktemp("node") / "web.yml"
    hashed = bcrypt.hashpw(b"node-pw", bcrypt.gensalt(rounds=4)).decode()
    web.write_text(f"basic_auth_users:\n  prometheus: '{hashed}'\n")
    endpoint = NodeEndpoint(NodeCollector(lambda: []), PrometheusConfig(
        host="127.0.0.1", web_config_file=str(web)), free_port())
    assert endpoint.start()
    yield endpoint.port
    endpoint.close()


@pytest.mark.parametrize("flood,sources,per_source", [
    (UNAUTHENTICATED_SCRAPE, loopback_sources(50, first=10), 2),
    (LIVENESS, loopback_sources(50, first=10), 2),
    (UNAUTHENTICATED_SCRAPE, loopback_sources(1, first=10), 100),
], ids=["declared body, 401, 50 addresses", "declared body, liveness, 50 addresses",
        "declared body, 401, one address"])
def test_the_node_endpoint_answers_every_authenticated_scrape(node: int, flood: bytes,
                                                              sources: list[str],
                                                              per_source: int) -> None:
    def scrape(_: int) -> bool:
        reply = request(node, source=SCRAPER, timeout=10, **basic("prometheus", "node-pw"))
        return reply.status == 200 and b"# HELP" in reply.body
    attacker = IdleFlood(node, sources, per_source, send=flood)
    answered, total = answered_while(attacker, scrape)
    assert (answered, total) == (total, total), f"{answered} of {total} scrapes answered"
    assert attacker.stats["closed_by_server"] > 0

