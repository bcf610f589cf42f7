"""The suite's own process killing (tests/support/processes.py) reaches only the process meant.

pids are reused (pid_max is 32768 here, and every MindSpore thread takes one): a pid a test saw
earlier may name another process by the time it is killed. Real processes here; a reused pid is
stood in for by a recorded identity (start time) or tag that the live process does not have.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.support.processes import TAG, identities, kill_same, kill_tagged, running, signal_all

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]


@pytest.fixture
def sleepers() -> Iterator[list[subprocess.Popen]]:
    started: list[subprocess.Popen] = []
    yield started
    for process in started:
        process.kill()
        process.wait()


def start(sleepers: list[subprocess.Popen], **env: str) -> subprocess.Popen:
    sleepers.append(subprocess.Popen(SLEEP, env={**os.environ, **env}))
    return sleepers[-1]


def ended(process: subprocess.Popen) -> None:
    """Killed and reaped already (by the helper: its status is no longer Popen's to read)."""
    process.wait(timeout=10)
    assert not running(process.pid)


def test_kill_same_kills_the_process_seen_and_not_another_on_its_pid(sleepers):
    seen, other = start(sleepers), start(sleepers)
    known = identities([seen.pid, other.pid])
    assert set(known) == {seen.pid, other.pid} and all(ticks > 0 for ticks in known.values())
    known[other.pid] -= 1   # as if `other` had taken the pid of a process seen before it
    kill_same(known)
    ended(seen)
    assert running(other.pid) and other.poll() is None


def test_kill_tagged_kills_only_what_carries_the_tag(sleepers, tmp_path):
    tagged, untagged = start(sleepers, **{TAG: str(tmp_path)}), start(sleepers)
    other_tag = start(sleepers, **{TAG: f"{tmp_path}-2"})   # a prefix is not the tag
    lines = kill_tagged(str(tmp_path))
    assert lines == [" ".join(SLEEP)]
    ended(tagged)
    assert untagged.poll() is None and other_tag.poll() is None


def test_signal_all_counts_what_it_reached_and_skips_the_gone(sleepers):
    alive = start(sleepers)
    gone = start(sleepers)
    gone.kill()
    gone.wait()   # reaped: its pid names no process of ours any more
    assert signal_all([alive.pid, gone.pid], signal.SIGTERM) == 1
    assert alive.wait(timeout=10) == -signal.SIGTERM
