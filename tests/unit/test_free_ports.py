"""Free ports for the local stack: picked below the ephemeral range, or within
MFOTEL_FREE_PORTS when set (each test worker has its own range)."""
from __future__ import annotations

import os
import socket

import pytest

from mfotel.localstack import servers
from mfotel.localstack.servers import PORTS_ENV, PORTS_LOW, free_port, free_port_block


def test_each_worker_of_a_parallel_run_picks_from_its_own_range():
    if "PYTEST_XDIST_WORKER" not in os.environ:
        pytest.skip("only under xdist (make test runs it so)")  # the range is per worker
    low, high = map(int, os.environ[PORTS_ENV].split("-"))
    count = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    index = int(os.environ["PYTEST_XDIST_WORKER"].removeprefix("gw"))
    assert high - low + 1 == (servers.ephemeral_low() - PORTS_LOW) // count
    assert low == PORTS_LOW + index * (high - low + 1)
    assert all(low <= free_port() <= high for _ in range(20))


def test_blocks_stay_inside_the_range_and_are_free(monkeypatch):
    with socket.socket() as sock:   # a port taken inside a 7-port range: the block avoids it
        taken = free_port()  # at least PORTS_LOW: the range below it is valid
        sock.bind(("127.0.0.1", taken))
        monkeypatch.setenv(PORTS_ENV, f"{taken - 3}-{taken + 3}")
        for _ in range(20):
            base = free_port_block(3)
            assert taken - 3 <= base and base + 2 <= taken + 3
            assert taken not in range(base, base + 3)


@pytest.mark.parametrize("spec", ["20000", "20000-19999", "a-b", "80-90", "20000-70000",
                                  "20000-20001"])
def test_a_bad_range_names_the_variable_and_the_fix(monkeypatch, spec):
    monkeypatch.setenv(PORTS_ENV, spec)
    with pytest.raises(ValueError) as raised:
        free_port_block(3)
    message = str(raised.value)
    assert message.startswith(f"{PORTS_ENV}={spec!r}: expected LOW-HIGH") and \
        f"{PORTS_ENV}=20000-21999" in message and "room for 3 port(s)" in message


def test_a_port_handed_out_is_not_handed_out_again_while_the_range_has_others(monkeypatch):
    """A block picked and not bound yet (a rank's ports, bound a minute later) is not picked
    again: msrun's master port once took a rank's port, and the rank never served /metrics."""
    low = free_port_block(12)   # 12 ports free now, in a range of their own
    monkeypatch.setenv(PORTS_ENV, f"{low}-{low + 11}")
    monkeypatch.setattr(servers, "_handed", servers.collections.deque(
        maxlen=servers.RECENT_PORTS))
    block = free_port_block(3)
    singles = [free_port() for _ in range(9)]   # none bound: all free all along
    assert sorted([*range(block, block + 3), *singles]) == list(range(low, low + 12))
    # every port handed out lately: the range's free ones again, rather than none
    assert low <= free_port() < low + 12
