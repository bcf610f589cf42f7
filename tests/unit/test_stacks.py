"""The node agent's capture of a rank's Python stacks (mfotel.node.stacks).

Real processes throughout (tests/support/scripts/stacks_rank.py): a rank-like child that
joined the rendezvous (mfotel.node_link) and blocks in its dataset's `__getitem__`, or holds
the GIL in a C call, or steps on a real heartbeat; a child without the handler. Real signals,
real faulthandler dumps, the real node endpoint over HTTP.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import bcrypt
import pytest

from mfotel.config.settings import PrometheusConfig
from mfotel.localstack.servers import free_port
from mfotel.node import procfs, stacks
from mfotel.node.agent import AgentSettings, NodeAgent
from mfotel.node.endpoint import NodeEndpoint
from mfotel.node.metrics import NodeCollector
from mfotel.node_link import (
    STACK_SIGNAL,
    Announcement,
    announcement_path,
    read_node_endpoint,
    write_node_endpoint,
)
from mfotel.ui import stacks_link
from tests.support.http import basic_auth, get, request
from tests.support.metrics import samples, scrape
from tests.support.multirank import ROOT, child_env
from tests.support.waiting import settle, startup, wait_for

SCRIPT = ROOT / "tests" / "support" / "scripts" / "stacks_rank.py"


class Child:
    """A stacks_rank.py process in `directory` (its node directory)."""

    def __init__(self, mode: str, directory: Path, *args: str, **env: str) -> None:
        self.directory = directory
        self.process = subprocess.Popen(
            [sys.executable, str(SCRIPT), mode, str(directory), *args],
            env=child_env(MFOTEL_NODE_DIR=str(directory), **env),
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.pid = self.process.pid
        wait_for(lambda: (directory / f"ready-{self.pid}").exists(), startup(), 0.05,
                 f"{mode} child ready", alive=(self.process,),
                 details=lambda: self.process.stderr.read().decode() if self.process.poll()
                 is not None else "")
        stat = procfs.read_stat(self.pid)
        assert stat is not None
        self.start_ticks = stat.start_ticks

    @property
    def announcement(self) -> Announcement:
        return Announcement.from_json(announcement_path(self.directory, self.pid).read_bytes())

    def alive(self) -> bool:
        return self.process.poll() is None

    def control(self, what: str, present: bool = True) -> None:
        path = self.directory / f"{what}-{self.pid}"
        if present:
            path.write_text("1")
        else:
            path.unlink()

    def stop(self) -> None:
        if self.alive():
            self.process.kill()
        self.process.wait(timeout=30)
        self.process.stderr.close()


@pytest.fixture
def child(tmp_path) -> Iterator[Any]:
    started: list[Child] = []
    directory = tmp_path / "node"
    directory.mkdir(mode=0o700)

    def start(mode: str, *args: str, **env: str) -> Child:
        started.append(Child(mode, directory, *args, **env))
        return started[-1]
    yield start
    for one in started:
        one.stop()


@dataclass
class Rank:
    """A rank as the agent follows it (what StackWatcher reads of mfotel.node.agent._Rank)."""

    pid: int
    start_ticks: int
    job_name: str = "jt"
    rank: int = 1
    announcement: Announcement | None = None
    answering: bool | None = None
    exit: object | None = None


def followed(one: Child, **fields: Any) -> Rank:
    return Rank(one.pid, one.start_ticks, **fields)


# ---------------------------------------------------------------- the capture
def test_a_capture_shows_the_frame_where_the_data_loader_blocks_and_the_rank_runs_on(child):
    rank = child("loader")
    started = time.monotonic()
    got = stacks.dump(rank.pid, rank.start_ticks, rank.announcement)
    took = time.monotonic() - started
    print(f"capture of a rank blocked in __getitem__: {took * 1000:.0f} ms, {got and got.size} B")
    assert got is not None
    assert 'stacks_rank.py", line' in got.text and "in __getitem__" in got.text
    # faulthandler: most recent call first, so the loader's frame is above main's
    assert got.text.index("in __getitem__") < got.text.index("in main")
    assert got.size == len(got.text.encode()) and took < stacks.DUMP_MAX_SECONDS + 1
    # a second capture reads only what its own dump appended
    again = stacks.dump(rank.pid, rank.start_ticks, rank.announcement)
    assert again is not None and again.text.count("in __getitem__") == 1
    time.sleep(0.2)
    assert rank.alive() and procfs.read_stat(rank.pid).state in "SR"


def test_a_rank_holding_the_gil_in_c_code_is_captured(child):
    rank = child("gil")
    tick = rank.directory / f"tick-{rank.pid}"
    wait_for(lambda: tick.exists(), 10, 0.05, "the ticker thread")

    def gil_held() -> bool:   # the ticker, a Python thread, no longer runs
        before = tick.read_text()
        time.sleep(0.3)
        return tick.read_text() == before
    wait_for(gil_held, 10, 0, "the GIL held by the C call")
    got = stacks.dump(rank.pid, rank.start_ticks, rank.announcement)
    assert got is not None and "in hold_the_gil" in got.text and "in tick" in got.text
    assert gil_held() and rank.alive()


def test_a_process_without_the_handler_is_never_signalled_and_nothing_is_claimed(child):
    bare = child("bare")
    stack_file = bare.directory / f"stacks-{bare.pid}.txt"
    stack_file.write_text("")
    told = Announcement(bare.pid, "jt", 0, stack_file=str(stack_file),
                        stack_signal=int(STACK_SIGNAL))
    assert int(STACK_SIGNAL) not in procfs.caught_signals(bare.pid)
    assert not stacks.send(bare.pid, bare.start_ticks, int(STACK_SIGNAL))
    assert stacks.dump(bare.pid, bare.start_ticks, told) is None
    # a signal it handles, but whose default is not to ignore it, is never sent
    assert int(signal.SIGTERM) in procfs.caught_signals(bare.pid)
    sigterm = Announcement(bare.pid, "jt", 0, stack_file=str(stack_file),
                           stack_signal=int(signal.SIGTERM))
    assert stacks.dump(bare.pid, bare.start_ticks, sigterm) is None
    # nor to another process than the one followed (a pid reused: another start time)
    loader = child("loader")
    assert stacks.dump(loader.pid, loader.start_ticks + 1, loader.announcement) is None
    time.sleep(0.3)
    assert not (bare.directory / f"sigterm-{bare.pid}").exists()
    assert bare.alive() and stack_file.read_text() == ""
    assert Path(loader.announcement.stack_file).read_text() == ""
    watcher = stacks.StackWatcher(lambda: [followed(bare, announcement=told, answering=False)])
    assert watcher.check() == [] and watcher.captures() == []


def test_a_stopped_rank_is_not_signalled(child):
    rank = child("loader")
    os.kill(rank.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: procfs.read_stat(rank.pid).state in "Tt", 10, 0.05, "stopped")
        assert stacks.dump(rank.pid, rank.start_ticks, rank.announcement) is None
    finally:
        os.kill(rank.pid, signal.SIGCONT)
    time.sleep(0.3)
    assert Path(rank.announcement.stack_file).read_text() == ""


# ---------------------------------------------------------------- what is kept
def test_the_last_capture_is_kept_after_the_rank_ended_and_replaced_by_its_next_run(child):
    first = child("loader")
    ranks = [followed(first, answering=False)]   # its /metrics silent: a capture is due
    watcher = stacks.StackWatcher(lambda: ranks)
    [taken] = watcher.check()
    assert (taken.job_name, taken.rank, taken.pid) == ("jt", 1, first.pid)
    assert taken.why == "its /metrics did not answer the liveness probe"
    assert (taken.step, taken.in_step) == (3, False) and "in __getitem__" in taken.text
    assert abs(taken.at - time.time()) < 10
    assert watcher.captured_at("jt", 1) == taken.at
    first.stop()
    ranks[0].exit = "ended"
    assert watcher.check() == []
    assert watcher.capture_of("jt", 1) == taken   # kept, the rank gone
    second = child("loader")
    ranks.append(followed(second, answering=False))
    [newer] = watcher.check()
    assert newer.pid == second.pid and watcher.capture_of("jt", 1) == newer
    assert [c.pid for c in watcher.captures()] == [second.pid]


# ---------------------------------------------------------------- the triggers
def watch_for(watcher: stacks.StackWatcher, seconds: float) -> list[stacks.Capture]:
    """Run the watcher's checks every 0.1 s for `seconds`; the captures taken."""
    taken: list[stacks.Capture] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        taken += watcher.check()
        time.sleep(0.1)
    return taken


def test_no_capture_while_the_heartbeat_advances_one_once_it_stops_and_again_later(child):
    rank = child("steps", "--step-seconds", "0.05")
    watcher = stacks.StackWatcher(lambda: [followed(rank)], floor=1.5, recapture=3.0)
    assert watch_for(watcher, 3.0) == []   # 20 steps a second: healthy
    rank.control("block")                  # its loader blocks, between two steps
    blocked = time.time()
    first = wait_for(watcher.check, settle(1.5), 0.1, "a capture of the blocked rank")[0]
    print(f"captured {first.at - blocked:.2f} s after the loader blocked (floor 1.5 s)")
    assert 1.5 <= first.at - blocked
    assert first.why.startswith("no step for ") and "between steps after step " in first.why
    assert first.in_step is False and "in __getitem__" in first.text
    # while it lasts: again every `recapture` seconds, not more often
    again = wait_for(watcher.check, settle(3.0), 0.1, "the next capture")[0]
    assert again.at - first.at >= 3.0 and watcher.capture_of("jt", 1) == again
    rank.control("block", present=False)   # it steps again: the episode ends
    assert watch_for(watcher, 3.5) == []
    assert watcher.capture_of("jt", 1) == again   # the last capture stays


def test_the_threshold_is_ten_mean_step_intervals_above_the_floor(child):
    rank = child("steps", "--step-seconds", "0.25")
    watcher = stacks.StackWatcher(lambda: [followed(rank)], floor=1.0)
    assert watch_for(watcher, 2.0) == []
    mean = stacks.mean_interval(watcher._watches[rank.pid].beats)
    assert mean is not None and 0.25 <= mean < 0.6
    rank.control("block")   # blocked 1.5 s: above the floor, below 10 x 0.25 s
    assert watch_for(watcher, 1.5) == []
    rank.control("block", present=False)
    assert watch_for(watcher, 1.0) == []
    rank.control("block")
    blocked = time.time()
    [taken] = wait_for(watcher.check, settle(10 * mean), 0.1, "a capture")
    assert taken.at - blocked >= 10 * 0.25 - 0.1


def test_a_rank_that_answers_now_and_then_is_captured_once_a_floor_at_most(child):
    rank = child("loader")
    ranks = [followed(rank, answering=False)]
    watcher = stacks.StackWatcher(lambda: ranks, floor=2.0)
    [first] = watcher.check()
    ranks[0].answering = True    # one probe answered: the episode ends
    assert watcher.check() == []
    ranks[0].answering = False   # silent again: a new episode, too soon after the capture
    assert watch_for(watcher, 1.0) == []
    [second] = wait_for(watcher.check, settle(2.0), 0.1, "the next episode's capture")
    assert second.at - first.at >= 2.0


def test_a_rank_whose_run_ended_lingers_without_captures(child):
    rank = child("steps", "--step-seconds", "0.05")
    watcher = stacks.StackWatcher(lambda: [followed(rank)], floor=1.0)
    assert watch_for(watcher, 1.5) == []
    rank.control("end")   # its final status shown: it lingers, no more steps, on purpose
    assert watch_for(watcher, 3.0) == []
    assert Path(rank.announcement.stack_file).read_text() == ""


def test_no_capture_before_the_first_measured_steps(child):
    # blocked before its first step (as a rank compiling its graph); blocked by the test after
    # it started, it once made two steps first on a loaded machine, and was then captured
    rank = child("steps", "--step-seconds", "0.05", "--start-blocked")
    watcher = stacks.StackWatcher(lambda: [followed(rank)], floor=0.5)
    assert watch_for(watcher, 2.0) == []


# ---------------------------------------------------------------- the node agent serves it
def test_the_node_agent_captures_serves_and_reports_a_stuck_rank(child, tmp_path):
    agent = NodeAgent(os.getpid(), AgentSettings(rank_port=free_port(), job_name="jt",
                                                 probe_interval=0.5, scan_interval=0.2))
    agent.stacks.floor, agent.stacks.check_interval = 1.0, 0.2
    endpoint = NodeEndpoint(NodeCollector(agent.views), PrometheusConfig(host="127.0.0.1"),
                            free_port())
    try:
        agent.start()
        rank = child("steps", RANK_ID="1", OTEL_SERVICE_NAME="jt")
        wait_for(lambda: agent.followed(), settle(5), 0.1, "the agent following the rank")
        assert endpoint.start()
        agent.stacks.opened(endpoint)
        base = f"http://127.0.0.1:{endpoint.port}"
        assert read_node_endpoint(rank.directory) == (endpoint.port, "http")
        index = get(base + "/stacks")
        assert index.status == 200 and "none: every rank steps" in index.text
        missing = get(base + "/stacks?job_name=jt&rank=1")
        assert missing.status == 404 and "no stack capture of job 'jt' rank 1" in missing.text
        assert get(base + "/stacks?rank=x").status == 400
        assert request(base + "/stacks", "POST", b"").status == 405
        time.sleep(2.0)   # it steps, watched
        assert agent.stacks.captures() == []
        rank.control("block")   # its loader blocks: no step for more than the floor
        body = wait_for(lambda: (r := get(base + "/stacks?job_name=jt&rank=1")).status == 200
                        and r.text, settle(5), 0.2, "the capture served")
        print(body[:600])
        head = dict(line.split(": ", 1) for line in body.split("\n\n", 1)[0].splitlines()
                    if ": " in line)
        assert (head["job"], head["rank"], head["pid"]) == ("jt", "1", str(rank.pid))
        step = head["step"].split()[0]
        assert head["why"].startswith("no step for ") and \
            head["why"].endswith(f"between steps after step {step}")
        assert int(step) > 10 and head["step"] == f"{step} (between steps)"
        assert head["captured at"].endswith(")") and "in __getitem__" in body
        listed = get(base + "/stacks?format=json").json()["captures"]
        assert [(c["job_name"], c["rank"], c["pid"], c["url"]) for c in listed] == \
            [("jt", 1, rank.pid, "/stacks?job_name=jt&rank=1")]
        series = samples(scrape(base + "/metrics"))
        stamp = series[("mfotel_node_rank_stack_timestamp_seconds", frozenset(
            {"job_name": "jt", "rank": "1", "scheme": "http"}.items()))]
        assert stamp == listed[0]["at"] == agent.stacks.captured_at("jt", 1)
        rank.stop()   # kept, served, reported after the rank ended
        wait_for(lambda: all(r.exit for r in agent.followed()), settle(5), 0.1, "its end")
        time.sleep(2 * endpoint_refresh())
        assert "in __getitem__" in get(base + "/stacks?job_name=jt&rank=1").text
        assert json.loads(get(base + "/stacks?format=json").body)["captures"][0]["at"] == stamp
        assert samples(scrape(base + "/metrics"))[("mfotel_node_rank_stack_timestamp_seconds",
            frozenset({"job_name": "jt", "rank": "1", "scheme": "http"}.items()))] == stamp
    finally:
        endpoint.close()
        agent.close()


def endpoint_refresh() -> float:
    """The node endpoint re-collects at most once a second (mfotel.node.endpoint._each_second)."""
    return 1.0


# ---------------------------------------------------------------- the rank's live page
def test_the_live_page_links_the_stacks_once_the_node_endpoint_says_where(tmp_path):
    assert stacks_link("jt", 1, None)() is None   # no launcher: no link
    link = stacks_link("j t", 1, tmp_path)
    assert link() is None                         # its endpoint not open yet
    write_node_endpoint(tmp_path, 9463, "https")
    fresh = stacks_link("j t", 1, tmp_path)
    assert fresh() == {"port": 9463, "scheme": "https", "path": "/stacks",
                       "query": "job_name=j+t&rank=1"}


def test_the_stacks_are_behind_the_node_endpoints_web_config(tmp_path):
    hashed = bcrypt.hashpw(b"node-pw", bcrypt.gensalt(rounds=4)).decode()
    web = tmp_path / "web.yml"
    web.write_text(f"basic_auth_users:\n  viewer: '{hashed}'\n")
    watcher = stacks.StackWatcher(lambda: [])
    endpoint = NodeEndpoint(NodeCollector(lambda: []), PrometheusConfig(
        host="127.0.0.1", web_config_file=str(web)), free_port())
    try:
        assert endpoint.start()
        watcher.opened(endpoint)
        base = f"http://127.0.0.1:{endpoint.port}"
        for path in ("/stacks", "/stacks?job_name=jt&rank=1", "/metrics"):
            assert get(base + path).status == 401, path
        assert get(base + "/stacks", auth=basic_auth("viewer", "wrong")).status == 401
        reply = get(base + "/stacks", auth=basic_auth("viewer", "node-pw"))
        assert reply.status == 200 and reply.headers["Content-Type"].startswith("text/plain")
        assert reply.headers["X-Content-Type-Options"] == "nosniff"
    finally:
        endpoint.close()
