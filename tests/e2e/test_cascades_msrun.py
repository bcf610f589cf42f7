"""Cascades on real `msrun` jobs: one rank's fault takes the job down, and the page names its
first cause, once, never a rank that waited for it or was killed after it.

Each job is tests/support/scripts/faulty_dp.py (2 or 4 CPU ranks, gradient all-reduce inside
the graph), most under the real `mfotel-instrument` (its node agent reports the ranks and
captures a stuck rank's stacks), watched by real Prometheus and Alertmanager servers with the
shipped configs and a webhook (tests/support/jobtruth.py). MindSpore's time-outs are its own:
by default its CPU collective gives up on a silent peer after 30 s (`MS_NODE_TIMEOUT`), before
any stall threshold; with `MS_NODE_TIMEOUT=120` the stall pages first and the later exits must
not page a healthy rank. Two stacks watch one job where both stall thresholds matter: the
shipped `stall_seconds` (900 s: only the time-out can page) and a short one (10 s).

Every test counts the critical notifications at the webhook after the job ended and one more
`group_interval` (a second notification would come then), and polls Prometheus' ALERTS the
whole time: no critical alert may name a healthy rank, or no rank, at any moment.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.support.jobtruth import JOB_RULES, AlertWatch, FaultyJob
from tests.support.waiting import settle, wait_for

pytestmark = pytest.mark.slow

HANG_STEP = 30
#: Each rank sleeps this long inside each step (~4 steps/s): a step's compute is a few ms of a
#: core, and at 0.05 s (18 steps/s) the suite's concurrent jobs alone kept both cores busy.
STEP_SLEEP = 0.2
#: The rules as shipped for the stall (900 s, for 2m), the rest shortened as JOB_RULES.
SHIPPED_STALL = dataclasses.replace(JOB_RULES, stall_seconds=900, stall_for="2m")
#: A short stall threshold, as an operator of short steps would set it.
SHORT_STALL = dataclasses.replace(JOB_RULES, stall_seconds=10, stall_for="3s")
#: The critical route's group_interval in these tests (1m as shipped): a second notification
#: of a group that changed comes this long after the first, so a shorter one shows a second
#: page of an incident sooner (the routes, group_wait and inhibitions are as shipped).
CRITICAL_GROUP_INTERVAL = 10.0
#: A long time-out (4 x MindSpore's 30 s): the short stall threshold pages first (about 25 s
#: after the hang) and the time-out's exits come as the page's context. The suite's longest
#: test: it waits the time-out out, but not msrun's scheduler, which waits it once more. (It
#: was 300 s, 7.5 minutes of the suite's 8 for one test; what it shows is the order, the stall
#: page long before the time-out, which 120 s keeps: the short stall pages at ~25 s, the shipped
#: threshold is 900 s.)
LONG_TIMEOUT = {"MS_NODE_TIMEOUT": "120"}
#: Seconds a rank's /metrics stays up after its training ended, for the final scrape (30 s as
#: shipped, here without waiting to be scraped): 5 s was shorter than the 1 s scrapes of a rank
#: failed in a row on a loaded machine, and a completed rank was never seen completing.
LINGER = 15


def _job(workdir: Path, fault: str, **options: Any) -> FaultyJob:
    """A FaultyJob (tests/support/jobtruth.py) with this module's critical group_interval."""
    return FaultyJob(workdir, fault, critical_group_interval=f"{CRITICAL_GROUP_INTERVAL:g}s",
                     **options)


def _say(name: str, **figures: object) -> None:
    print(f"\n[cascade] {name}: " + ", ".join(f"{k}={v}" for k, v in figures.items()))


def _quiet_after_the_end(job: FaultyJob, timeout: float = 600, ranks_only: bool = False) -> float:
    """Wait until every process of the job ended (`ranks_only`: every rank; msrun's scheduler
    waits a long `MS_NODE_TIMEOUT` again for the ranks it lost), then one critical
    group_interval and two evaluations more (a page a consequence would add comes by then);
    the unix time the job ended."""
    wait_for(job.ranks_gone if ranks_only else job.processes_gone, settle(timeout), 1.0,
             "the job's ranks ended" if ranks_only else "the job's processes ended",
             details=job.log_tail)
    ended = time.time()
    time.sleep(CRITICAL_GROUP_INTERVAL + 10)
    return ended


def _stacks(page_url: str) -> str:
    with urllib.request.urlopen(page_url, timeout=10) as response:
        return response.read().decode()


def _only_the_culprit(watch: AlertWatch, rank: str, job: FaultyJob) -> None:
    seen = watch.critical()
    assert seen, "no critical alert ever fired"
    when = {key: round(at - job.started, 1) for key, at in watch.first_seen.items()}
    assert {r for _, r in seen} == {rank}, \
        f"a critical alert named another rank or none: {seen}, first seen (s after start) {when}"


# ---------------------------------------------------------------- a rank blocks in its loader
def test_a_hang_past_a_long_time_out_pages_once_before_and_nothing_after(tmp_path):
    """`MS_NODE_TIMEOUT=120`: with a short stall threshold the stall pages rank 1 first; 2
    minutes later rank 0 times out and msrun kills rank 1: nothing more pages (counted once
    the ranks ended: msrun's scheduler then waits the time-out again for the ranks it lost,
    exporting nothing). With the shipped threshold the time-out is what pages, naming rank 1."""
    with _job(tmp_path, "hang", fault_at=HANG_STEP, seconds=3600, launcher=True,
                   rules=SHORT_STALL, also={"shipped": SHIPPED_STALL}, env=LONG_TIMEOUT,
                   step_sleep=STEP_SLEEP) as job:
        short, shipped = job.watch(), job.watch(job.stacks["shipped"])
        job.wait_running()
        [first] = job.wait_notified("MindFormersTrainingStalled", 180)
        assert first.labels["rank"] == "1"
        assert "After it" not in first.annotations["description"], "nothing timed out yet"
        assert "__getitem__" in _stacks(first.annotations["stacks_url"])
        [late] = job.wait_notified("MindFormersTrainingStalled", 600, job.stacks["shipped"])
        assert late.labels["rank"] == "1"
        assert "After it: rank 0 failed" in late.annotations["description"]
        _quiet_after_the_end(job, ranks_only=True)
        assert job.pages() == [[("MindFormersTrainingStalled", "1")]], job.history()
        assert job.pages(job.stacks["shipped"]) == [[("MindFormersTrainingStalled", "1")]], \
            job.history(job.stacks["shipped"])
        _only_the_culprit(short, "1", job)
        _only_the_culprit(shipped, "1", job)
        _say("hang, MS_NODE_TIMEOUT=120",
             stall_page_after_start_s=round(first.received_at - job.started, 1),
             time_out_page_after_start_s=round(late.received_at - job.started, 1))


@pytest.mark.parametrize("ranks, hung", [(2, 1), (4, 2)], ids=["2-ranks", "4-ranks"])
def test_a_hang_with_mindsporess_time_out_pages_the_hung_rank_once_with_its_stacks(
        tmp_path, ranks, hung):
    """The hung rank blocks forever in its dataset's `__getitem__` after step 29; the others
    wait inside step 30 until MindSpore's collective gives up (30 s), fail, and msrun kills the
    hung rank. Both stall thresholds: one page naming the hung rank ("After it: rank ...
    failed"), whose stacks link shows the blocking frame; never a page for a rank that
    waited."""
    with _job(tmp_path, "hang", ranks=ranks, fault_rank=hung, fault_at=HANG_STEP,
              seconds=3600, launcher=True, rules=SHIPPED_STALL, also={"short": SHORT_STALL},
              step_sleep=STEP_SLEEP) as job:
        shipped, short = job.watch(), job.watch(job.stacks["short"])
        job.wait_running()
        pages = {}
        for name, stack in (("shipped", job.stack), ("short", job.stacks["short"])):
            [page] = job.wait_notified("MindFormersTrainingStalled", 240, stack)
            assert page.labels["rank"] == str(hung), page.labels
            pages[name] = page
        description = pages["shipped"].annotations["description"]
        assert "it stopped stepping while the others waited for it" in description, description
        assert "After it: rank " in description and " failed" in description, description
        body = _stacks(pages["shipped"].annotations["stacks_url"])
        assert "__getitem__" in body and "faulty_dp.py" in body, body[:2000]
        ended = _quiet_after_the_end(job)
        for name, stack in (("shipped", job.stack), ("short", job.stacks["short"])):
            assert job.pages(stack) == [[("MindFormersTrainingStalled", str(hung))]], (
                name, job.history(stack))
        _only_the_culprit(shipped, str(hung), job)
        _only_the_culprit(short, str(hung), job)
        _say(f"hang of rank {hung} in {ranks} ranks, MindSpore's time-out",
             page_after_start_s={n: round(p.received_at - job.started, 1)
                                 for n, p in pages.items()},
             job_ended_after_page_s=round(ended - pages["shipped"].received_at, 1),
             description=description)


# ---------------------------------------------------------------- a stopped rank
def test_a_stopped_rank_is_named_as_stopped_when_the_job_times_out(tmp_path):
    """SIGSTOP of rank 1 (a debugger, a frozen host), MindSpore's defaults: its /metrics goes
    silent, MindSpore's scheduler gives up on it and ends rank 0 (which of the two paths
    MindSpore takes first is a race); one page names rank 1 as stopped, none names no rank."""
    with _job(tmp_path, "none", launcher=True, rules=SHIPPED_STALL,
                   also={"short": SHORT_STALL}, step_sleep=STEP_SLEEP) as job:
        shipped, short = job.watch(), job.watch(job.stacks["short"])
        job.wait_running(seconds=5)
        os.kill(job.pids()[1], signal.SIGSTOP)
        stopped_at = time.time()
        pages = {name: job.wait_notified("MindFormersTrainingStalled", 240, stack)[0]
                 for name, stack in (("shipped", job.stack), ("short", job.stacks["short"]))}
        for page in pages.values():
            assert page.labels["rank"] == "1"
            assert "its process is stopped" in page.annotations["description"]
        _quiet_after_the_end(job)
        for stack in (job.stack, job.stacks["short"]):
            assert job.pages(stack) == [[("MindFormersTrainingStalled", "1")]], job.history(stack)
        _only_the_culprit(shipped, "1", job)
        _only_the_culprit(short, "1", job)
        _say("SIGSTOP, MindSpore's time-out",
             page_after_stop_s={n: round(p.received_at - stopped_at, 1)
                                for n, p in pages.items()},
             description=pages["shipped"].annotations["description"])


def test_a_stopped_rank_past_a_long_time_out_pages_once_and_resumes(tmp_path):
    """SIGSTOP with `MS_NODE_TIMEOUT=120` and a short stall threshold: the stall pages rank 1
    as stopped (not the job without a rank, and the node agent's warning is no longer the only
    alert naming it); SIGCONT a minute later: training goes on and the page resolves."""
    with _job(tmp_path, "none", launcher=True, rules=SHORT_STALL, env=LONG_TIMEOUT,
                   step_sleep=STEP_SLEEP) as job:
        seen = job.watch()
        job.wait_running(seconds=5)
        rank1 = job.pids()[1]
        os.kill(rank1, signal.SIGSTOP)
        stopped_at = time.time()
        [page] = job.wait_notified("MindFormersTrainingStalled", 180)
        assert page.labels["rank"] == "1"
        assert "its process is stopped" in page.annotations["description"]
        time.sleep(max(0.0, stopped_at + 60 - time.time()))
        os.kill(rank1, signal.SIGCONT)
        before = max(map(int, job.truth_of(1)["losses"]), default=0)
        job.wait(lambda: max(map(int, job.truth_of(1)["losses"]), default=0) > before + 20, 120,
                 1.0, "rank 1 training again after SIGCONT")
        job.wait(lambda: not job.firing("MindFormersTrainingStalled"), 120, 1.0,
                 "the stall page resolved")
        time.sleep(CRITICAL_GROUP_INTERVAL + 15)
        assert job.pages() == [[("MindFormersTrainingStalled", "1")]], job.history()
        _only_the_culprit(seen, "1", job)
        _say("SIGSTOP, MS_NODE_TIMEOUT=120",
             page_after_stop_s=round(page.received_at - stopped_at, 1))


# ---------------------------------------------------------------- an exception
@pytest.mark.parametrize("launcher", [True, False], ids=["launcher", "plain-msrun"])
def test_an_exception_pages_its_rank_not_the_ranks_killed_after_it(tmp_path, launcher):
    """Rank 1's data loader raises: it reports failed, msrun SIGKILLs rank 0.
    One page, MindFormersRankFailed for rank 1 (its exit code under the launcher, rank 0's
    SIGKILL and vanishing: context)."""
    trigger = tmp_path / "raise-now"
    with _job(tmp_path, "raise", trigger=trigger, launcher=launcher,
                   step_sleep=STEP_SLEEP, linger_seconds=LINGER) as job:
        seen = job.watch()
        job.wait_running(seconds=3)
        raised = job.trigger()
        [page] = job.wait_notified("MindFormersRankFailed", 180)
        assert page.labels["rank"] == "1"
        _quiet_after_the_end(job)
        assert job.pages() == [[("MindFormersRankFailed", "1")]], job.history()
        _only_the_culprit(seen, "1", job)
        warnings = [call for call in job.notifications()
                    if call[0].labels.get("severity") == "warning"]
        assert warnings == [], [[a.alertname for a in call] for call in warnings]
        _say(f"exception, {'launcher' if launcher else 'plain msrun'}",
             page_after_fault_s=round(page.received_at - raised, 1),
             description=page.annotations["description"])


# ---------------------------------------------------------------- a clean finish
def test_a_clean_finish_with_long_end_work_pages_nobody(tmp_path):
    """Rank 0 spends longer in its end work (a final checkpoint save in on_train_end) than
    ranks_missing_for after rank 1 completed and left: nobody is missing, nothing pages."""
    end_work = 2 * 20 + 10   # JOB_RULES.ranks_missing_for is 20s
    with _job(tmp_path, "none", steps=150, step_sleep=STEP_SLEEP, end_work=end_work,
              end_work_rank=0, linger_seconds=LINGER) as job:
        seen = job.watch()
        job.wait_running()   # scraped: "nothing paged" must not hold for a job never seen
        wait_for(job.processes_gone, settle(300 + end_work), 1.0, "the job completed",
                 details=job.log_tail)
        time.sleep(15)
        assert seen.critical() == set() and job.notifications() == [], job.history()
        completed = job.value_by_rank(
            f"last_over_time(mindformers_train_status{{{job.sel()}}}[10m])")
        assert completed == {"0": 2.0, "1": 2.0}, completed


# ---------------------------------------------------------------- the end of a job
def test_the_nan_origin_stays_over_the_jobs_end_and_a_finishing_job_misses_nobody(tmp_path):
    """Rank 1's loss goes NaN first; the job ends a few steps later and rank 0 spends longer in
    its end work (a final checkpoint save in on_train_end) than ranks_missing_for after rank 1
    completed and left, so rank 1's series vanish first: MindFormersLossNotFinite names rank 1
    from start to end, never rank 0, in Prometheus too (ALERTS: dashboards, a second
    Alertmanager); nobody is missing, nothing else pages."""
    trigger = tmp_path / "nan-now"
    end_work = 2 * 20 + 10   # JOB_RULES.ranks_missing_for is 20s
    with _job(tmp_path, "nan", trigger=trigger, steps=200, step_sleep=STEP_SLEEP,
              end_work=end_work, end_work_rank=0, linger_seconds=LINGER) as job:
        seen = job.watch()
        job.wait_running(seconds=5)
        job.trigger()
        [page] = job.wait_notified("MindFormersLossNotFinite", 120)
        assert page.labels["rank"] == "1"
        wait_for(job.processes_gone, settle(300 + end_work), 1.0, "the job ended",
                 details=job.log_tail)
        time.sleep(15)
        assert seen.critical() == {("MindFormersLossNotFinite", "1")}, seen.critical()
        assert job.pages() == [[("MindFormersLossNotFinite", "1")]], job.history()
        assert job.ever_fired("MindFormersRanksMissing") == []
        completed = job.value_by_rank(
            f"last_over_time(mindformers_train_status{{{job.sel()}}}[10m])")
        assert completed == {"0": 2.0, "1": 2.0}, completed
