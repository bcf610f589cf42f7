"""The node agent of `mfotel-instrument`: what it reads from /proc, how it tells the ranks from
the other processes of a job, what its endpoint serves, how it ends.

Real processes and real signals throughout: `node_agent_job.py` launches small ranks the way
msrun does (scheduler, a session per worker, `tail -f` helpers with a worker's environment,
forked helpers, reaping once a second, SIGKILL for the others when one fails), under the
real `mfotel-instrument`; the node endpoint and the ranks' endpoints are scraped over HTTP.
The msrun tests with MindSpore ranks and Prometheus are in e2e/test_node_agent_msrun.py.
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mfotel.node import liveness, procfs
from mfotel.node import metrics as node_metrics
from mfotel.node.agent import (
    DEFAULT_PROBE_INTERVAL,
    PORT_WINDOW,
    Exit,
    RankView,
    rank_info,
    rank_of,
)
from mfotel.node.oom import KILL_TO_EXIT_SECONDS, OomCounts, OomLedger
from mfotel.node.service import config_argument, node_port, training_config
from tests.support.metrics import samples, scrape
from tests.support.multirank import ROOT, child_env, free_port_block, stop_launcher
from tests.support.processes import TAG, kill_tagged, running, tree
from tests.support.scripts.handover import write_atomically
from tests.support.waiting import settle, wait_for

INSTRUMENT = [sys.executable, "-m", "mfotel.node.instrument"]
JOB_SCRIPT = ROOT / "tests" / "support" / "scripts" / "node_agent_job.py"
JOB = "node-agent"
PROBE_INTERVAL = 0.5


# ---------------------------------------------------------------- the series (pure)
def test_node_series_are_pinned():
    """Names, kinds and labels as exposed: dashboards, rules and users depend on them."""
    assert [(s.name, s.kind, s.labels) for s in node_metrics.SERIES] == [
        ("mfotel_node_rank_info", "gauge", ("local_rank", "pid")),
        ("mfotel_node_rank_state", "gauge", ("state",)),
        ("mfotel_node_rank_stopped_timestamp_seconds", "gauge", ()),
        ("mfotel_node_rank_endpoint_up", "gauge", ()),
        ("mfotel_node_rank_endpoint_last_answer_timestamp_seconds", "gauge", ()),
        ("mfotel_node_rank_cpu_seconds_total", "counter", ()),
        ("mfotel_node_rank_resident_memory_bytes", "gauge", ()),
        ("mfotel_node_rank_exit_info", "gauge", ("cause", "exit_code", "signal", "signal_name")),
        ("mfotel_node_rank_exit_timestamp_seconds", "gauge", ()),
        ("mfotel_node_rank_stack_timestamp_seconds", "gauge", ("scheme",)),
    ]


def test_exposition_of_a_live_and_an_ended_rank():
    from prometheus_client import CollectorRegistry, generate_latest
    views = [RankView("j", 0, 0, 100, "running", 1.5, 4096, True, 10.0, None),
             RankView("j", 1, 1, 101, "exited", 2.0, 8192, None, 9.0,
                      Exit(20.0, signal.SIGKILL, oom=True)),
             RankView("j", 2, 2, 102, "stopped", 1.0, 4096, None, 8.0, None, stopped_at=15.0)]
    registry = CollectorRegistry()
    registry.register(node_metrics.NodeCollector(lambda: views))
    body = samples(generate_latest(registry).decode())
    who = {"job_name": "j", "rank": "1"}
    assert body[("mfotel_node_rank_exit_info", frozenset({
        **who, "cause": "oom", "exit_code": "", "signal": "9",
        "signal_name": "SIGKILL"}.items()))] == 1
    assert body[("mfotel_node_rank_state", frozenset({**who, "state": "exited"}.items()))] == 1
    assert body[("mfotel_node_rank_state", frozenset({**who, "state": "running"}.items()))] == 0
    assert body[("mfotel_node_rank_cpu_seconds_total", frozenset(who.items()))] == 2.0
    assert body[("mfotel_node_rank_exit_timestamp_seconds", frozenset(who.items()))] == 20.0
    # endpoint_up only while something listens; exit facts only once ended
    assert [k for k in body if k[0] == "mfotel_node_rank_endpoint_up"] == [
        ("mfotel_node_rank_endpoint_up", frozenset({"job_name": "j", "rank": "0"}.items()))]
    assert [dict(k[1])["rank"] for k in body if k[0] == "mfotel_node_rank_exit_info"] == ["1"]
    # the stopped timestamp only while stopped
    assert [(dict(k[1])["rank"], v) for k, v in body.items()
            if k[0] == "mfotel_node_rank_stopped_timestamp_seconds"] == [("2", 15.0)]


@pytest.mark.parametrize("status, flags, cause, code, sig", [
    (0, {}, "completed", 0, None),
    (3 << 8, {}, "exit_code", 3, None),
    (signal.SIGKILL, {}, "signal", None, 9),
    (signal.SIGKILL, {"oom": True}, "oom", None, 9),
    (signal.SIGTERM, {"cancelled": True}, "cancelled", None, 15),
    (0, {"cancelled": True}, "cancelled", 0, None),
    (None, {}, "unknown", None, None),
])
def test_exit_cause(status, flags, cause, code, sig):
    done = Exit(1.0, status, **flags)
    assert (done.cause, done.exit_code, done.signal) == (cause, code, sig)
    assert done.failed == (cause in node_metrics.FAILED_CAUSES)


MSRUN_WORKER = {"RANK_SIZE": "2", "RANK_ID": "1", "MS_ROLE": "MS_WORKER", "DEVICE_ID": "1",
                "MS_NODE_ID": "1", "MS_WORKER_NUM": "2"}


@pytest.mark.parametrize("env, expected", [
    (MSRUN_WORKER, (1, 1)),
    ({**MSRUN_WORKER, "MS_ROLE": "MS_SCHED", "RANK_ID": "0"}, None),  # msrun's scheduler
    ({"MS_ROLE": "MS_WORKER", "MS_NODE_ID": "5", "DEVICE_ID": "1"}, (5, 1)),  # before RANK_ID
    ({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4"}, (3, 1)),   # torchrun style
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}, (2, 0)),
    ({"PATH": "/usr/bin"}, None),                                     # msrun itself, a shell
], ids=["msrun-worker", "msrun-scheduler", "ms-node-id", "torchrun", "mpirun", "no-rank"])
def test_rank_of_an_environment(env, expected):
    assert rank_of(env) == expected


def test_rank_info_of_a_metrics_body():
    body = (b'# HELP mindformers_train_rank_info x\nmindformers_train_rank_info{device_id="0",'
            b'job_name="llama \\"7b\\"",local_rank="1",rank="9"} 1.0\n')
    assert rank_info(body) == {"device_id": "0", "job_name": 'llama "7b"', "local_rank": "1",
                               "rank": "9"}
    assert rank_info(b"mindformers_train_loss 1\n") == {}


# ---------------------------------------------------------------- /proc and the probe
def test_procfs_reads_a_live_process_and_its_listening_socket():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        mine = procfs.read_stat(os.getpid())
        assert mine is not None and mine.state in ("R", "S", "D") and mine.ppid == os.getppid()
        assert mine.cpu_seconds > 0 and mine.rss_bytes > 10 << 20 and mine.exit_status is None
        assert ("127.0.0.1", port) in procfs.listening_ports(os.getpid())
        assert procfs.exe_name(os.getpid()).startswith("python")
    assert ("127.0.0.1", port) not in procfs.listening_ports(os.getpid())
    sleeper = subprocess.Popen(["sleep", "30"], env={"MFOTEL_TEST": "a=b", "EMPTY": ""})
    try:  # the environment exec gave it, once exec finished (the kernel sets the name first,
        # the new environment's place a moment later: an empty read in between)
        wait_for(lambda: procfs.exe_name(sleeper.pid) == "sleep", settle(10), 0.25, "sleep started")
        environ = wait_for(lambda: procfs.read_environ(sleeper.pid), settle(10), 0.1,
                           "sleep's environment")
        assert environ == {"MFOTEL_TEST": "a=b", "EMPTY": ""}
        assert procfs.exe_name(sleeper.pid) == "sleep"
    finally:
        sleeper.kill()
        sleeper.wait()
    # the kernel's OOM-kill count of our memory cgroup (v2 memory.events or v1 oom_control)
    file = procfs.memory_cgroup_file(os.getpid())
    assert file is not None and file.name in ("memory.events", "memory.oom_control")
    assert isinstance(procfs.oom_kill_count(file), int)


def test_a_zombie_shows_its_exit_status_until_its_parent_reaps_it():
    """What the agent reads of msrun's workers: not its children, reaped late (here once the
    test read the zombie: a parent reaping 2 s after the exit left a loaded machine's test too
    little time to see it)."""
    parent = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import os; os._exit(3)'])\n"
        "print(child.pid, flush=True); input(); child.wait()")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        pid = int(parent.stdout.readline())
        stat = wait_for(lambda: (s := procfs.read_stat(pid)) and s.ended and s,
                        settle(10), 0.25, "a zombie")
        assert os.waitstatus_to_exitcode(stat.exit_status) == 3
        parent.communicate("\n", timeout=60)
        assert procfs.read_stat(pid) is None
    finally:
        parent.kill()
        parent.wait(timeout=30)


def test_a_pidfd_tells_the_exit_status_after_the_parent_reaped():
    """What the agent reads when the launcher reaped a rank before it could read the zombie
    (Linux 6.15+: PIDFD_INFO_EXIT)."""
    parent = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys\n"
        "child = subprocess.Popen(['sleep', '60'])\n"
        "print(child.pid, flush=True); child.wait(); input()")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    pid = int(parent.stdout.readline())
    fd = os.pidfd_open(pid)
    try:
        assert procfs.pidfd_exit_status(fd) is None  # alive
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: procfs.read_stat(pid) is None, settle(10), 0.25, "reaped by its parent")
        assert procfs.pidfd_exit_status(fd) == signal.SIGKILL
    finally:
        os.close(fd)
        parent.communicate("\n", timeout=30)


def test_liveness_probe_outcomes():
    from prometheus_client import CollectorRegistry, start_http_server
    port = free_port_block(3)
    silent_port, closed_port = port + 1, port + 2
    server, thread = start_http_server(port, addr="127.0.0.1", registry=CollectorRegistry())
    try:
        answered = liveness.probe("127.0.0.1", port, "http", timeout=2.0, body=True)
        assert (answered.outcome, answered.status) == ("answered", 200)
        # prometheus_client refuses HEAD: a refusal is an answer too
        assert liveness.probe("127.0.0.1", port, "http", 2.0).outcome == "answered"
        with socket.socket() as backlog:  # listens, never accepts: the kernel queues clients
            backlog.bind(("127.0.0.1", silent_port))
            backlog.listen()
            silent = liveness.probe("127.0.0.1", silent_port, "http", timeout=0.5)
            assert silent.outcome == "silent" and 0.4 < silent.seconds < 1.5
        assert liveness.probe("127.0.0.1", closed_port, "http", 1.0).outcome == "refused"
    finally:
        server.shutdown()
        thread.join(5)


def test_neither_a_liveness_probe_nor_the_identity_read_ends_a_ranks_linger():
    """A rank lingers until a scrape has served its final values (`linger_until_scraped`).
    The agent's probe is answered by a real rank endpoint's server; its one GET of /metrics (the
    rank's identity) answers 200 with the values: neither counts, or a rank cancelled before
    the agent had read its identity ended its linger on that read and the final status never
    reached Prometheus (seen beside a CPU hog). Prometheus' own scrape then counts."""
    from tests.support.endpoint import serve
    from tests.support.http import get
    port = free_port_block(1)
    telemetry, _ = serve(port)
    try:
        probed = liveness.probe("127.0.0.1", port, "http", timeout=5.0)
        assert (probed.outcome, probed.status) == ("answered", 200)
        assert not telemetry.wait_scraped(0.5)
        identity = liveness.probe("127.0.0.1", port, "http", timeout=5.0, body=True)
        assert identity.status == 200 and b"mindformers_train_loss" in identity.body
        assert not telemetry.wait_scraped(0.5)
        scrape = get(f"http://127.0.0.1:{port}/metrics",
                     headers={"X-Prometheus-Scrape-Timeout-Seconds": "10"})
        assert scrape.status == 200
        assert telemetry.wait_scraped(2.0)
    finally:
        telemetry.shutdown()


def test_liveness_probe_of_endpoints_behind_basic_auth_and_mutual_tls(tmp_path):
    """The probe needs no secret: behind basic auth the server answers the liveness path
    itself; a TLS alert refusing the probe's missing client certificate is an answer too."""
    import bcrypt  # the [auth] extra (also in dev, which bootstrap installs): fail, never skip

    from tests.support.endpoint import make_pki, serve
    pki = make_pki(tmp_path)
    hashed = bcrypt.hashpw(b"secret", bcrypt.gensalt(rounds=4)).decode()
    auth = tmp_path / "auth.yml"
    auth.write_text(f"basic_auth_users:\n  prometheus: '{hashed}'\n")
    mtls = tmp_path / "mtls.yml"
    mtls.write_text(f"tls_server_config:\n  cert_file: {pki.cert('server')}\n"
                    f"  key_file: {pki.key('server')}\n"
                    "  client_auth_type: RequireAndVerifyClientCert\n"
                    f"  client_ca_file: {pki.ca}\n")
    for web, scheme, status in ((auth, "http", 200), (mtls, "https", None)):
        port = free_port_block(1)
        telemetry, _ = serve(port, web_config_file=str(web))
        try:
            result = liveness.probe("127.0.0.1", port, scheme, timeout=5.0)
            assert (result.outcome, result.status) == ("answered", status), web.name
        finally:
            telemetry.shutdown()


# ---------------------------------------------------------------- settings
def test_training_config_is_the_ranks_own(tmp_path, monkeypatch):
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    mindformers = tmp_path / "llama7b.yaml"
    mindformers.write_text("run_mode: train\ncallbacks:\n  - type: MFLossMonitor\n"
                           "  - type: OTelMonitor\n    prometheus: {port: 9500, host: 10.0.0.1}\n")
    command = ["msrun", "--worker_num=8", "run_mindformer.py", "--config", str(mindformers)]
    assert config_argument(command) == str(mindformers)
    cfg = training_config(command)
    assert (cfg.job_name, cfg.prometheus.port, cfg.prometheus.host, node_port(cfg)) == \
        ("llama7b", 9500, "10.0.0.1", 9499)
    # a mindformers YAML without mfotel's entry: the defaults (the ranks have no mfotel)
    plain = tmp_path / "other.yaml"
    plain.write_text("run_mode: train\ncallbacks:\n  - type: MFLossMonitor\n")
    cfg = training_config(["python", "run.py", f"--config={plain}"])
    assert (cfg.job_name, cfg.prometheus.port, node_port(cfg)) == ("mindformers", 9464, 9463)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "from-env")
    assert training_config(["python", "train.py"]).job_name == "from-env"


def test_bad_options_and_configs_are_clear_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("monitor_config:\n  prometheus: {node_port: 70000}\n")
    for args, message in (
            (["--node-port", "x", "true"], "--node-port needs a port in 0..65535"),
            (["--node-linger", "-1", "true"], "--node-linger needs seconds in [0"),
            (["--node-probe-interval", "0", "true"], "--node-probe-interval needs seconds in (0"),
            (["--config", str(bad), "true"], "monitor_config.prometheus.node_port: 70000"),
            (["--config", str(tmp_path / "missing.yaml"), "true"], "file not found")):
        result = subprocess.run([*INSTRUMENT, *args], capture_output=True, text=True,
                                timeout=60, env=child_env())
        assert result.returncode == 2 and message in result.stderr, (args, result.stderr)


# ---------------------------------------------------------------- the agent, end to end
class AgentJob:
    """`mfotel-instrument [options] node_agent_job.py` of `ranks` small ranks."""

    def __init__(self, tmp: Path, ranks: int, options: list[str], linger: float = 30.0,
                 config_job_name: str = "from-config", job_options: bool = False,
                 probe_interval: float = PROBE_INTERVAL) -> None:
        # `options` go to mfotel-instrument, or with `job_options` to node_agent_job.py
        launcher_options, script_options = ([], options) if job_options else (options, [])
        self.base = free_port_block(ranks + 1)
        self.node_port, self.rank_port = self.base, self.base + 1  # node_port: port - 1
        self.control = tmp / "control"
        self.control.mkdir()
        config = tmp / "train.yaml"
        config.write_text(f"monitor_config:\n  job_name: {config_job_name}\n  prometheus:\n"
                          f"    host: 127.0.0.1\n    port: {self.rank_port}\n"
                          f"  file_sd: {{path: '{tmp}/targets/{{job_name}}.json', "
                          f"labels: {{cluster: ci}}}}\n")
        self.target_file = tmp / "targets" / f"{config_job_name}.node-127.0.0.1.json"
        self.log = tmp / "agent.log"
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(
                [*INSTRUMENT, "--config", str(config), "--node-probe-interval",
                 str(probe_interval), "--node-linger", str(linger), *launcher_options,
                 sys.executable, str(JOB_SCRIPT), "--ranks", str(ranks), "--port",
                 str(self.rank_port), "--job-name", JOB, "--control", str(self.control),
                 *script_options],
                env=child_env(**{TAG: str(self.control)}), stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)
        self.pids = [int(wait_for(lambda r=r: self._pid(r),
                                  settle(60),
                                  0.25, f"rank {r} started",
                                  alive=(self.process,))) for r in range(ranks)]

    def _pid(self, rank: int) -> str | None:
        path = self.control / f"pid-{rank}"
        return path.read_text() if path.exists() and path.read_text() else None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.node_port}/metrics"

    def node(self) -> dict:
        try:
            return samples(scrape(self.url))
        except OSError:
            return {}

    def value(self, name: str, rank: int, **labels: str) -> float | None:
        found = [v for (n, lab), v in self.node().items() if n == name and
                 {("rank", str(rank)), *labels.items()} <= lab]
        return found[0] if found else None

    def state(self, rank: int) -> str | None:
        found = [dict(lab)["state"] for (n, lab), v in self.node().items()
                 if n == "mfotel_node_rank_state" and ("rank", str(rank)) in lab and v == 1]
        return found[0] if found else None

    def exit_info(self, rank: int) -> dict[str, str] | None:
        found = [dict(lab) for (n, lab), v in self.node().items()
                 if n == "mfotel_node_rank_exit_info" and ("rank", str(rank)) in lab]
        return found[0] if found else None

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture
def agent_job(tmp_path) -> Iterator[Any]:
    jobs: list[AgentJob] = []

    def start(ranks: int = 3, *options: str, **kwargs: Any) -> AgentJob:
        jobs.append(AgentJob(tmp_path, ranks, list(options), **kwargs))
        return jobs[-1]
    yield start
    for job in jobs:
        (job.control / "done").write_text("")
        # nothing is checked after: the agent's linger (its final scrape) is not waited out
        stop_launcher(job.process)
        # what is left, helpers orphaned on purpose (--orphan-helpers) included, by the tag
        # they inherited: never by a pid seen earlier, which another process may have taken
        kill_tagged(str(job.control))


def until(check: Any, what: str, timeout: float = 30.0) -> Any:
    return wait_for(check, settle(timeout), 0.1, what)


def test_the_agent_follows_each_rank_and_not_the_other_processes_of_the_job(agent_job):
    job = agent_job(3)
    listed = until(lambda: len(pids := {dict(lab)["pid"] for (n, lab), _ in job.node().items()
                                        if n == "mfotel_node_rank_info"}) == 3 and pids,
                   "three ranks listed")
    # the workers, not msrun's scheduler, the tails carrying a worker's environment, the
    # launcher or the ranks' forked helpers
    assert listed == {str(pid) for pid in job.pids}
    until(lambda: all((job.control / f"helper-{r}").exists() for r in range(3)), "helpers")
    time.sleep(3 * PROBE_INTERVAL)  # scans after the helpers started
    others = [pid for pid in tree(job.process.pid) if pid not in job.pids]
    assert len(others) >= 1 + 1 + 3 + 3  # launcher, scheduler, tails, helpers
    assert {dict(lab)["pid"] for (n, lab), _ in job.node().items()
            if n == "mfotel_node_rank_info"} == listed
    for rank in range(3):
        # named as its own endpoint names itself (rank_info), not as the config says
        until(lambda r=rank: job.value("mfotel_node_rank_endpoint_up", r) == 1,
              f"rank {rank} answering")
        assert job.value("mfotel_node_rank_info", rank, job_name=JOB, local_rank=str(rank),
                         pid=str(job.pids[rank])) == 1
        assert job.state(rank) == "running" and job.exit_info(rank) is None
        assert job.value("mfotel_node_rank_cpu_seconds_total", rank) > 0
        assert job.value("mfotel_node_rank_resident_memory_bytes", rank) > 10 << 20
        assert abs(job.value("mfotel_node_rank_endpoint_last_answer_timestamp_seconds", rank)
                   - time.time()) < 10
    assert "node endpoint http://127.0.0.1:" in job.output()
    # beside the ranks' file_sd file, for Prometheus to find the node endpoint
    assert json.loads(job.target_file.read_text()) == [
        {"targets": [f"127.0.0.1:{job.node_port}"], "labels": {"cluster": "ci"}}]


def test_a_stopped_rank_and_a_rank_holding_the_gil_are_alive_and_not_answering(agent_job):
    job = agent_job(3)
    for rank in range(3):
        until(lambda r=rank: job.value("mfotel_node_rank_endpoint_up", r) == 1,
              f"rank {rank} answering")
    stopped_at = time.time()
    os.kill(job.pids[1], signal.SIGSTOP)
    until(lambda: job.state(1) == "stopped", "rank 1 stopped")
    until(lambda: job.value("mfotel_node_rank_endpoint_up", 1) == 0, "rank 1 silent")
    # when it was first seen stopped (the order of departures of the job-level rules), kept
    # while it stays stopped; absent for the others
    since = job.value("mfotel_node_rank_stopped_timestamp_seconds", 1)
    assert since is not None and stopped_at <= since <= time.time()
    time.sleep(3 * PROBE_INTERVAL)
    assert job.value("mfotel_node_rank_stopped_timestamp_seconds", 1) == since
    assert [job.value("mfotel_node_rank_stopped_timestamp_seconds", r) for r in (0, 2)] == \
        [None, None]
    os.kill(job.pids[1], signal.SIGCONT)
    until(lambda: job.state(1) == "running" and
          job.value("mfotel_node_rank_endpoint_up", 1) == 1, "rank 1 back")
    assert job.value("mfotel_node_rank_stopped_timestamp_seconds", 1) is None

    hold = 8
    write_atomically(job.control / "hold-2", str(hold))
    until(lambda: (job.control / "held-2").exists(), "rank 2 holding the GIL")
    # its own /metrics is silent (the GIL is held), its process runs
    with pytest.raises(TimeoutError):
        urlopen_seconds(f"http://127.0.0.1:{job.rank_port + 2}/metrics", 1.0)
    until(lambda: job.value("mfotel_node_rank_endpoint_up", 2) == 0, "rank 2 silent")
    assert job.state(2) == "running" and job.exit_info(2) is None
    until(lambda: (job.control / "released-2").exists(), "rank 2 released the GIL",
          timeout=hold + 30)
    until(lambda: job.value("mfotel_node_rank_endpoint_up", 2) == 1, "rank 2 answering")
    held = float((job.control / "held-2").read_text())
    assert float((job.control / "released-2").read_text()) - held >= hold - 0.5
    assert all(job.state(rank) == "running" for rank in range(3))


def urlopen_seconds(url: str, timeout: float) -> bytes:
    import urllib.request
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.read()
    except OSError as exc:
        if "timed out" in str(exc):
            raise TimeoutError(url) from exc
        raise


def test_a_killed_rank_is_named_with_its_signal_before_the_launcher_kills_the_rest(agent_job):
    """The ranks' helpers outlive them here (orphaned dataset workers, with the rank's
    environment): they are not taken for the rank restarted."""
    job = agent_job(3, "--orphan-helpers", linger=4.0, job_options=True)
    until(lambda: all(job.value("mfotel_node_rank_endpoint_up", r) == 1 for r in range(3)),
          "ranks answering (and named by their endpoints)")
    until(lambda: (job.control / "helper-1").exists() and
          (job.control / "helper-1").read_text(), "rank 1's helper forked")
    os.kill(job.pids[1], signal.SIGKILL)
    info = until(lambda: job.exit_info(1), "rank 1's exit")
    assert info["cause"] == "signal" and info["signal"] == "9" and \
        info["signal_name"] == "SIGKILL" and info["job_name"] == JOB
    # the launcher SIGKILLs the others a moment later (msrun does): they end after rank 1
    for rank in (0, 2):
        assert until(lambda r=rank: job.exit_info(r), f"rank {rank}'s exit")["signal"] == "9"
    ended = {r: job.value("mfotel_node_rank_exit_timestamp_seconds", r) for r in range(3)}
    assert ended[1] < ended[0] and ended[1] < ended[2]
    assert job.state(1) == "exited"
    helper = int((job.control / "helper-1").read_text())
    assert running(helper)  # orphaned, alive, and not listed as rank 1
    assert job.value("mfotel_node_rank_info", 1, pid=str(job.pids[1])) == 1
    assert job.value("mfotel_node_rank_info", 1, pid=str(helper)) is None
    # the job ended (launcher: 1); scraped, the agent lingers with the final facts, then
    # exits as the command did
    ended_at = until(lambda: not any(running(pid) for pid in job.pids) and time.monotonic(),
                     "every rank gone")
    assert job.exit_info(1)["signal"] == "9"
    assert job.process.wait(timeout=30) == 1
    assert time.monotonic() - ended_at > 2.0
    assert "stays up 4 s for the final scrapes" in job.output()
    assert job.node() == {}


def test_an_exit_code_is_reported_and_a_second_signal_ends_the_linger(agent_job):
    job = agent_job(2, linger=300.0)
    until(lambda: job.state(1) == "running" and job.node(), "rank 1 running")
    write_atomically(job.control / "exit-1", "3")
    info = until(lambda: job.exit_info(1), "rank 1's exit")
    assert (info["cause"], info["exit_code"], info.get("signal", "")) == ("exit_code", "3", "")
    until(lambda: "stays up 300 s" in job.output(), "the linger")
    job.process.send_signal(signal.SIGTERM)
    assert job.process.wait(timeout=30) == 1  # the command's status, at once


def test_a_cancel_passed_on_is_no_failure(agent_job):
    job = agent_job(2, linger=300.0)
    until(lambda: all(job.state(r) == "running" for r in range(2)), "ranks running")
    job.process.send_signal(signal.SIGTERM)
    for rank in range(2):
        info = until(lambda r=rank: job.exit_info(r), f"rank {rank}'s exit")
        assert (info["cause"], info["signal"]) == ("cancelled", "15")
    until(lambda: "stays up 300 s" in job.output(), "the linger")
    job.process.send_signal(signal.SIGTERM)
    assert job.process.wait(timeout=30) == -signal.SIGTERM
    assert not any(running(pid) for pid in job.pids)


def test_killing_the_agent_leaves_the_ranks_training_and_serving(agent_job):
    job = agent_job(2)
    until(lambda: job.value("mfotel_node_rank_endpoint_up", 1) == 1, "rank 1 answering")
    job.process.send_signal(signal.SIGKILL)
    job.process.wait(timeout=30)
    steps = []
    for _ in range(2):
        time.sleep(1.0)
        for rank in range(2):
            body = samples(scrape(f"http://127.0.0.1:{job.rank_port + rank}/metrics"))
            steps.append((rank, sum(v for (n, _), v in body.items()
                                    if n == "mindformers_train_steps_total")))
    assert all(running(pid) for pid in job.pids)
    assert steps[2][1] > steps[0][1] and steps[3][1] > steps[1][1]  # both still stepping
    assert job.node() == {}


# ---------------------------------------------------------------- OOM kills (pure)
@pytest.mark.parametrize("reads, after, ended_at, oom", [
    ([], 0, 50.0, False),                           # no kill counted: a plain SIGKILL
    ([], 1, 50.0, True),                            # counted as it died
    ([1], 1, 40.0, True),                           # a read at 40 between the kill and the exit
    ([1], 1, 40.0 + KILL_TO_EXIT_SECONDS, True),
    ([1], 1, 40.1 + KILL_TO_EXIT_SECONDS, False),   # a kill long before: not its own
    ([1, 1, 1], 1, 45.0, True),                     # kept over reads that see no more
    ([1, 2], 2, 45.0, True),                        # more kills in the window: from the first
    ([None, 1], 1, 45.0, True),                     # an unreadable count changes nothing
], ids=["none", "at-exit", "read-between", "window-end", "past-window", "kept", "more",
        "unreadable"])
def test_an_oom_kill_is_told_when_a_read_falls_between_the_kill_and_the_exit(
        reads, after, ended_at, oom):
    """The kernel counts the kill as it sends SIGKILL; the victim exits once its memory is torn
    down. A read every probe interval (at 40 s, 41 s ...) may fall in between (CI told a real
    OOM kill as "signal" so)."""
    counts = OomCounts(Path("memory.events"), 0)
    for at, read in enumerate(reads):
        counts.reread(Path("memory.events"), read, 40.0 + at)
    assert OomLedger().tell(counts, after, ended_at) is oom


def test_one_oom_kill_explains_one_exit_of_the_ranks_sharing_its_cgroup():
    """A node's ranks in one container: the victim's kill is counted in the cgroup of all, and
    the launcher then SIGKILLs the others. The first exit told is the victim's."""
    shared, ledger = Path("pod/memory.events"), OomLedger()
    ranks = [OomCounts(shared, 3) for _ in range(3)]
    ranks[2].reread(shared, 4, 10.0)  # a read of one rank between the kill and the exits
    assert [ledger.tell(rank, 4, 11.0) for rank in ranks] == [True, False, False]
    assert ledger.tell(OomCounts(shared, 4), 5, 60.0)      # the next kill, the next victim
    assert OomLedger().tell(OomCounts(Path("other"), 3), 4, 11.0)  # another cgroup's kill


def test_a_rank_moved_to_another_cgroup_starts_its_count_over():
    counts = OomCounts(Path("a/memory.events"), 0)
    counts.reread(Path("a/memory.events"), 1, 10.0)
    counts.reread(Path("b/memory.events"), 7, 11.0)  # b's kills are none of this rank's
    assert not OomLedger().tell(counts, 7, 12.0)
    assert OomLedger().tell(counts, 8, 12.0)


def test_a_cgroup_made_again_at_the_same_path_counts_from_zero():
    ledger, path = OomLedger(), Path("job/memory.events")
    assert ledger.tell(OomCounts(path, 4), 5, 1.0)
    assert ledger.tell(OomCounts(path, 0), 1, 2.0)   # a new job's cgroup: its first kill


@pytest.fixture
def memory_cgroup() -> Iterator[tuple[Path, str]]:
    """A memory cgroup of the test's own, below this process's (v1 or v2), removed after;
    (its folder, the name of its limit file)."""
    file = procfs.memory_cgroup_file(os.getpid())
    assert file, "no memory cgroup found for this process in /proc/self/cgroup"
    parent = file.parent
    limit = "memory.limit_in_bytes" if file.name == "memory.oom_control" else "memory.max"
    folder = parent / f"mfotel-oom-test-{os.getpid()}"
    try:
        folder.mkdir()
    except OSError as exc:
        pytest.skip(f"the OOM test needs a memory cgroup it may create ({parent}: "
                    f"{exc.strerror}); it runs as root on cgroup v1 or delegated v2")
    try:
        yield folder, limit
    finally:
        deadline = time.monotonic() + 10
        while folder.exists() and time.monotonic() < deadline:
            for pid in (folder / "cgroup.procs").read_text().split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                folder.rmdir()
            except OSError:
                time.sleep(0.1)


@pytest.mark.parametrize("shared", [False, True], ids=["its-own-cgroup", "one-cgroup-for-both"])
def test_a_rank_killed_by_the_oom_killer_is_told_from_kill_9(agent_job, memory_cgroup, shared):
    """A real OOM kill: rank 1 starts in a memory cgroup, which then gets a limit that rank 1
    exceeds; the kernel SIGKILLs it and counts an oom_kill there. Rank 0, killed by msrun-like
    SIGKILL after it, is "signal", also when it shares that cgroup (one container for both:
    the kill is counted for both ranks' cgroup)."""
    folder, limit = memory_cgroup
    # started there, not moved there: the agent reads a rank's cgroup when it meets it and
    # again once a probe interval, and a move raced that read on a loaded machine (CI told the
    # OOM kill as a plain SIGKILL)
    # the default probe interval: the launcher's kill of rank 0 then mostly comes before the
    # agent's next read of its count (shared, the read that once told it "oom")
    both = ["--cgroup", f"0={folder}"] if shared else []
    job = agent_job(2, "--cgroup", f"1={folder}", *both, job_options=True,
                    probe_interval=DEFAULT_PROBE_INTERVAL)
    members = (folder / "cgroup.procs").read_text().split()
    assert str(job.pids[1]) in members and (str(job.pids[0]) in members) == shared
    until(lambda: all(job.value("mfotel_node_rank_endpoint_up", r) == 1 for r in range(2)),
          "ranks answering")
    usage = "memory.usage_in_bytes" if limit == "memory.limit_in_bytes" else "memory.current"
    (folder / limit).write_text(str(int((folder / usage).read_text()) + (64 << 20)))
    write_atomically(job.control / "alloc-1", "256")
    info = until(lambda: job.exit_info(1), "rank 1's exit")
    assert (info["cause"], info["signal"], info["signal_name"]) == ("oom", "9", "SIGKILL")
    assert procfs.oom_kill_count(folder / files_name(limit)) == 1
    rank0 = until(lambda: job.exit_info(0), "rank 0's exit")
    assert (rank0["cause"], rank0["signal"]) == ("signal", "9")


def files_name(limit: str) -> str:
    return "memory.oom_control" if limit == "memory.limit_in_bytes" else "memory.events"


def test_a_job_nobody_scraped_ends_without_lingering(agent_job):
    job = agent_job(2, linger=300.0)
    wait_for(job.target_file.exists, settle(30), 0.25, "the node's target file")
    (job.control / "done").write_text("")
    assert job.process.wait(timeout=60) == 0
    assert "stays up" not in job.output()
    assert not job.target_file.exists()  # removed with the endpoint


def test_a_failing_agent_is_dropped_and_the_job_runs_on(tmp_path):
    """Whatever the observer of the supervisor raises, the command runs to its end and
    mfotel-instrument exits as it did."""
    script = tmp_path / "failing.py"
    script.write_text(textwrap.dedent("""
        import os, sys
        from mfotel.node import supervise

        class Failing:
            def started(self, pid): raise RuntimeError("no pidfd today")
            def reaped(self, pid, status): raise AssertionError("dropped after started")
            def cancelling(self): pass
            def ended(self): raise AssertionError("dropped after started")
            def close(self): pass

        supervise.run([sys.executable, "-c", "import time; time.sleep(0.5); exit(7)"],
                      dict(os.environ), observer=Failing())
        """))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=60, env=child_env())
    assert result.returncode == 7, result.stderr
    assert result.stderr.count("the node agent failed (RuntimeError: no pidfd today)") == 1


# ---------------------------------------------------------------- the rendezvous: a rank tells
RANK_SCRIPT = ROOT / "tests" / "support" / "scripts" / "node_agent_rank.py"
TOLD = "told-job"  # the job name the ranks tell the agent


def port_outside(window: int) -> int:
    """A free port outside the ranks' port window `window ..` (a rank configured in code)."""
    while True:
        port = free_port_block(1)
        if not window - 1 <= port < window + PORT_WINDOW:
            return port


class Wrapped(AgentJob):
    """`mfotel-instrument --config train.yaml bash -c LINE`: a wrapper script of
    node_agent_rank.py processes (`{rank}` in LINE is its command line)."""

    def __init__(self, tmp: Path, line: str, env: dict[str, str] | None = None,
                 linger: float = 30.0, config_job_name: str = "from-config") -> None:
        base = free_port_block(2)
        self.node_port, self.rank_port = base, base + 1  # node_port: the YAML's port - 1
        self.control = tmp / "control"
        self.control.mkdir()
        config = tmp / "train.yaml"
        config.write_text(f"monitor_config:\n  job_name: {config_job_name}\n  prometheus:\n"
                          f"    host: 127.0.0.1\n    port: {self.rank_port}\n")
        rank = " ".join(shlex.quote(str(a)) for a in (sys.executable, RANK_SCRIPT, "--control",
                                                        self.control))
        self.log = tmp / "agent.log"
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(
                [*INSTRUMENT, "--config", str(config), "--node-probe-interval",
                 str(PROBE_INTERVAL), "--node-linger", str(linger), "bash", "-c",
                 line.format(rank=rank, rank_port=self.rank_port)],
                env=child_env(**{**(env or {}), TAG: str(self.control)}), stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True)

    def pid(self, name: str) -> int:
        return int(wait_for(lambda: self._pid(name), settle(60), 0.1, f"{name} started",
                            alive=(self.process,), details=self.output))

    def ranks(self) -> set[tuple[str, str, str]]:
        """(job_name, rank, pid) of every rank the node endpoint lists."""
        return {(lab["job_name"], lab["rank"], lab["pid"]) for lab in
                (dict(k[1]) for k in self.node() if k[0] == "mfotel_node_rank_info")}


@pytest.fixture
def wrapped_job(tmp_path) -> Iterator[Any]:
    jobs: list[Wrapped] = []

    def start(line: str, **kwargs: Any) -> Wrapped:
        jobs.append(Wrapped(tmp_path, line, **kwargs))
        return jobs[-1]
    yield start
    for job in jobs:
        (job.control / "done").write_text("")
        stop_launcher(job.process)  # the agent's linger is not waited out
        kill_tagged(str(job.control))  # what is left, by its tag, never by an old pid


@pytest.mark.parametrize("env", [{"RANK_ID": "0", "RANK_SIZE": "1"}, {}],
                         ids=["rank-variables", "none"])
def test_a_rank_configured_in_code_is_named_and_probed_as_it_tells(wrapped_job, env):
    """Its port is outside the YAML's window, its job name not the YAML's: with rank variables
    it was reported under the YAML's job name and never probed; without, never found. Its
    announcement names it and its endpoint. The rendezvous directory is the job's alone
    (0700) and goes with the launcher."""
    port = port_outside(free_port_block(1))
    job = wrapped_job(f"exec {{rank}} --name rank --port {port} --job-name {TOLD} --rank 0 "
                      "--announce", env=env, linger=0.0)
    pid = job.pid("rank")
    until(lambda: job.value("mfotel_node_rank_endpoint_up", 0, job_name=TOLD) == 1,
          "the rank probed at the endpoint it told")
    assert job.ranks() == {(TOLD, "0", str(pid))}
    directory = Path((job.control / "announced-rank").read_text())
    assert procfs.read_environ(pid)["MFOTEL_NODE_DIR"] == str(directory)
    assert directory.stat().st_mode & 0o777 == 0o700 and directory.stat().st_uid == os.getuid()
    assert (directory / f"rank-{pid}.json").is_file()
    (job.control / "done").write_text("")
    assert job.process.wait(timeout=30) == 0
    assert not directory.exists()


def test_a_rank_reached_through_exec_is_followed(wrapped_job):
    """The shell, seen first, is no rank; the rank it becomes through `exec` (the same pid and
    start time) is one. No announcement: the agent's guess must see the exec."""
    job = wrapped_job("sleep 1.5; exec env RANK_ID=0 RANK_SIZE=1 {rank} --name rank "
                      f"--port {{rank_port}} --job-name {TOLD}")
    pid = job.pid("rank")
    until(lambda: job.value("mfotel_node_rank_endpoint_up", 0, job_name=TOLD) == 1,
          "the rank followed (named by its endpoint)")
    assert job.ranks() == {(TOLD, "0", str(pid))}


def test_a_sidecar_with_the_ranks_environment_is_no_rank(wrapped_job):
    """A wrapper exports RANK_ID and starts a Python sidecar before the rank: guessed, the
    sidecar is rank 0 and the rank its helper. The rank's announcement puts it right; killed,
    the rank is reported ended by SIGKILL, and the sidecar, running on, is no rank."""
    job = wrapped_job("export RANK_ID=0 RANK_SIZE=1; {rank} --name sidecar & sleep 1.5; "
                      f"{{rank}} --name rank --port {{rank_port}} --job-name {TOLD} "
                      "--announce --announce-when-told; wait", config_job_name=TOLD)
    sidecar, pid = job.pid("sidecar"), job.pid("rank")
    until(lambda: job.ranks() == {(TOLD, "0", str(sidecar))}, "the guess: the sidecar")
    time.sleep(3 * PROBE_INTERVAL)  # scans and probes after the rank started
    assert job.ranks() == {(TOLD, "0", str(sidecar))}
    write_atomically(job.control / "announce-rank", "")
    until(lambda: job.ranks() == {(TOLD, "0", str(pid))}, "the rank, as it told")
    until(lambda: job.value("mfotel_node_rank_endpoint_up", 0) == 1, "the rank probed")
    os.kill(pid, signal.SIGKILL)
    info = until(lambda: job.exit_info(0), "the rank's exit")
    assert (info["job_name"], info["cause"], info["signal"]) == (TOLD, "signal", "9")
    time.sleep(3 * PROBE_INTERVAL)
    assert running(sidecar) and job.ranks() == {(TOLD, "0", str(pid))}
    assert job.state(0) == "exited" and job.exit_info(0)["signal"] == "9"


def test_a_later_step_of_the_wrapper_leaves_the_crash_reported(wrapped_job):
    """After the rank a wrapper runs another Python step with its environment (a log upload,
    a moment later: started while the rank lived, it would pass for the rank's helper): the
    rank's SIGKILL stays reported, not replaced by the step's "running" and "completed"."""
    job = wrapped_job("export RANK_ID=0 RANK_SIZE=1; "
                      f"{{rank}} --name rank --port {{rank_port}} --job-name {TOLD} --announce; "
                      "sleep 2; {rank} --name upload --exit-after 3; echo uploaded",
                      config_job_name=TOLD, linger=10.0)  # (the last command is exec'd)
    pid = job.pid("rank")
    until(lambda: job.ranks() == {(TOLD, "0", str(pid))} and
          job.value("mfotel_node_rank_endpoint_up", 0) == 1, "the rank, as it told")
    os.kill(pid, signal.SIGKILL)
    seen = []

    def look() -> None:
        seen.append((job.ranks(), job.state(0), (job.exit_info(0) or {}).get("signal")))
        time.sleep(PROBE_INTERVAL)
    while not (job.control / "pid-upload").exists() or running(job.pid("upload")):
        look()
    for _ in range(5):  # scans after the step ended
        look()
    # the node endpoint collects at most once a second: "running" a moment after the kill;
    # from its exit on, the rank's end only, while the step ran and after
    ended = next(i for i, (_, _, signum) in enumerate(seen) if signum == "9")
    assert len(seen) - ended >= 5 + (2 + 3) / PROBE_INTERVAL - 2, seen
    assert seen[ended:] == [({(TOLD, "0", str(pid))}, "exited", "9")] * (len(seen) - ended), seen
    assert all(ranks == {(TOLD, "0", str(pid))} for ranks, _, _ in seen), seen
    until(lambda: "stays up 10 s" in job.output(), "the job's end")
    job.process.send_signal(signal.SIGTERM)  # ends the linger
    assert job.process.wait(timeout=30) == 0  # the wrapper's status: its last command's


def test_the_node_endpoint_opens_for_a_rank_there_at_the_first_scan(tmp_path, monkeypatch):
    """The agent's first scan runs while NodeAgent.start() returns, and it finds a rank that
    exists already (`RANK_ID=0 mfotel-instrument python train.py`): the endpoint opens then,
    not never. Made certain here: this agent scans before its threads start."""
    from mfotel.node import service as node_service
    from mfotel.node.agent import NodeAgent

    class ScansFirst(NodeAgent):
        def start(self) -> NodeAgent:
            self.scan()
            return super().start()
    base = free_port_block(2)
    config = tmp_path / "train.yaml"
    config.write_text(f"monitor_config:\n  prometheus:\n    host: 127.0.0.1\n"
                      f"    port: {base + 1}\n")
    rank = subprocess.Popen([sys.executable, str(RANK_SCRIPT), "--name", "rank", "--control",
                             str(tmp_path), "--port", str(base + 1)],
                            env=child_env(RANK_ID="0", RANK_SIZE="1"))
    monkeypatch.setattr(node_service, "NodeAgent", ScansFirst)
    service = node_service.NodeService(training_config([], str(config)), linger=0.0)
    try:
        wait_for(lambda: (tmp_path / "pid-rank").exists(), settle(30), 0.1, "the rank started")
        service.started(os.getpid())
        assert service.endpoint is not None and service.endpoint.port == base
        assert {dict(k[1])["pid"] for k in samples(scrape(service.endpoint.url))
                if k[0] == "mfotel_node_rank_info"} == {str(rank.pid)}
    finally:
        service.close()
        rank.kill()
        rank.wait()


def test_announcements_are_checked_and_a_told_end_stays(tmp_path):
    """The agent's side of the rendezvous, scan by scan: an announcement of a live process
    below the agent's root names it; one of another process, of a pid gone, or written before
    its process started (the pid reused) is ignored; so is a file that is no announcement.
    Once a rank that told ended, a process guessed as that rank is none; only a new
    announcement of the rank replaces it."""
    from mfotel.node.agent import AgentSettings, NodeAgent
    from mfotel.node_link import Announcement, announce, announcement_path
    directory = tmp_path / "node"
    directory.mkdir(mode=0o700)
    children: list[subprocess.Popen] = []

    def child(name: str, **env: str) -> subprocess.Popen:
        children.append(subprocess.Popen(
            [sys.executable, str(RANK_SCRIPT), "--name", name, "--control", str(tmp_path)],
            env=child_env(**env)))
        wait_for(lambda: (tmp_path / f"pid-{name}").exists(), settle(30), 0.1, name)
        return children[-1]
    agent = NodeAgent(os.getpid(), AgentSettings(job_name="guess", node_dir=directory))

    def ranks() -> set[tuple[str, int, int, int, str]]:
        agent.scan()
        return {(v.job_name, v.rank, v.local_rank, v.pid, v.state) for v in agent.views()}
    try:
        first = child("first")
        announce(directory, Announcement(first.pid, "told", 5, local_rank=1))
        assert ranks() == {("told", 5, 1, first.pid, "running")}
        reused = child("reused")
        path = announce(directory, Announcement(reused.pid, "told", 6))
        os.utime(path, (time.time() - 3600, time.time() - 3600))  # before `reused` started
        announce(directory, Announcement(os.getppid(), "told", 7))  # not below the root
        gone = subprocess.Popen(["true"])
        gone.wait()
        announce(directory, Announcement(gone.pid, "told", 8))
        announcement_path(directory, 1).write_text("{")
        assert ranks() == {("told", 5, 1, first.pid, "running")}
        first.kill()  # a zombie until reaped: the agent reads its status there
        # (a view reads /proc afresh: it can show the zombie before the next scan records
        # the exit, as it did under load)
        until(lambda: ("told", 5, 1, first.pid, "zombie") in ranks()
              and agent.views()[0].exit is not None, "the told rank's end", timeout=10)
        exit_seen = agent.views()[0].exit
        assert exit_seen is not None and exit_seen.signal == signal.SIGKILL
        first.wait()
        again = child("again", RANK_ID="5", RANK_SIZE="8")  # guessed as rank 5: no rank
        time.sleep(1.5)
        assert ranks() == {("told", 5, 1, first.pid, "exited")}  # reaped meanwhile
        announce(directory, Announcement(again.pid, "told", 5))  # a new run of rank 5
        assert ranks() == {("told", 5, 0, again.pid, "running")}
    finally:
        agent.close()
        for process in children:
            process.kill()
            process.wait()


def test_a_launcher_removes_the_node_directories_its_killed_predecessors_left(tmp_path,
                                                                              monkeypatch):
    """A launcher killed before its close() (SIGKILL) leaves its node directory: the next one
    removes those of this user whose launcher pid is gone, and keeps the others."""
    from mfotel.node import service as node_service
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.Popen(["true"])
    gone.wait()
    here = f"{node_service.NODE_DIR_PREFIX}{socket.gethostname()}-"
    stale, live = tmp_path / f"{here}{gone.pid}-abc123", tmp_path / f"{here}{os.getpid()}-d4"
    odd = tmp_path / f"{here}x1"
    # another host's (a container sharing /tmp): its pids are not this host's
    other = tmp_path / f"{node_service.NODE_DIR_PREFIX}elsewhere-{gone.pid}-e5"
    for folder in (stale, live, odd, other):
        folder.mkdir()
        (folder / "rank-0.json").write_text("{}")
    # a link named as a stale directory (anyone may make one in /tmp): what it points to stays
    target = tmp_path / "kept"
    target.mkdir()
    (target / "data").write_text("mine")
    link = tmp_path / f"{here}{gone.pid}-link"
    link.symlink_to(target)
    config = tmp_path / "train.yaml"
    config.write_text("monitor_config:\n  job_name: j\n")
    service = node_service.NodeService(training_config([], str(config)), linger=0.0)
    env = service.rendezvous({})
    try:
        made = Path(env[node_service.ENV_DIR])
        assert made.parent == tmp_path and made.name.startswith(f"{here}{os.getpid()}-")
        assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir() and not p.is_symlink()
                      ) == sorted([live.name, odd.name, other.name, made.name, target.name])
    finally:
        service.close()
    assert not made.exists() and live.exists()
    assert link.is_symlink() and (target / "data").read_text() == "mine"
