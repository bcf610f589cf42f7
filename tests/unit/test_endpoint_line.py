"""The line a run prints at train begin saying where each local rank's /metrics is
(mfotel.telemetry.local_endpoints_line): who prints it, and an address a user can use. Real
training runs print it in tests/e2e/test_callback_e2e.py and test_multirank_msrun.py."""
from __future__ import annotations

import re

import pytest

from mfotel.config import parse_config
from mfotel.identity import RankIdentity
from mfotel.telemetry import local_endpoints_line


def _line(prometheus: dict, rank: int = 0, local: int = 0, ranks: int = 2, node: str = "gpu7",
          **kwargs: object) -> str | None:
    cfg = parse_config({"prometheus": prometheus, "log_rank": kwargs.pop("log_rank", 0)})
    identity = RankIdentity(rank=rank, local_rank=local, world_size=16,
                            local_world_size=ranks, node=node)
    return local_endpoints_line(cfg, identity, "llama", **kwargs)  # type: ignore[arg-type]


def _addresses(line: str | None) -> list[tuple[str, str]]:
    assert line is not None
    return re.findall(r"(\S+/metrics) \(local rank (\d+)\)", line)


def test_a_wildcard_host_is_shown_as_the_machine_name():
    line = _line({}, page=True)     # the defaults: 0.0.0.0, port 9464
    assert _addresses(line) == [("http://gpu7:9464/metrics", "0"),
                                ("http://gpu7:9465/metrics", "1")]
    assert line is not None and line.startswith("mfotel: job llama on gpu7: /metrics at ")
    assert "the live page at / of each port, e.g. http://gpu7:9464/" in line
    assert line.endswith("(listening on every interface)")


def test_loopback_says_so_and_tls_is_https():
    line = _line({"host": "127.0.0.1", "port": 9100}, scheme="https")
    assert _addresses(line) == [("https://127.0.0.1:9100/metrics", "0"),
                                ("https://127.0.0.1:9101/metrics", "1")]
    assert line is not None and "live page" not in line
    assert "loopback only: other machines cannot reach it" in line
    assert "monitor_config.prometheus.host" in line


def test_an_ipv6_host_is_bracketed_and_a_port_not_bound_is_said():
    line = _line({"host": "::1", "port": 9100}, ranks=1, served=False)
    assert _addresses(line) == [("http://[::1]:9100/metrics", "0")]
    assert line is not None and "[not served: see the warning above]" in line


@pytest.mark.parametrize(("log_rank", "rank", "local", "printed"), [
    (0, 0, 0, True), (0, 1, 1, False),            # the logging rank only
    (-1, 8, 0, True), (-1, 9, 1, False),          # every rank logs: one line per node
    ([0, 8], 8, 0, True), ([0, 8], 9, 1, False),  # the second node's logging rank
    ([3], 3, 3, True), ([3], 0, 0, False),        # the node's first logging rank
])
def test_only_the_nodes_first_logging_rank_prints(log_rank, rank, local, printed):
    line = _line({"port": 9464}, rank=rank, local=local, ranks=8, log_rank=log_rank)
    assert (line is not None) == printed
    if printed:
        assert _addresses(line) == [(f"http://gpu7:{9464 + i}/metrics", str(i))
                                    for i in range(8)]


def test_an_unknown_node_size_lists_this_rank_and_port_0_prints_nothing():
    assert _addresses(_line({"port": 9464}, rank=5, local=5, ranks=0, log_rank=5)) == [
        ("http://gpu7:9469/metrics", "5")]
    assert _line({"port": 0}) is None
