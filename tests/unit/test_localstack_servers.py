"""The local stack's servers (real `prometheus`) leave nothing behind that they made."""
from __future__ import annotations

import urllib.request

import pytest

from mfotel.localstack.servers import Prometheus

CONFIG = "global:\n  scrape_interval: 15s\n"


def test_a_server_removes_the_directory_it_made_and_keeps_one_it_was_given(tmp_path):
    with Prometheus(CONFIG) as prom:
        made = prom.workdir
        assert (made / "prometheus.log").is_file()
        with urllib.request.urlopen(f"{prom.url}/-/ready", timeout=5) as response:
            assert response.status == 200
    assert not made.exists()
    with Prometheus(CONFIG, workdir=tmp_path / "given") as prom:
        pass
    assert (tmp_path / "given" / "prometheus.log").is_file()


def test_a_failed_start_tells_the_servers_log_and_leaves_no_directory():
    prom = Prometheus("global: [not, a, mapping]\n")
    with pytest.raises(RuntimeError, match=r"prometheus exited with 2:\n.*Error loading config"):
        prom.start()
    assert prom.process is None and not prom.workdir.exists()
