"""The live page without a browser: its history, its HTTP routes on a real endpoint, the
overview of several ranks' real endpoints, and its security (TLS, basic auth, CSP)."""
from __future__ import annotations

import hashlib
import json
import math
import re
import ssl
import time
from itertools import pairwise
from pathlib import Path

import bcrypt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mfotel.config import parse_config
from mfotel.contract import STATUS_RUNNING
from mfotel.identity import RankIdentity
from mfotel.instruments import Instruments
from mfotel.localstack.servers import free_port
from mfotel.telemetry import Telemetry
from mfotel.ui import History, live_page, rank_addresses
from mfotel.ui.history import BYTES_PER_POINT, MAX_MARKS
from mfotel.ui.overview import FETCH_TIMEOUT_SECONDS, MIN_INTERVAL_SECONDS
from tests.support.http import basic_auth as basic
from tests.support.http import get, post
from tests.support.live_page import decoded, strict_json
from tests.support.paths import ROOT
from tests.support.ranks import rank_exporter
from tests.support.waiting import settle, wait_for

STATIC = ROOT / "mfotel" / "ui" / "static"
PASSWORD = "page-viewer-pw"


# ---------------------------------------------------------------- history
def test_history_keeps_every_record_while_it_fits():
    history = History(points=16)
    for step in range(1, 11):
        history.append(step, {"loss": 1.0 / step, "learning_rate": 0.1,
                              "grad_norm": float("nan") if step == 4 else 2.0})
    data = history.read()
    assert data["steps"] == list(range(1, 11))
    assert data["series"]["loss"].tolist() == [1.0 / s for s in range(1, 11)]
    assert math.isnan(data["series"]["grad_norm"][3])       # not finite: the marks say so
    assert all(map(math.isnan, data["series"]["throughput"]))   # not recorded
    assert (data["reset"], data["stride"], data["committed"]) == (True, 1, 10)
    assert history.latest("loss") == 0.1 and history.latest("throughput") is None


def test_history_append_only_queues_and_a_full_queue_is_stored_off_the_training_thread(
        monkeypatch):
    """The training thread queues a record; a read stores what waits; with nobody reading, a
    thread stores the queue once it is QUEUE_LIMIT long, so it stays bounded."""
    import time

    from mfotel.ui import history as history_module
    monkeypatch.setattr(history_module, "QUEUE_LIMIT", 50)
    history = History(points=1000)
    for step in range(1, 11):
        history.append(step, {"loss": float(step)})
    assert history.queued == 10                          # nothing stored on this thread
    assert history.points == 10 and history.queued == 0  # the read stored them first
    for step in range(11, 501):
        history.append(step, {"loss": float(step)})
    deadline = time.monotonic() + 10   # a thread stores the full queue without any read
    while history.queued >= 50 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert history.queued < 50
    assert history.read()["steps"] == list(range(1, 501))


def test_history_thins_evenly_and_always_shows_the_newest_record():
    history = History(points=16)
    for step in range(1, 1001):
        history.append(step, {"loss": float(step)})
    data = history.read()
    steps = data["steps"]
    assert history.nbytes == 16 * BYTES_PER_POINT  # the memory allocated at start, no more
    assert len(steps) <= 16 and steps[0] == 1 and steps[-1] == 1000
    kept = steps[:-1] if data["committed"] != 1000 else steps
    assert all(b - a == data["stride"] for a, b in pairwise(kept))  # evenly spaced
    # 16 slots hold 15 strides + 1 records before thinning: 1000 records need stride 128
    assert (data["stride"], data["generation"]) == (128, 7) and len(steps) >= 8
    assert data["series"]["loss"].tolist() == [float(s) for s in steps]


def test_history_delta_replaces_the_newest_record():
    history = History(points=8)
    for step in range(1, 9):   # step 8 fills the slots: 1, 3, 5, 7 kept at stride 2, 8 shown
        history.append(step, {"loss": float(step)})
    stale = history.read(since=7, generation=0)
    assert stale["reset"] is True and stale["steps"] == [1, 3, 5, 7, 8]
    assert (stale["committed"], stale["stride"], stale["generation"]) == (7, 2, 1)
    history.append(9, {"loss": 9.0})     # kept: it replaces 8 on the client
    delta = history.read(since=7, generation=1)
    assert (delta["reset"], delta["steps"], delta["committed"]) == (False, [9], 9)
    history.append(10, {"loss": 10.0})   # not kept: shown until 11 replaces it
    delta = history.read(since=9, generation=1)
    assert (delta["steps"], delta["series"]["loss"].tolist(), delta["committed"]) == \
        ([10], [10.0], 9)
    history.append(11, {"loss": 11.0})
    assert history.read(since=9, generation=1)["steps"] == [11]


@settings(max_examples=200, deadline=None)
@given(points=st.integers(2, 12),
       plan=st.lists(st.one_of(st.integers(1, 40), st.just("poll")), max_size=60))
def test_a_client_following_the_deltas_sees_what_a_full_read_shows(points, plan):
    """The page's protocol: keep points up to `since`, append the delta, ask from `committed`."""
    history, step = History(points), 0
    client: dict = {"steps": [], "loss": [], "since": None, "generation": None}

    def poll() -> None:
        data = history.read(client["since"], client["generation"])
        if not data["reset"]:
            keep = len([s for s in client["steps"] if s <= client["since"]])
            client["steps"], client["loss"] = client["steps"][:keep], client["loss"][:keep]
        else:
            client["steps"], client["loss"] = [], []
        client["steps"] += data["steps"]
        client["loss"] += data["series"]["loss"].tolist()
        client["since"] = -1 if data["committed"] is None else data["committed"]
        client["generation"] = data["generation"]
    for item in plan:
        if item == "poll":
            poll()
            continue
        for _ in range(item):
            step += 1
            history.append(step, {"loss": step / 2})
    poll()
    full = history.read()
    assert client["steps"] == full["steps"] and client["loss"] == full["series"]["loss"].tolist()
    assert len(full["steps"]) <= points and (not step or full["steps"][-1] == step)


def test_nonfinite_steps_are_kept_as_ranges():
    history = History(points=16)
    for step, previous in ((5, 4), (6, 5), (7, 6), (10, 9)):
        history.mark_nonfinite("loss", step, float("nan"), previous)
    history.mark_nonfinite("grad_norm", 6, float("inf"), 5)
    marks = history.read()["marks"]
    assert [(m["metric"], m["first"], m["last"], m["value"]) for m in marks] == [
        ("loss", 5, 7, "NaN"), ("loss", 10, 10, "NaN"), ("grad_norm", 6, 6, "Inf")]
    assert history.nonfinite_at(10) == {"loss": "NaN"}
    assert history.nonfinite_at(6) == {"grad_norm": "Inf"}  # loss's latest range is 10..10
    assert history.read(marks_version=history.marks_version).get("marks") is None  # unchanged


def test_nonfinite_ranges_beyond_the_cap_are_counted_not_listed():
    history = History(points=16)
    steps = range(1, 2 * (MAX_MARKS + 5), 2)   # every other step: a new range each time
    for step in steps:
        history.mark_nonfinite("loss", step, float("-inf"), step - 1)
    data = history.read()
    assert len(data["marks"]) == MAX_MARKS and data["marks"][0]["first"] == 1
    assert data["marks_dropped"] == 5
    assert history.nonfinite_at(steps[-1]) == {"loss": "-Inf"}  # the newest is still followed


# ---------------------------------------------------------------- a real endpoint
SINGLE_RANK = RankIdentity()


def serve_page(port: int, ui: bool = True, identity: RankIdentity = SINGLE_RANK,
               **prometheus) -> tuple[Telemetry, Instruments, object]:
    exporter = rank_exporter({"metrics": ["loss", "learning_rate", "grad_norm"],
                              "prometheus": {"host": "127.0.0.1", "port": port, "ui": ui,
                                             "linger_seconds": 0, **prometheus}},
                             identity, "page", serve=False)
    telemetry, inst, page = exporter.telemetry, exporter.instruments, None
    if ui:
        page = live_page(telemetry.cfg, identity, "page", inst.state, telemetry.cert_file)
        telemetry.extra_routes.update(page.routes())
    exporter.serve()
    return telemetry, inst, page


@pytest.fixture
def page_server(port):
    telemetry, inst, page = serve_page(port)
    yield f"http://127.0.0.1:{port}", inst, page
    telemetry.shutdown()


def record(inst: Instruments, page, step: int, loss: float) -> None:
    """What the callback does at a record step (mfotel.callback)."""
    st = inst.state
    st.status, st.step, st.steps, st.last_step_timestamp = STATUS_RUNNING, step, step, time.time()
    st.loss_finite = int(math.isfinite(loss))
    st.loss = loss   # as it is, NaN included
    if not math.isfinite(loss):
        st.nonfinite["loss"] += 1
        st.first_nonfinite_step = st.first_nonfinite_step or step
        page.history.mark_nonfinite("loss", step, loss, step - 1)
    page.history.append(step, {"loss": loss, "learning_rate": 0.01, "grad_norm": 1.5})
    inst.touch()


def test_the_page_and_its_files_are_served_with_a_strict_csp(page_server):
    base, _, _ = page_server
    reply = get(base + "/")
    status, headers, body = reply.status, reply.headers, reply.body
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    csp = headers["Content-Security-Policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp and "unsafe" not in csp
    assert headers["X-Content-Type-Options"] == "nosniff"
    html = body.decode()
    scripts = re.findall(r"<script([^>]*)>", html)
    assert scripts and all('src="ui/' in attrs for attrs in scripts)   # no inline script
    assert not re.search(r"\sstyle=|\son[a-z]+=", html)                 # no inline style/handler
    assert not re.search(r"(src|href)=\"(https?:)?//", html)           # nothing from elsewhere
    for path in ("/ui/app.js", "/ui/app.css", "/ui/uPlot.iife.min.js", "/ui/uPlot.min.css"):
        reply = get(base + path)
        status, headers, asset = reply.status, reply.headers, reply.body
        assert status == 200 and len(asset) > 500 and "Content-Security-Policy" in headers
    reply = get(base + "/metrics")
    status, headers = reply.status, reply.headers
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    assert get(base + "/elsewhere").status == 404


def test_history_api_returns_the_records_and_marks_the_nan(page_server):
    base, inst, page = page_server
    for step, loss in ((1, 2.0), (2, 1.5), (3, float("nan")), (4, float("nan"))):
        record(inst, page, step, loss)
    reply = get(base + "/api/history")
    status, headers, body = reply.status, reply.headers, reply.body
    data = decoded(strict_json(body))
    assert status == 200 and headers["Cache-Control"] == "no-store"
    assert data["steps"] == [1, 2, 3, 4] and data["series"]["loss"] == [2.0, 1.5, None, None]
    as_numbers = strict_json(get(base + "/api/history?format=numbers").body)
    assert as_numbers["encoding"] == "numbers" and as_numbers["series"] == data["series"]
    assert data["marks"] == [{"metric": "loss", "first": 3, "last": 4, "value": "NaN"}]
    current = data["current"]
    assert (current["step"], current["status_name"], current["first_nonfinite_step"]) == \
        (4, "running", 3)
    # JSON has no NaN: null, and nonfinite_values says what /metrics shows
    assert current["loss"] is None and current["loss_finite"] == 0
    assert current["nonfinite_values"] == {"loss": "NaN"}
    assert current["nonfinite_now"] == {"loss": "NaN"} and current["nonfinite_total"]["loss"] == 2
    assert current["metrics"] == ["loss", "learning_rate", "grad_norm"]
    record(inst, page, 5, 0.5)
    query = (f"?since={data['committed']}&generation={data['generation']}"
             f"&marks={data['marks_version']}")
    delta = decoded(strict_json(get(base + "/api/history" + query).body))
    assert delta["steps"] == [5] and delta["series"]["loss"] == [0.5] and "marks" not in delta
    assert delta["current"]["nonfinite_now"] == {}
    summary = strict_json(get(base + "/api/summary").body)
    assert summary["step"] == 5 and summary["loss"] == 0.5 and summary["history"]["points"] == 5
    assert summary["nonfinite_values"] == {}


def test_full_loads_are_budgeted_and_a_stale_one_is_caught_up_by_the_next_delta(
        page_server, monkeypatch):
    base, inst, page = page_server
    monkeypatch.setattr("mfotel.ui.app.FULL_LOAD_BUDGET", 1e-9)  # one encoding, then reuse
    record(inst, page, 1, 2.0)
    first = decoded(json.loads(get(base + "/api/history").body))
    record(inst, page, 2, 1.0)
    again = decoded(json.loads(get(base + "/api/history").body))
    assert again["steps"] == first["steps"] == [1] and again["committed"] == 1   # not re-encoded
    assert again["current"]["step"] == 2                                          # but current
    query = f"?since={again['committed']}&generation={again['generation']}&marks=0"
    delta = decoded(json.loads(get(base + "/api/history" + query).body))
    assert delta["steps"] == [2] and delta["series"]["loss"] == [1.0]


def test_bad_requests_get_clear_answers(page_server):
    base, _, _ = page_server
    reply = get(base + "/api/history?since=abc&generation=0")
    status, body = reply.status, reply.body
    assert status == 400 and "since must be a whole number" in json.loads(body)["error"]
    status = get(base + "/api/history?" + "&".join(f"x{i}=1" for i in range(50))).status
    assert status == 400
    assert post(base + "/api/history", b"{}").status == 405


def test_ui_false_serves_only_metrics(port):
    telemetry, _, page = serve_page(port, ui=False)
    try:
        base = f"http://127.0.0.1:{port}"
        assert page is None
        assert get(base + "/").status == 404 and get(base + "/api/history").status == 404
        assert get(base + "/metrics").status == 200
    finally:
        telemetry.shutdown()


def test_the_vendored_chart_library_is_the_one_its_note_names():
    note = (STATIC / "vendor" / "README.md").read_text()
    for name in ("uPlot.iife.min.js", "uPlot.min.css"):
        digest = hashlib.sha256((STATIC / "vendor" / name).read_bytes()).hexdigest()
        assert f"`{name}` {digest}" in note
    assert "(v1.6.32)" in (STATIC / "vendor" / "uPlot.iife.min.js").read_text()[:80]
    assert "MIT License" in (STATIC / "vendor" / "LICENSE.uPlot.txt").read_text()


# ---------------------------------------------------------------- TLS and basic auth
def web_config(path: Path, certs: Path | None) -> Path:
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()
    tls = (f"tls_server_config:\n  cert_file: {certs / 'cert.pem'}\n"
           f"  key_file: {certs / 'key.pem'}\n") if certs else ""
    path.write_text(f"{tls}basic_auth_users:\n  viewer: '{hashed}'\n")
    return path


def test_the_page_is_behind_the_same_tls_and_basic_auth_as_metrics(port, tmp_path, certs):
    web = web_config(tmp_path / "w.yml", certs)
    telemetry, inst, page = serve_page(port, web_config_file=str(web))
    context = ssl.create_default_context(cafile=str(certs / "cert.pem"))
    base = f"https://127.0.0.1:{port}"
    try:
        record(inst, page, 1, 3.0)
        viewer, intruder = basic("viewer", PASSWORD), basic("viewer", "wrong")
        for path in ("/", "/ui/app.js", "/api/history", "/api/summary", "/api/overview",
                     "/metrics"):
            assert get(base + path, context=context).status == 401, path
            assert get(base + path, auth=intruder, context=context).status == 401, path
            assert get(base + path, auth=viewer, context=context).status == 200, path
        data = decoded(get(base + "/api/history", auth=viewer, context=context).json())
        assert data["series"]["loss"] == [3.0]
        with pytest.raises(OSError):  # plain HTTP is refused by the TLS socket
            get(f"http://127.0.0.1:{port}/", timeout=5)
    finally:
        telemetry.shutdown()


# ---------------------------------------------------------------- overview of the ranks
def two_ranks(base: int, **prometheus) -> list[tuple[Telemetry, Instruments, object]]:
    """Ranks 0 and 1 of one node: two real endpoints on base and base + 1."""
    ranks = []
    for rank in (0, 1):
        identity = RankIdentity(rank=rank, local_rank=rank, world_size=2, local_world_size=2,
                                node="node-a")
        ranks.append(serve_page(base, identity=identity, **prometheus))
    return ranks


def free_pair() -> int:
    for _ in range(50):
        base = free_port()
        try:
            import socket
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", base + 1))
            return base
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


def poll_overview(url: str, ready, authorization: str | None = None,
                  context: ssl.SSLContext | None = None) -> dict:
    """Rank 0's /api/overview once `ready(data)` holds (a fan-out every MIN_INTERVAL_SECONDS)."""
    def overview() -> dict | None:
        data = get(url + "/api/overview", auth=authorization, context=context).json()
        return data if ready(data) else None
    return wait_for(overview, settle(MIN_INTERVAL_SECONDS + FETCH_TIMEOUT_SECONDS), 0.2,
                    f"{url}/api/overview ready")


def test_rank_0_shows_every_rank_of_the_node(tmp_path):
    base = free_pair()
    ranks = two_ranks(base)
    try:
        (_, inst0, page0), (_, inst1, page1) = ranks
        record(inst0, page0, 12, 0.75)
        record(inst1, page1, 11, float("nan"))
        overview = poll_overview(f"http://127.0.0.1:{base}",
                                 lambda d: len(d["ranks"]) == 2 and "step" in d["ranks"][1])
        assert overview["enabled"] and overview["note"] is None
        zero, one = overview["ranks"]
        assert (zero["rank"], zero["step"], zero["loss"]) == (0, 12, 0.75)
        assert (one["rank"], one["step"], one["first_nonfinite_step"]) == (1, 11, 11)
        assert one["nonfinite_now"] == {"loss": "NaN"}
        assert one["url"] == f"http://127.0.0.1:{base + 1}/"
        assert overview["next_refresh_seconds"] <= MIN_INTERVAL_SECONDS
        assert overview["cost_seconds"] >= 0
        elsewhere = json.loads(get(f"http://127.0.0.1:{base + 1}/api/overview").body)
        assert elsewhere == {"enabled": False, "url": f"http://127.0.0.1:{base}/",
                             "note": "the overview of all ranks is on rank 0"}
    finally:
        for telemetry, _, _ in ranks:
            telemetry.shutdown()


def test_the_overview_reaches_tls_ranks_with_the_viewers_credentials(tmp_path, certs):
    """The ranks share one web-config: rank 0 trusts their certificate and forwards the
    viewer's basic auth."""
    base = free_pair()
    auth = basic("viewer", PASSWORD)
    ranks = two_ranks(base, web_config_file=str(web_config(tmp_path / "w.yml", certs)))
    context = ssl.create_default_context(cafile=str(certs / "cert.pem"))
    try:
        (_, inst1, page1) = ranks[1]
        record(inst1, page1, 4, 1.25)
        overview = poll_overview(f"https://127.0.0.1:{base}",
                                 lambda d: len(d["ranks"]) == 2 and d["refreshed"], auth, context)
        assert overview["ranks"][1]["url"] == f"https://127.0.0.1:{base + 1}/"
        assert overview["ranks"][1]["step"] == 4 and "error" not in overview["ranks"][1]
    finally:
        for telemetry, _, _ in ranks:
            telemetry.shutdown()


def test_an_unreachable_rank_is_shown_as_such(port):
    identity = RankIdentity(rank=0, local_rank=0, world_size=2, local_world_size=2)
    # rank 1 would serve port + 1; nobody does
    telemetry, _, _ = serve_page(port, identity=identity)
    try:
        overview = poll_overview(f"http://127.0.0.1:{port}",
                                 lambda d: len(d["ranks"]) == 2)
        assert overview["ranks"][1]["error"].startswith("unreachable")
    finally:
        telemetry.shutdown()


def address_config(**file_sd):
    return parse_config({"prometheus": {"port": 9464, "host": "0.0.0.0"},
                         **({"file_sd": file_sd} if file_sd else {})})


def test_rank_addresses_on_one_node_and_from_the_host_list():
    one_node = RankIdentity(rank=0, world_size=4, local_world_size=4)
    assert rank_addresses(address_config(), one_node, "j", "http").urls == {
        r: f"http://127.0.0.1:{9464 + r}/" for r in range(4)}
    two_nodes = RankIdentity(rank=0, world_size=4, local_world_size=2)
    peers = rank_addresses(address_config(hosts=["n1", "n2"]), two_nodes, "j", "https")
    assert peers.urls == {0: "https://n1:9464/", 1: "https://n1:9465/",
                          2: "https://n2:9464/", 3: "https://n2:9465/"} and peers.note is None


def test_rank_addresses_explain_what_is_missing(tmp_path):
    unknown = rank_addresses(address_config(), RankIdentity(world_size=16, local_world_size=8),
                             "j", "http")
    assert unknown.urls == {} and "file_sd.hosts" in unknown.note
    path = str(tmp_path / "{job_name}-{rank}.json")
    (tmp_path / "j-0.json").write_text(json.dumps([{"targets": ["n1:9464"], "labels": {}}]))
    (tmp_path / "j-2.json").write_text(json.dumps([{"targets": ["n2:9464"],
                                                    "labels": {"__scheme__": "https"}}]))
    (tmp_path / "j-3.json").write_text("{garbage")
    peers = rank_addresses(address_config(path=path, mode="rank"),
                           RankIdentity(world_size=4, local_world_size=2), "j", "http")
    assert peers.urls == {0: "http://n1:9464/", 2: "https://n2:9464/"}
    assert peers.note.startswith("2 of 4 ranks have no readable target file yet")


def test_a_peer_that_trickles_its_answer_is_cut_off(port):
    """A misbehaving peer (headers, then a byte now and then) cannot hold the overview."""
    import socket
    import threading

    from mfotel.ui import Overview
    from mfotel.ui.overview import Peers
    stop = threading.Event()
    listener = socket.create_server(("127.0.0.1", port))

    def trickle() -> None:
        connection, _ = listener.accept()
        with connection:
            connection.recv(4096)
            connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n{")
            while not stop.wait(0.2):
                try:
                    connection.sendall(b" ")
                except OSError:
                    return
    threading.Thread(target=trickle, daemon=True).start()
    overview = Overview(lambda: Peers({0: "http://unused/", 1: f"http://127.0.0.1:{port}/"}),
                        own_rank=0, timeout=0.5)
    overview.local = lambda: {"step": 3}
    try:
        overview.snapshot()
        data = wait_for(lambda: (d := overview.snapshot())["refreshed"] and d,
                        settle(overview.timeout + overview.min_interval), 0.1,
                        "the overview refreshed past the slow rank")
        assert data["ranks"][1]["error"] == "too slow (no summary within 1 s)"
        assert data["ranks"][0]["step"] == 3
    finally:
        stop.set()
        listener.close()

