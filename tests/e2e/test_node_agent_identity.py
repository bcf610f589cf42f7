"""Which process is which rank, on real MindSpore ranks under the real `mfotel-instrument`: the
rank tells its node agent (mfotel.node_link) who it is and where it serves, whatever its
configuration and whatever the wrapper around it.

- a rank configured in code (its own job name, a port outside the YAML's window): named and
  probed as it told; the node endpoint opens for a rank there from the first scan (the
  launch `RANK_ID=0 RANK_SIZE=1 mfotel-instrument --config train.yaml python train.py`), also
  tried a few times with a small rank (a second each); the node directory is the job's
  (0700) and goes with the launcher;
- a rank reached through `exec` from a shell;
- a wrapper script: a Python sidecar with the rank's RANK_ID before the rank, a Python step
  after it. The rank killed by SIGKILL is reported so, and stays so through the next step.

The rank: examples/multirank/train_dp.py without msrun (an independent replica, RANK_ID=0),
OTelMonitor configured in code (`--port`, `--job-name`).
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from mfotel.node.agent import PORT_WINDOW
from tests.support.metrics import samples, scrape
from tests.support.multirank import (
    EXAMPLE,
    ROOT,
    child_env,
    free_port_block,
    start,
    stop_launcher,
)
from tests.support.waiting import settle, startup, wait_for

pytestmark = pytest.mark.slow

INSTRUMENT = [sys.executable, "-m", "mfotel.node.instrument"]
RANK_SCRIPT = ROOT / "tests" / "support" / "scripts" / "node_agent_rank.py"
JOB = "code-job"          # what the rank is told in code (and tells the agent)
YAML_JOB = "yaml-job"     # what the training YAML says
PROBE_INTERVAL = 1.0
RANK_ENV = {"RANK_ID": "0", "RANK_SIZE": "1"}


def port_outside(window: int) -> int:
    """A free port outside the YAML's rank window `window ..` (a rank configured in code)."""
    while True:
        port = free_port_block(1)
        if not window - 1 <= port < window + PORT_WINDOW:
            return port


class Launched:
    """`mfotel-instrument --config train.yaml COMMAND`: the YAML names YAML_JOB and a rank port
    (`yaml_port`) whose port - 1 is the node endpoint's; `rank_port` is a free port outside
    the YAML's window, for a rank configured in code."""

    def __init__(self, work: Path, command: Callable[[Launched], list[str]],
                 env: dict[str, str], linger: float = 30.0) -> None:
        self.work, self.control, self.truth = work, work / "control", work / "truth"
        self.control.mkdir(parents=True)
        base = free_port_block(2)
        self.node_port, self.yaml_port = base, base + 1
        self.rank_port = port_outside(self.yaml_port)
        config = work / "train.yaml"
        config.write_text(f"monitor_config:\n  job_name: {YAML_JOB}\n  prometheus:\n"
                          f"    host: 127.0.0.1\n    port: {self.yaml_port}\n")
        self.log = work / "launcher.log"
        self.started = time.monotonic()
        self.process = start(
            [*INSTRUMENT, "--config", str(config), "--node-probe-interval", str(PROBE_INTERVAL),
             "--node-linger", str(linger), *command(self)], child_env(**env), self.log, work)

    def train(self, port: int) -> list[str]:
        """The rank's command line: it trains until stopped, OTelMonitor configured in code."""
        return [sys.executable, str(EXAMPLE), "--port", str(port), "--job-name", JOB,
                "--steps", "100000", "--step-sleep", "0.2", "--truth-dir", str(self.truth)]

    def rank_pid(self) -> int:
        """The rank's pid, as it wrote it at train begin."""
        def pid() -> int | None:
            try:
                return int(json.loads((self.truth / "rank_0.json").read_text())["pid"])
            except (OSError, ValueError, KeyError):
                return None
        return int(wait_for(pid, startup(), 0.25, "the rank at train begin",
                            alive=(self.process,), details=self.notes))

    def node(self) -> dict:
        try:
            return samples(scrape(f"http://127.0.0.1:{self.node_port}/metrics"))
        except OSError:
            return {}

    def ranks(self, node: dict | None = None) -> set[tuple[str, str, str]]:
        """(job_name, rank, pid) of every rank the node endpoint lists."""
        return {(lab["job_name"], lab["rank"], lab["pid"]) for lab in
                (dict(k[1]) for k in (self.node() if node is None else node)
                 if k[0] == "mfotel_node_rank_info")}

    def value(self, name: str, node: dict | None = None, **labels: str) -> float | None:
        found = [v for (n, lab), v in (self.node() if node is None else node).items()
                 if n == name and set(labels.items()) <= lab]
        return found[0] if found else None

    def told(self, pid: int) -> bool:
        """The node endpoint lists the rank, and only it, as it told, probed and answering."""
        node = self.node()
        return self.ranks(node) == {(JOB, "0", str(pid))} and \
            self.value("mfotel_node_rank_endpoint_up", node, job_name=JOB, rank="0") == 1

    def wait_told(self, pid: int) -> None:
        wait_for(lambda: self.told(pid), settle(10), 0.25, "the rank named and probed as it "
                 "told, and no other", alive=(self.process,),
                 details=lambda: f"{self.ranks()}\n{self.notes()}")
        print(f"\n{self.work.name}: the rank as it told {time.monotonic() - self.started:.1f} s "
              "after the launch")

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def notes(self) -> str:
        """The launcher's output without the rank's [Monitor] lines (for failures)."""
        return "\n".join(line for line in self.output().splitlines()
                         if not line.startswith("[Monitor]"))[-3000:]


@pytest.fixture
def launched(tmp_path) -> Iterator[Any]:
    jobs: list[Launched] = []

    def launch(name: str, command: Callable[[Launched], list[str]],
               env: dict[str, str] | None = None, **kwargs: Any) -> Launched:
        jobs.append(Launched(tmp_path / name, command, env or {}, **kwargs))
        return jobs[-1]
    yield launch
    for job in jobs:  # and whatever carries its tag (an orphaned sidecar)
        stop_launcher(job.process)


def shell(*parts: str | list[str]) -> list[str]:
    """`bash -c` of a wrapper script: strings as they are, lists quoted as one command."""
    return ["bash", "-c", " ".join(p if isinstance(p, str) else shlex.join(p) for p in parts)]


def test_a_rank_configured_in_code_is_named_and_probed_as_it_tells(launched):
    """`RANK_ID=0 RANK_SIZE=1 mfotel-instrument --config train.yaml python train.py`, the rank
    serving on a port of its own and naming its job in code: before, it was listed under the
    YAML's job name and never probed (alerts muted where the agent reports the rank were not
    muted for it), and the node endpoint opened in 1 launch of 4 (the rank is there at the
    first scan). The node directory is the job's user's alone and goes with the launcher."""
    job = launched("code", lambda j: j.train(j.rank_port), RANK_ENV)
    pid = job.rank_pid()
    job.wait_told(pid)
    assert f"node endpoint http://127.0.0.1:{job.node_port}/metrics" in job.output()
    assert not [k for k in job.node() if ("job_name", YAML_JOB) in k[1]]
    own = samples(scrape(f"http://127.0.0.1:{job.rank_port}/metrics"))  # as the rank says
    assert [dict(k[1])["job_name"] for k in own if k[0] == "mindformers_train_rank_info"] == \
        [JOB]
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    directory = Path(next(e for e in environ if e.startswith(b"MFOTEL_NODE_DIR="))
                     .split(b"=", 1)[1].decode())
    assert directory.stat().st_mode & 0o777 == 0o700 and directory.stat().st_uid == os.getuid()
    assert (directory / f"rank-{pid}.json").is_file()
    job.process.send_signal(signal.SIGTERM)  # the job cancelled; the node endpoint lingers
    wait_for(lambda: job.value("mfotel_node_rank_exit_info", job_name=JOB, cause="cancelled"),
             settle(10), 0.25, "the rank's cancel reported", details=job.notes)
    job.process.send_signal(signal.SIGTERM)  # a second signal ends the linger
    assert job.process.wait(timeout=60) == -signal.SIGTERM
    assert not directory.exists()


def test_the_node_endpoint_opens_for_a_rank_there_from_the_start(launched):
    """The first scan finds the rank (its process exists as the agent starts): the node
    endpoint opens every time. Small ranks (no MindSpore), so that trying costs little."""
    for attempt in range(5):
        job = launched(f"attempt-{attempt}", lambda j: [
            sys.executable, str(RANK_SCRIPT), "--name", "rank", "--control", str(j.control)],
            RANK_ENV, linger=0.0)
        wait_for(lambda j=job: j.ranks(), settle(10), 0.1, "the node endpoint serving the rank",
                 alive=(job.process,), details=job.notes)
        (job.control / "done").write_text("")
        assert job.process.wait(timeout=30) == 0


def test_a_rank_reached_through_exec_is_followed(launched):
    """A shell that becomes the rank through `exec` (the same pid and start time)."""
    job = launched("exec", lambda j: shell("sleep 2; exec env RANK_ID=0 RANK_SIZE=1",
                                           j.train(j.yaml_port)))
    job.wait_told(job.rank_pid())


def test_a_wrappers_sidecar_and_later_step_leave_the_ranks_crash_reported(launched):
    """A wrapper exports RANK_ID and starts a Python sidecar, then the rank, then (a moment
    after the rank) another Python step. The sidecar is no rank; the rank killed by SIGKILL
    is reported so, with signal 9, and stays so while the next step runs and after."""
    def wrapper(job: Launched) -> list[str]:
        sleep = [sys.executable, "-c", "import time; time.sleep(3600)"]
        step = [sys.executable, "-c", "import time; time.sleep(4)"]
        return shell("export RANK_ID=0 RANK_SIZE=1;", sleep, "&", job.train(job.yaml_port),
                     "; sleep 2;", step, ";", ["touch", str(job.work / "step-ended")])
    job = launched("wrapper", wrapper)
    pid = job.rank_pid()
    job.wait_told(pid)
    os.kill(pid, signal.SIGKILL)
    seen = []

    def look() -> None:
        node = job.node()
        seen.append((job.ranks(node), sorted(
            (lab["job_name"], lab["cause"], lab["signal"]) for lab in
            (dict(k[1]) for k in node if k[0] == "mfotel_node_rank_exit_info"))))
        time.sleep(0.5)
    wait_for(lambda: look() or (job.work / "step-ended").exists(), settle(20), 0,
             "the next step ended", details=lambda: f"{seen}\n{job.notes()}")
    for _ in range(4):  # scans after it
        look()
    # the node endpoint collects at most once a second: no exit yet a moment after the kill
    first = next(i for i, (_, ended) in enumerate(seen) if ended)
    assert len(seen) - first >= 4 + (2 + 4) / 0.5 - 4, seen
    assert all(ranks == {(JOB, "0", str(pid))} for ranks, _ in seen), seen
    assert all(ended == [(JOB, "signal", "9")] for _, ended in seen[first:]), seen
