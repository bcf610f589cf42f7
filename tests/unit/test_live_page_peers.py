"""Rank 0's overview fetches its peers from file_sd target files an attacker may influence.

A real rank-0 endpoint (basic auth, the live page) reads per-rank target files (`file_sd:
{mode: rank}`); the peers are real HTTP servers on loopback that record what they receive. Rank 0
must never follow a redirect (the viewer's credentials would go to a third host), never open
anything but http/https, and send the viewer's credentials only to peers whose address only
this user could have written.
"""
from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from mfotel.config import parse_config
from mfotel.identity import RankIdentity
from mfotel.instruments import Instruments
from mfotel.telemetry import Telemetry
from mfotel.ui import live_page
from tests.unit.test_live_page import basic, poll_overview, web_config

PASSWORD = "page-viewer-pw"   # web_config's
VIEWER = basic("viewer", PASSWORD)
NOBODY = 65534


class Peer:
    """A loopback HTTP server recording every request's path and Authorization header; it
    answers a rank's summary, or redirects to `redirect`."""

    def __init__(self, redirect: str | None = None) -> None:
        self.seen: list[tuple[str, str | None]] = []
        peer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                peer.seen.append((self.path, self.headers.get("Authorization")))
                if redirect:
                    self.send_response(302)
                    self.send_header("Location", redirect)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                body = json.dumps({"step": 7, "status": 1, "loss": 0.5}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


@pytest.fixture
def peers() -> Iterator[list[Peer]]:
    started: list[Peer] = []
    yield started
    for peer in started:
        peer.close()


def target_file(folder: Path, rank: int, target: str, **labels: str) -> Path:
    path = folder / f"job-{rank}.json"
    path.write_text(json.dumps([{"targets": [target], "labels": labels}]))
    path.chmod(0o644)
    return path


def rank0_overview(port: int, folder: Path, world: int) -> dict:
    """Rank 0 of `world` ranks, its page behind basic auth, peers from `folder`'s files;
    the overview once every other rank was fetched (or refused)."""
    auth = str(web_config(folder / "w.yml", None))
    cfg = parse_config({"prometheus": {"host": "127.0.0.1", "port": port, "linger_seconds": 0,
                                       "web_config_file": auth},
                        "file_sd": {"mode": "rank",
                                    "path": str(folder / "{job_name}-{rank}.json")}})
    identity = RankIdentity(rank=0, world_size=world, local_world_size=1)
    telemetry = Telemetry(cfg, identity, "job")
    inst = Instruments(telemetry.start(), {"job_name": "job", "rank": "0"}, cfg.metrics)
    page = live_page(cfg, identity, "job", inst.state, telemetry.cert_file)
    telemetry.extra_routes.update(page.routes())
    telemetry.serve(lambda: inst.version)
    try:
        return poll_overview(f"http://127.0.0.1:{port}",
                             lambda d: d["refreshed"] and len(d["ranks"]) == world, VIEWER)
    finally:
        telemetry.shutdown()


def test_a_redirecting_peer_is_not_followed_so_no_credentials_reach_a_third_host(
        port, tmp_path, peers):
    third = Peer()
    peers.append(third)
    peers.append(redirecting := Peer(redirect=f"http://{third.address}/api/summary"))
    target_file(tmp_path, 0, f"127.0.0.1:{port}")
    target_file(tmp_path, 1, redirecting.address)
    overview = rank0_overview(port, tmp_path, 2)
    assert redirecting.seen == [("/api/summary", VIEWER)]   # a peer the configuration names
    assert third.seen == []                                # the first version: 7 of 7 fetches
    assert overview["ranks"][1]["error"] == "HTTP 302 Found (redirects are not followed)"


def test_a_file_scheme_target_is_not_opened(port, tmp_path):
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"step": 4242, "loss": 0.125}))
    target_file(tmp_path, 0, f"127.0.0.1:{port}")
    target_file(tmp_path, 1, f"localhost{secret}#", __scheme__="file")
    overview = rank0_overview(port, tmp_path, 2)
    row = overview["ranks"][1]
    assert row.get("step") is None and row.get("loss") is None   # the first version read it
    assert row["error"] == (f"not fetched: {tmp_path / 'job-1.json'} names the scheme 'file' "
                            f"(only http and https peers are)")


def test_a_target_with_a_path_is_not_fetched(port, tmp_path, peers):
    peers.append(peer := Peer())
    target_file(tmp_path, 0, f"127.0.0.1:{port}")
    target_file(tmp_path, 1, f"{peer.address}/steal?x=")
    overview = rank0_overview(port, tmp_path, 2)
    assert peer.seen == []
    assert overview["ranks"][1]["error"].endswith("not a host:port")


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user (chown) needs "
                    "root; CI runs the suite as root")
def test_peers_from_files_another_user_could_write_get_no_credentials(port, tmp_path, peers):
    """Rank 1's file belongs to another user, rank 2's is group-writable, rank 3's directory
    is writable by others: they are fetched without the viewer's credentials. Rank 4's file
    is this user's, in a directory only it writes: the credentials go there."""
    peers.extend(Peer() for _ in range(4))
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    target_file(tmp_path, 0, f"127.0.0.1:{port}")
    os.chown(target_file(tmp_path, 1, peers[0].address), NOBODY, NOBODY)
    target_file(tmp_path, 2, peers[1].address).chmod(0o664)
    target_file(shared, 3, peers[2].address)
    (tmp_path / "job-3.json").symlink_to(shared / "job-3.json")
    target_file(tmp_path, 4, peers[3].address)
    overview = rank0_overview(port, tmp_path, 5)
    assert [peer.seen for peer in peers[:3]] == [[("/api/summary", None)]] * 3
    assert peers[3].seen == [("/api/summary", VIEWER)]
    assert [row["step"] for row in overview["ranks"][1:]] == [7, 7, 7, 7]
    assert overview["note"] == ("3 ranks' target files could have been written by another "
                                "user (not this user's, or writable by others): fetched "
                                "without the viewer's credentials")

