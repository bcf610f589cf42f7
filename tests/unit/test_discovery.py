"""file_sd target files, `mfotel targets`, and telling a rank collision from a busy port."""
from __future__ import annotations

import json
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml

from mfotel.cluster.discovery import (
    FileSdWriter,
    advertised_host,
    check_port_collision,
    main,
    parse_hostfile,
    probe_owner,
    rank_targets,
    target_groups,
    write_target_file,
)
from mfotel.config import ConfigError, parse_config
from mfotel.identity import RankIdentity
from mfotel.telemetry import BIND_RETRY_SECONDS
from tests.support.endpoint import serve
from tests.support.http import get
from tests.support.ranks import rank_exporter
from tests.support.waiting import settle, wait_for


@pytest.mark.parametrize("hosts, per_node, base, expected", [
    (["a"], 2, 9464, ["a:9464", "a:9465"]),
    (["a", "b"], 2, 9000, ["a:9000", "a:9001", "b:9000", "b:9001"]),
    ({"a": 1, "b": 3}, 8, 100, ["a:100", "b:100", "b:101", "b:102"]),
    (["fe80::1"], 1, 9464, ["[fe80::1]:9464"]),
])
def test_rank_targets_are_host_and_base_plus_local_rank(hosts, per_node, base, expected):
    assert rank_targets(hosts, per_node, base) == expected


@pytest.mark.parametrize("hosts, per_node, base, message", [
    (["a", "a"], 2, 9464, "listed twice"),
    (["a"], 3, 65534, "do not fit"),
])
def test_rank_targets_refuse_collisions(hosts, per_node, base, message):
    with pytest.raises(ValueError, match=message):
        rank_targets(hosts, per_node, base)


def test_target_groups_one_per_node_with_labels_and_scheme():
    groups = target_groups(["n1", "n2"], 2, 9464, {"cluster": "a"}, scheme="https")
    assert groups == [
        {"targets": ["n1:9464", "n1:9465"], "labels": {"cluster": "a", "__scheme__": "https"}},
        {"targets": ["n2:9464", "n2:9465"], "labels": {"cluster": "a", "__scheme__": "https"}}]


@pytest.mark.parametrize("text, expected", [
    ("n1\nn2\n", {"n1": 4, "n2": 4}),
    ("n1 slots=8\n# comment\n\nn2 slots=2  # trailing\n", {"n1": 8, "n2": 2}),
    ("n1:3\n", {"n1": 3}),
])
def test_parse_hostfile(text, expected):
    assert parse_hostfile(text, default_slots=4) == expected


@pytest.mark.parametrize("text, message", [("", "no host"), ("n1\nn1\n", "twice"),
                                           ("slots=3\n", "cannot read")])
def test_parse_hostfile_errors_name_the_line(text, message):
    with pytest.raises(ValueError, match=message):
        parse_hostfile(text, 1)


def test_write_target_file_is_atomic_json_or_yaml(tmp_path):
    groups = target_groups(["n1"], 1, 9464)
    json_path = write_target_file(tmp_path / "t" / "job.json", groups)
    yaml_path = write_target_file(tmp_path / "t" / "job.yml", groups)
    assert json.loads(json_path.read_text()) == groups
    assert yaml.safe_load(yaml_path.read_text()) == groups
    assert sorted(p.name for p in (tmp_path / "t").iterdir()) == ["job.json", "job.yml"]


def _cfg(**keys):
    keys.setdefault("prometheus", {"host": "127.0.0.1", "port": 9464})
    return parse_config(keys)


def test_job_mode_rank0_lists_every_local_rank(tmp_path):
    cfg = _cfg(file_sd={"path": str(tmp_path / "{job_name}.json")})
    ident = RankIdentity(rank=0, local_rank=0, world_size=4, local_world_size=4, node="n1")
    writer = FileSdWriter(cfg, ident, "llama")
    path = writer.write()
    assert path == tmp_path / "llama.json"
    assert json.loads(path.read_text()) == [
        {"targets": [f"127.0.0.1:{p}" for p in range(9464, 9468)], "labels": {}}]
    writer.remove()
    assert not path.exists()


def test_job_mode_other_ranks_write_nothing(tmp_path):
    cfg = _cfg(file_sd={"path": str(tmp_path / "j.json")})
    ident = RankIdentity(rank=1, local_rank=1, world_size=2, local_world_size=2)
    assert FileSdWriter(cfg, ident, "j").write() is None and not (tmp_path / "j.json").exists()


def test_job_mode_multi_node_uses_hosts_in_node_order(tmp_path):
    cfg = _cfg(prometheus={"host": "0.0.0.0", "port": 9000},
               file_sd={"path": str(tmp_path / "j.json"), "hosts": ["n1", "n2"],
                        "labels": {"cluster": "x"}})
    ident = RankIdentity(rank=0, world_size=4, local_world_size=2, node="n1")
    groups = json.loads(FileSdWriter(cfg, ident, "j").write().read_text())
    assert groups == [{"targets": ["n1:9000", "n1:9001"], "labels": {"cluster": "x"}},
                      {"targets": ["n2:9000", "n2:9001"], "labels": {"cluster": "x"}}]


def test_job_mode_multi_node_without_hosts_is_an_error(tmp_path):
    cfg = _cfg(file_sd={"path": str(tmp_path / "j.json")})
    ident = RankIdentity(rank=0, world_size=16, local_world_size=8)
    with pytest.raises(ConfigError, match="file_sd.hosts.*2 nodes|16 ranks on 2 nodes"):
        FileSdWriter(cfg, ident, "j").write()


def test_rank_mode_each_rank_lists_itself_with_https(tmp_path):
    cfg = _cfg(prometheus={"host": "0.0.0.0", "port": 9464, "certfile": "c.pem",
                           "keyfile": "k.pem"},
               file_sd={"path": str(tmp_path / "{job_name}-{rank}.json"), "mode": "rank"})
    ident = RankIdentity(rank=5, local_rank=1, world_size=8, local_world_size=4, node="n2")
    path = FileSdWriter(cfg, ident, "j").write()
    assert path.name == "j-5.json"
    assert json.loads(path.read_text()) == [{"targets": ["n2:9465"],
                                             "labels": {"__scheme__": "https"}}]


def test_advertised_host_is_the_bind_address_unless_wildcard():
    ident = RankIdentity(node="n7", node_rank=1)
    assert advertised_host(_cfg(prometheus={"host": "10.0.0.5"}), ident) == "10.0.0.5"
    assert advertised_host(_cfg(prometheus={"host": "0.0.0.0"}), ident) == "n7"
    assert advertised_host(_cfg(file_sd={"hosts": ["a", "b"]}), ident) == "b"


def test_targets_cli_prints_and_writes(tmp_path, capsys):
    assert main(["--hosts", "n1,n2", "--ranks-per-node", "2", "--port", "9500",
                 "--label", "cluster=a"]) == 0
    assert json.loads(capsys.readouterr().out) == target_groups(["n1", "n2"], 2, 9500,
                                                                {"cluster": "a"})
    hostfile = tmp_path / "hosts"
    hostfile.write_text("n1 slots=1\nn2 slots=2\n")
    out = tmp_path / "sd" / "job.json"
    assert main(["--hostfile", str(hostfile), "--out", str(out)]) == 0
    assert json.loads(out.read_text()) == [{"targets": ["n1:9464"], "labels": {}},
                                           {"targets": ["n2:9464", "n2:9465"], "labels": {}}]
    assert "3 targets" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--hosts", "n1", "--label", "rank=1"], "already carries"),
    (["--hosts", "n1,n1"], "twice"),
    (["--hosts", "n1", "--port", "65535", "--ranks-per-node", "2"], "do not fit"),
])
def test_targets_cli_errors(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


# ------------------------------------------------------------------ who holds a port
@pytest.fixture
def serving_rank(port):
    """A real mfotel endpoint: rank 0 of job `llama`, local rank 0, on `port`."""
    cfg = parse_config({"prometheus": {"host": "127.0.0.1", "port": port}})
    ident = RankIdentity(rank=0, local_rank=0, world_size=2, node="n1")
    with rank_exporter(cfg, ident, "llama") as exporter:
        yield exporter


def test_probe_owner_reads_the_rank_behind_a_port(serving_rank, port):
    """... without ending its linger: a rank of the last run, lingering for Prometheus' scrape
    of its final status, is asked by a new run's rank who holds the port."""
    assert probe_owner("127.0.0.1", port) == {"job_name": "llama", "rank": "0",
                                              "local_rank": "0", "status": "0"}
    assert serving_rank.telemetry.wait_scraped(0.3) is False


def test_second_rank_on_the_same_port_is_a_clear_error(serving_rank, port):
    cfg = parse_config({"prometheus": {"host": "127.0.0.1", "port": port}})
    ident = RankIdentity(rank=1, local_rank=0, world_size=2, local_rank_source="env:DEVICE_ID")
    with pytest.raises(ConfigError) as error:
        check_port_collision(cfg, ident, "llama", port)
    text = str(error.value)
    assert f"rank 1 (local rank 0) and rank 0 (local rank 0) of job llama both want port {port}" \
        in text and "env:DEVICE_ID" in text and "init()" in text


@pytest.mark.parametrize("job, status", [("other-job", 1), ("llama", 2)])
def test_other_jobs_and_lingering_runs_are_not_collisions(serving_rank, port, job, status):
    serving_rank.state.status = status
    serving_rank.instruments.touch()
    cfg = parse_config({"prometheus": {"host": "127.0.0.1", "port": port}})
    check_port_collision(cfg, RankIdentity(rank=1), job, port)  # no error


def test_a_foreign_server_is_not_a_collision(port):
    class Plain(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"hello")

        def log_message(self, *args):
            pass
    server = ThreadingHTTPServer(("127.0.0.1", port), Plain)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert probe_owner("127.0.0.1", port) is None
        check_port_collision(parse_config({"prometheus": {"host": "127.0.0.1", "port": port}}),
                             RankIdentity(rank=1), "llama", port)
    finally:
        server.shutdown()
        server.server_close()


def test_targets_subcommand_hook_registers_on_a_cli(capsys):
    import argparse

    from mfotel.cluster.discovery import add_targets_command
    parser = argparse.ArgumentParser(prog="mfotel")
    add_targets_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["targets", "--hosts", "n1", "--ranks-per-node", "1"])
    assert args.func(args) == 0
    assert json.loads(capsys.readouterr().out) == [{"targets": ["n1:9464"], "labels": {}}]


def test_a_busy_port_is_bound_as_soon_as_it_is_free(port, caplog):
    """The port held by something else (the lingering rank of the job's last run, another
    program probing it): the rank warns, counts the error, and serves once the port is free,
    instead of training the whole run without an endpoint. Stopping gives up a waiting bind."""
    holder = _listening(port)
    with caplog.at_level(logging.WARNING, logger="mfotel"):
        telemetry, instruments = serve(port)
    try:
        assert telemetry.endpoint is None
        assert instruments.state.export_errors.get("server") == 1
        assert "binds as soon as the port is free" in caplog.text
        holder.close()
        wait_for(lambda: telemetry.endpoint is not None, settle(5 * BIND_RETRY_SECONDS), 0.1,
                 "the endpoint bound once the port was free")
        assert b"mindformers_train_loss" in get(f"http://127.0.0.1:{port}/metrics").body
        assert f"serves /metrics on 127.0.0.1:{port} now" in caplog.text
    finally:
        telemetry.shutdown()
    # a bind still waiting when the endpoint stops never binds
    holder = _listening(port)
    telemetry, _ = serve(port)
    telemetry.shutdown()
    holder.close()
    time.sleep(2 * BIND_RETRY_SECONDS)
    assert telemetry.endpoint is None
    _listening(port).close()  # nobody took it


def _listening(port: int) -> socket.socket:
    """A socket listening on 127.0.0.1:port (SO_REUSEADDR, as servers bind: a closed scrape's
    TIME_WAIT does not hold the port)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock
