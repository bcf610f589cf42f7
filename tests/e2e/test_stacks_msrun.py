"""The hung rank's stacks on a real 2-rank msrun job under `mfotel-instrument` (issue 32).

- Rank 1 blocks in its dataset's `__getitem__` (tests/support/scripts/faulty_dp.py, fault
  `hang`; MS_NODE_TIMEOUT=120: rank 0 waits in its all-reduce): the node endpoint's
  `/stacks?job_name=..&rank=1` shows that frame within the trigger's threshold (no step for
  10 s) and a few seconds; rank 0, waiting inside its step, is captured as such; the series
  says when, with the scheme an alert's link needs. Rank 1's live page, in Debian's chromium,
  links the capture, and the link opens it.
- A healthy job whose rank is captured every 0.5 s for 20 s (its real faulthandler dump on
  SIGURG, read as the agent reads it) trains on at the step rate it had before; the agent
  itself captures nothing while the ranks step.
"""
from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mfotel.node import procfs, stacks
from mfotel.node_link import Announcement, Progress, announcement_path, read_progress
from tests.support.browser import BROWSER_TIMEOUT_MS, chromium
from tests.support.http import get
from tests.support.metrics import samples, scrape
from tests.support.multirank import ROOT, VENV_BIN, child_env, free_port_block, stop
from tests.support.processes import TAG, kill_tagged, running, session, tree
from tests.support.waiting import msrun_startup, settle, wait_for

pytestmark = pytest.mark.slow

INSTRUMENT = [sys.executable, "-m", "mfotel.node.instrument"]
TRAIN = ROOT / "tests" / "support" / "scripts" / "faulty_dp.py"
JOB = "stacks-msrun"
STEP_SLEEP = 0.05
#: The global step from which rank 1's loader blocks (its first batch of that step), once the
#: test created the trigger file (a browser started on a loaded machine took over 20 s: a
#: fixed step came before the test had seen the healthy job).
HANG_AT, HANG_SECONDS = 400, 120
#: MindSpore's CPU all-reduce waits this long for the hung peer (the default gives up at 30 s).
COLLECTIVE_TIMEOUT = 180
#: The healthy job: each window's length, and how often a capture is taken in the middle one.
WINDOW_SECONDS, CAPTURE_EVERY = 20.0, 0.5
#: On 2 shared cores, steps/s between two windows of the same healthy run vary this much.
RATE_TOLERANCE = 0.75


class StacksJob:
    """`mfotel-instrument --config job.yaml msrun ... faulty_dp.py` of 2 CPU ranks."""

    def __init__(self, work: Path, *fault: str, collective_timeout: int | None = None) -> None:
        self.work = work
        self.node_port = free_port_block(3)
        self.rank_port = self.node_port + 1   # node_port: the ranks' port - 1, the default
        config = work / "job.yaml"
        config.write_text(f"monitor_config:\n  job_name: {JOB}\n  prometheus:\n"
                          f"    host: 127.0.0.1\n    port: {self.rank_port}\n")
        # the rendezvous' directory, until the launcher makes its own (it then names that one
        # to the ranks, and the test reads it from their environment)
        node_dir = work / "node"
        node_dir.mkdir(mode=0o700)
        msrun = [str(VENV_BIN / "msrun"), "--worker_num=2", "--local_worker_num=2",
                 "--master_addr=127.0.0.1", f"--master_port={free_port_block(1)}",
                 "--join=True", f"--log_dir={work / 'logs'}", str(TRAIN),
                 "--port", str(self.rank_port), "--job-name", JOB, "--steps", "100000",
                 "--step-sleep", str(STEP_SLEEP), "--linger-seconds", "5", *fault]
        extra = {"MFOTEL_NODE_DIR": str(node_dir), TAG: str(work)}
        if collective_timeout:
            extra["MS_NODE_TIMEOUT"] = str(collective_timeout)
        self.log = work / "launcher.log"
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(
                [*INSTRUMENT, "--config", str(config), "--node-probe-interval", "1",
                 "--node-linger", "0", *msrun], cwd=work,
                env=child_env(PWD=str(work), TMPDIR=str(work), **extra), stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True)

    def workers(self) -> dict[int, int]:
        """rank -> pid (msrun starts each rank in a session of its own)."""
        pids = tree(self.process.pid)
        found = {}
        for pid in pids:
            if session(pid) != pid:
                continue
            env = procfs.read_environ(pid) or {}
            if env.get("MS_ROLE") == "MS_WORKER" and env.get("RANK_ID", "").isdigit():
                found[int(env["RANK_ID"])] = pid
        return found

    def announcement(self, pid: int) -> Announcement | None:
        """The rank's own announcement, in the node directory its environment names."""
        directory = (procfs.read_environ(pid) or {}).get("MFOTEL_NODE_DIR")
        try:
            return Announcement.from_json(announcement_path(Path(directory), pid).read_bytes())
        except (OSError, TypeError, ValueError):
            return None

    def joined(self, rank: int) -> tuple[int, Announcement]:
        """(pid, announcement) of `rank` once it trains under the agent's eye."""
        def found() -> tuple[int, Announcement] | None:
            pid = self.workers().get(rank)
            told = self.announcement(pid) if pid else None
            return (pid, told) if told and told.stack_signal and self.step(told) > 0 else None
        return wait_for(found, msrun_startup(), 0.5, f"rank {rank} training, joined",
                        alive=(self.process,), details=lambda: self.output()[-3000:])

    @staticmethod
    def progress(told: Announcement) -> Progress:
        beat = read_progress(told.progress_file)
        assert beat is not None
        return beat

    def step(self, told: Announcement) -> int:
        return self.progress(told).step

    @property
    def node(self) -> str:
        return f"http://127.0.0.1:{self.node_port}"

    def stacks_url(self, rank: int) -> str:
        return f"{self.node}/stacks?job_name={JOB}&rank={rank}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture
def stacks_job(tmp_path) -> Iterator[Any]:
    jobs: list[StacksJob] = []

    def start(*fault: str, **kwargs: Any) -> StacksJob:
        jobs.append(StacksJob(tmp_path, *fault, **kwargs))
        return jobs[-1]
    yield start
    for job in jobs:
        stop(job.process, timeout=2)
        kill_tagged(str(job.work))  # what is left, by its tag, never by an old pid


def captured(job: StacksJob, rank: int) -> str | None:
    """The capture of `rank` once the index lists it (a 404 counts as a failure of the client
    against the server's allowance, as every 4xx: polled, the index answers 200)."""
    index = get(job.node + "/stacks?format=json").json()["captures"]
    if not any(c["rank"] == rank for c in index):
        return None
    reply = get(job.stacks_url(rank))
    assert reply.status == 200, reply
    return reply.text


def header(text: str) -> dict[str, str]:
    """The capture's header lines (before the first blank line) as a dict."""
    head = text.split("\n\n", 1)[0]
    return dict(line.split(": ", 1) for line in head.splitlines() if ": " in line)


def test_the_hung_ranks_stacks_show_its_getitem_and_its_page_links_them(stacks_job, tmp_path):
    trigger = tmp_path / "hang-now"
    job = stacks_job("--fault", "hang", "--fault-rank", "1", "--fault-at", str(HANG_AT),
                     "--trigger", str(trigger), "--seconds", str(HANG_SECONDS),
                     collective_timeout=COLLECTIVE_TIMEOUT)
    pid, told = job.joined(1)
    page_url = f"http://127.0.0.1:{job.rank_port + 1}/"
    with chromium() as browser:
        context = browser.new_context()
        context.set_default_timeout(BROWSER_TIMEOUT_MS)
        tab = context.new_page()
        assert tab.goto(page_url).status == 200
        # the page links rank 1's stacks on the node endpoint (its port from node.json)
        tab.wait_for_selector("#stacks-link", state="attached")
        href = tab.get_attribute("#stacks-link", "href")
        assert href == job.stacks_url(1), href
        # healthy so far: nothing captured (the agent watches it step)
        missing = get(job.stacks_url(1))
        assert missing.status == 404 and "no stack capture" in missing.text
        trigger.touch()
        # ---- its loader blocks: no step for 10 s, then the capture
        body = wait_for(lambda: captured(job, 1), settle(HANG_AT * 0.2, stacks.FLOOR_SECONDS),
                        0.5,
                        "rank 1's stacks on the node endpoint", alive=(job.process,),
                        details=lambda: job.output()[-3000:])
        stuck = job.progress(told)
        taken = float(header(body)["captured at"].rsplit("unix ", 1)[1].rstrip(")"))
        latency = taken - stuck.end
        print(f"rank 1 stopped stepping after step {stuck.step} (in_step {stuck.in_step}); "
              f"captured {latency:.1f} s after its last step ended (trigger: "
              f"{stacks.FLOOR_SECONDS:g} s)\n{body[:1500]}")
        head = header(body)
        assert (head["job"], head["rank"], head["pid"]) == (JOB, "1", str(pid))
        assert head["why"].startswith("no step for ") and "between steps" in head["why"]
        assert head["step"] == f"{stuck.step} (between steps)" and not stuck.in_step
        assert 'faulty_dp.py", line' in body and "in __getitem__" in body
        assert stacks.FLOOR_SECONDS <= latency <= stacks.FLOOR_SECONDS + 8
        assert running(pid)
        # rank 0 waits for it inside its step (the all-reduce): captured as such
        zero = wait_for(lambda: captured(job, 0), settle(stacks.FLOOR_SECONDS), 0.5,
                        "rank 0's stacks")
        assert "inside the step after step" in header(zero)["why"], zero[:600]
        assert "in __getitem__" not in zero
        # the series an alert builds the link from: when, and the node endpoint's scheme
        series = samples(scrape(job.node + "/metrics"))
        stamp = series.get(("mfotel_node_rank_stack_timestamp_seconds", frozenset(
            {"job_name": JOB, "rank": "1", "scheme": "http"}.items())))
        assert stamp is not None and stamp >= taken - 0.01
        index = get(job.node + "/stacks?format=json").json()["captures"]
        assert {(c["rank"], c["url"]) for c in index} == {
            (0, f"/stacks?job_name={JOB}&rank=0"), (1, f"/stacks?job_name={JOB}&rank=1")}
        # ---- the operator follows the page's link
        tab.click("#stacks-link")
        tab.wait_for_url(job.stacks_url(1))
        shown = tab.inner_text("body")
        assert "in __getitem__" in shown and f"rank: 1\npid: {pid}" in shown, shown[:600]
        context.close()


def steps_per_second(job: StacksJob, told: Announcement, seconds: float,
                     during: Any = None) -> float:
    """Rank's steps/s over `seconds` by its heartbeat; `during()` is called meanwhile until
    the window ends."""
    first, began = job.step(told), time.monotonic()
    while time.monotonic() - began < seconds:
        if during is not None:
            during()
        else:
            time.sleep(0.1)
    return (job.step(told) - first) / (time.monotonic() - began)


def test_captures_of_a_training_rank_leave_its_step_rate_unchanged(stacks_job):
    job = stacks_job()
    pid, told = job.joined(1)
    start_ticks = procfs.read_stat(pid).start_ticks
    wait_for(lambda: job.step(told) >= 100, settle(30), 0.5, "100 steps (warm)",
             alive=(job.process,))
    watched = time.time()
    before = steps_per_second(job, told, WINDOW_SECONDS)
    took: list[float] = []
    sizes: list[int] = []
    missed: list[float] = []

    def capture() -> None:
        started = time.monotonic()
        got = stacks.dump(pid, start_ticks, told)
        if got is None:   # nothing written within the dump's 2 s start (seen once in a full
            missed.append(time.monotonic() - started)   # suite, the cores 7x oversubscribed)
        else:
            assert "(most recent call first)" in got.text, got.text[:400]
            took.append(time.monotonic() - started)
            sizes.append(got.size)
        time.sleep(max(0.0, CAPTURE_EVERY - (time.monotonic() - started)))
    during = steps_per_second(job, told, WINDOW_SECONDS, capture)
    after = steps_per_second(job, told, WINDOW_SECONDS)
    print(f"rank 1 steps/s: {before:.2f} before, {during:.2f} while captured every "
          f"{CAPTURE_EVERY:g} s ({len(took)} captures, {min(took) * 1000:.0f}-"
          f"{max(took) * 1000:.0f} ms each, {max(sizes)} B at most, {len(missed)} missed), "
          f"{after:.2f} after")
    # the agent takes the next capture of an episode `retry` seconds later: a missed one now
    # and then loses nothing; most are taken
    assert len(missed) <= 0.1 * (len(took) + len(missed)), (len(took), missed)
    assert len(took) >= WINDOW_SECONDS / CAPTURE_EVERY * 0.6
    assert running(pid) and job.process.poll() is None
    assert during >= RATE_TOLERANCE * before and after >= RATE_TOLERANCE * before
    # the agent, meanwhile, took none of its own: every rank stepped and answered (one taken
    # before, while a rank compiled its graph holding the GIL, would be its silence's)
    index = get(job.node + "/stacks?format=json").json()["captures"]
    assert [c for c in index if c["at"] >= watched] == [], index
