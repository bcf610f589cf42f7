"""The rank's side of the node agent's rendezvous (mfotel.node_link), in this very process."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from mfotel.node_link import (
    STACK_SIGNAL,
    Announcement,
    NodeLink,
    announce,
    announcements,
    node_dir,
    read_node_endpoint,
    read_progress,
    write_node_endpoint,
)


@pytest.fixture
def link(tmp_path):
    joined = NodeLink.join(Announcement(os.getpid(), "jt", 3, local_rank=1, world_size=4,
                                        address="127.0.0.1", port=9465), tmp_path)
    assert joined is not None
    yield joined
    joined.close()


def test_without_the_launchers_directory_nothing_is_joined(monkeypatch, tmp_path):
    monkeypatch.delenv("MFOTEL_NODE_DIR", raising=False)
    assert node_dir() is None
    assert NodeLink.join(Announcement(os.getpid(), "jt", 0)) is None
    assert node_dir({"MFOTEL_NODE_DIR": str(tmp_path / "gone")}) is None
    assert node_dir({"MFOTEL_NODE_DIR": str(tmp_path)}) == tmp_path


def test_a_rank_announces_who_it_is_and_where_it_serves(link, tmp_path):
    [told] = announcements(tmp_path)
    assert told == link.announcement
    assert (told.pid, told.job_name, told.rank, told.local_rank, told.world_size) == \
        (os.getpid(), "jt", 3, 1, 4)
    assert (told.address, told.port, told.scheme) == ("127.0.0.1", 9465, "http")
    assert told.stack_signal == int(STACK_SIGNAL) == int(signal.SIGURG)
    assert told.stack_file == str(tmp_path / f"stacks-{os.getpid()}.txt")
    assert told.progress_file == str(tmp_path / f"progress-{os.getpid()}")


def test_the_heartbeat_tells_the_step_and_whether_the_rank_is_inside_one(link):
    path = link.announcement.progress_file
    assert read_progress(path) is not None and read_progress(path).step == 0
    link.step_begin(100.0)
    inside = read_progress(path)
    assert (inside.begin, inside.end, inside.in_step) == (100.0, 0.0, True)
    link.step_end(7, 100.5)
    after = read_progress(path)
    assert (after.step, after.begin, after.end, after.in_step) == (7, 100.0, 100.5, False)


def test_the_signal_dumps_every_threads_stack_and_the_process_carries_on(link):
    def blocked_in_a_loader() -> None:
        time.sleep(5)
    thread = threading.Thread(target=blocked_in_a_loader, daemon=True)
    thread.start()
    time.sleep(0.1)
    os.kill(os.getpid(), STACK_SIGNAL)
    time.sleep(0.2)   # the handler ran in C when the signal arrived; the dump is written
    text = open(link.announcement.stack_file).read()
    assert "blocked_in_a_loader" in text and "most recent call first" in text
    assert text.count("Thread 0x") + text.count("Current thread 0x") >= 2


def test_after_close_the_signal_is_ignored_again(link):
    link.close()
    os.kill(os.getpid(), STACK_SIGNAL)   # SIGURG's default action: ignore
    time.sleep(0.1)
    assert open(link.announcement.stack_file).read() == ""
    link.step_end(3, 1.0)   # closed: nothing written, nothing raised


def test_bad_or_partial_announcements_are_skipped(tmp_path):
    announce(tmp_path, Announcement(41, "jt", 0))
    (tmp_path / "rank-42.json").write_text('{"pid": 42, "job_name": "jt"')      # half written
    (tmp_path / "rank-43.json").write_text('{"pid": "43", "job_name": "jt", "rank": 0}')
    (tmp_path / "rank-44.json").write_text('[1, 2]')
    os.mkfifo(tmp_path / "rank-45.json")                                       # never blocks
    assert [a.pid for a in announcements(tmp_path)] == [41]
    assert read_progress(tmp_path / "progress-41") is None


def test_the_heartbeat_tells_when_the_run_ended(link):
    path = link.announcement.progress_file
    link.step_end(9, 100.5)
    assert read_progress(path).ended == 0.0
    link.run_ended(101.0)   # its final status shown: it lingers, it does not step
    assert (read_progress(path).step, read_progress(path).ended) == (9, 101.0)


def test_the_agent_says_where_its_node_endpoint_serves(tmp_path):
    assert read_node_endpoint(tmp_path) is None
    write_node_endpoint(tmp_path, 9463, "https")
    assert read_node_endpoint(tmp_path) == (9463, "https")
    (tmp_path / "node.json").write_text('{"port": "9463", "scheme": "http"}')
    assert read_node_endpoint(tmp_path) is None
    (tmp_path / "node.json").write_text('{"port": 9463, "scheme": "file"}')
    assert read_node_endpoint(tmp_path) is None
