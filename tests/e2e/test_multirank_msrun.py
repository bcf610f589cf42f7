"""Two real data-parallel ranks under msrun (CPU, loopback), scraped directly and by Prometheus.

One msrun launch of examples/multirank/train_dp.py serves the whole module: rank r serves
/metrics on base + r, rank 0 writes a file_sd target file, a real Prometheus scrapes the ranks
through that file and evaluates the checked-in rules every second. The ranks run slowly until
Prometheus has seen what the tests check, then finish normally. Each rank writes the losses it
computed (the ground truth) to a file; the tests compare what was scraped with it.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

import pytest

from mfotel.alerting.rules import STEP_MEAN, RulesConfig, write_rules
from mfotel.localstack.servers import Prometheus, free_port
from tests.support.metrics import value
from tests.support.multirank import (
    EndpointPoller,
    child_env,
    free_port_block,
    msrun_command,
    read_json,
    start,
    stop,
)
from tests.support.otlp_receiver import OtlpReceiver, points
from tests.support.prometheus import INTERVAL, prometheus_config, value_of
from tests.support.waiting import msrun_startup, settle, wait_for

pytestmark = pytest.mark.slow

JOB = "mfotel-msrun"
STEPS = 400          # upper bound; the ranks sleep per step until the test releases them
STEP_SLEEP = 0.05
RELEASE = "release"


@dataclass
class DpRun:
    base_port: int
    returncode: int
    truth: dict[int, dict[str, Any]]
    bodies: dict[int, list[dict]]
    target_texts: list[str]
    target_file_after: bool
    worker_logs: dict[int, str]
    prom: dict[str, list[dict]] = field(default_factory=dict)
    pushed: list[Any] = field(default_factory=list)  # OTLP requests, in arrival order


def _prometheus_checks(prom: Prometheus) -> dict[str, list[dict]]:
    """What Prometheus sees while both ranks train (each query waited for)."""
    sel = f'job_name="{JOB}"'
    queries = {
        "up": 'up{job="mfotel"} == 1',
        "step_mean": f"job_name_rank:mindformers_train_step_duration_seconds:mean1m{{{sel}}} > 0",
        "samples_rate": f"job_name:mindformers_train_samples:rate1m{{{sel}}} > 0",
        "ranks_running": f"job_name:mindformers_train_ranks_running:count{{{sel}}} == 2",
        "spread": f"job_name:mindformers_train_step_duration_seconds:rank_spread1m{{{sel}}} >= 1",
        "rank_info": f"mindformers_train_rank_info{{{sel}}}",
        "waited_for": f"job_name_rank:mindformers_train_waited_for:ratio1m{{{sel}}}",
        # a scrape that misses (a loaded machine) counts a rank out for an interval
        "reporting": f"job_name:mindformers_train_ranks_reporting:count{{{sel}}} == 2",
    }
    expected = {"up": 2, "step_mean": 2, "rank_info": 2, "waited_for": 2}
    seen = {}
    for name, expr in queries.items():
        want = expected.get(name, 1)
        seen[name] = wait_for(lambda expr=expr, want=want:
                              (r := prom.query(expr)) and len(r) == want and r,
                              settle(2 * INTERVAL, INTERVAL), message=f"Prometheus {name}: {expr}")
    seen["step_mean_raw"] = _raw_step_means(prom, sel)
    return seen


def _raw_step_means(prom: Prometheus, sel: str) -> list[dict]:
    """Each rank's recorded mean step time beside the mean of the raw samples of the same
    1-minute window (no extrapolation), and how many samples that window held.

    rate() extrapolates _sum and _count each towards the window's start by 0 to 1.1 scrape
    intervals, by different amounts in a series' first minute (one is cut at its zero point,
    the other is not): a recorded mean can then sit below every step's time.
    """
    dur = "mindformers_train_step_duration_seconds"
    at = {r["metric"]["rank"]: float(r["value"][1])
          for r in prom.query(f"timestamp({STEP_MEAN}{{{sel}}})")}
    out = []
    for rank, ts in sorted(at.items()):
        one = f'{sel},rank="{rank}"'
        grew = {part: f"(max_over_time({dur}_{part}{{{one}}}[1m])"
                      f" - min_over_time({dur}_{part}{{{one}}}[1m]))" for part in ("sum", "count")}
        queries = {"recorded": f"{STEP_MEAN}{{{one}}}",
                   "raw": f"{grew['sum']} / {grew['count']}",
                   "samples": f"count_over_time({dur}_count{{{one}}}[1m])"}
        values = {k: value_of(prom.query(q, ts)) for k, q in queries.items()}
        out.append({"rank": rank, "at": ts, **{k: v[0] if v else None for k, v in values.items()}})
    return out


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory) -> DpRun:
    work = tmp_path_factory.mktemp("msrun")
    base = free_port_block(2)
    targets = work / "targets" / f"{JOB}.json"
    truth_dir, release = work / "truth", work / RELEASE
    rules = write_rules(work)  # the shipped rules (prometheus/rules/), multi-rank ones included
    prom = Prometheus(prometheus_config(rule_files=[r.name for r in rules],
                                        targets_glob=str(work / "targets" / "*.json")),
                      rule_files=rules, workdir=work / "prom")
    args = ["--steps", str(STEPS), "--port", str(base), "--job-name", JOB,
            "--file-sd", str(targets), "--truth-dir", str(truth_dir), "--log-rank", "0",
            "--step-sleep", str(STEP_SLEEP), "--slow-until", str(release),
            # lingering all of it: the first scrape of the final status (Prometheus's, often)
            # would end the linger before the poller's scrape could see it
            "--linger-seconds", "3", "--linger-fixed"]
    urls = {r: f"http://127.0.0.1:{base + r}/metrics" for r in (0, 1)}
    with prom, OtlpReceiver() as receiver:
        args += ["--otlp-endpoint", receiver.url]
        run = start(msrun_command(args, free_port(), work / "logs"), child_env(),
                    work / "msrun.log", work)
        try:
            with EndpointPoller(urls, (targets,)) as poller:
                def running(rank: int) -> bool:
                    return any(value(b, "mindformers_train_status") == 1
                               for b in poller.bodies[rank])

                wait_for(lambda: running(0) and running(1), msrun_startup(),
                         message="both ranks running", alive=[run])
                seen = _prometheus_checks(prom)
                release.touch()
                run.wait(timeout=300)
        finally:
            stop(run)
    logs = {r: (work / "logs" / f"worker_{r}.log").read_text(errors="replace") for r in (0, 1)}
    assert run.returncode == 0, (work / "msrun.log").read_text(errors="replace")[-3000:]
    return DpRun(base, run.returncode, {r: read_json(truth_dir / f"rank_{r}.json") for r in (0, 1)},
                 poller.bodies,
                 poller.file_texts[targets], targets.exists(), logs, seen, receiver.requests)


def _final(run: DpRun, rank: int) -> dict:
    finals = [b for b in run.bodies[rank] if value(b, "mindformers_train_status") == 2]
    assert finals, f"rank {rank}: no scrape saw the completed status"
    return finals[-1]


def _last_step(run: DpRun, rank: int) -> int:
    return max(int(s) for s in run.truth[rank]["losses"])


def test_each_rank_serves_its_own_port_with_its_rank_label(dp_run):
    for rank in (0, 1):
        body = _final(dp_run, rank)
        ranks = {dict(labels)["rank"] for (name, labels) in body if name.startswith("mindformers_")}
        assert ranks == {str(rank)}  # port base + r serves rank r, and only it
        assert value(body, "mindformers_train_rank_info", rank=str(rank), local_rank=str(rank),
                     world_size="2", job_name=JOB) == 1


def test_both_endpoints_were_scraped_while_training(dp_run):
    for rank in (0, 1):
        steps = {value(b, "mindformers_train_step") for b in dp_run.bodies[rank]
                 if value(b, "mindformers_train_status") == 1}
        assert len(steps) >= 2  # several distinct steps seen mid-run


def test_learning_rate_is_identical_across_ranks(dp_run):
    lr = [value(_final(dp_run, r), "mindformers_train_learning_rate") for r in (0, 1)]
    last = _last_step(dp_run, 0)
    assert _last_step(dp_run, 1) == last
    low, high = 0.0001, 0.01  # nn.CosineDecayLR(min=base/100, max=base, decay_steps=STEPS)
    expected = low + 0.5 * (high - low) * (1 + math.cos(math.pi * (last - 1) / STEPS))
    assert lr[0] == lr[1] == pytest.approx(expected, rel=1e-5)


def test_losses_are_what_each_rank_computed(dp_run):
    losses = {}
    for rank in (0, 1):
        body, last = _final(dp_run, rank), _last_step(dp_run, rank)
        assert value(body, "mindformers_train_step") == last
        losses[rank] = value(body, "mindformers_train_loss")
        assert losses[rank] == dp_run.truth[rank]["losses"][str(last)]
    assert losses[0] != losses[1]  # different shards: data parallel, not one rank twice


def test_grad_norm_is_the_reduced_one_on_both_ranks(dp_run):
    last = _last_step(dp_run, 0)
    norms = [value(_final(dp_run, r), "mindformers_train_grad_norm") for r in (0, 1)]
    assert norms[0] == norms[1] == dp_run.truth[0]["grad_norms"][str(last)]


def test_console_lines_only_from_log_rank(dp_run):
    lines = {r: [x for x in dp_run.worker_logs[r].splitlines() if "[Monitor]" in x] for r in (0, 1)}
    assert lines[1] == []
    truth = dp_run.truth[0]["losses"]
    assert len(lines[0]) == len(truth)
    for line in lines[0]:
        step, loss = re.search(r"step: (\d+), loss: ([^,]+),", line).groups()
        assert loss == f"{truth[step]:.6g}"


def test_the_logging_rank_prints_every_local_ranks_address(dp_run):
    """Rank 0 (log_rank 0) prints one line at train begin with both local ranks' /metrics,
    port + local rank; rank 1 prints none. The poller scraped those very URLs."""
    printed = {r: [x for x in dp_run.worker_logs[r].splitlines()
                   if x.startswith(f"mfotel: job {JOB} on ")] for r in (0, 1)}
    assert len(printed[0]) == 1 and printed[1] == []
    urls = re.findall(r"(http://\S+/metrics) \(local rank (\d)\)", printed[0][0])
    assert urls == [(f"http://127.0.0.1:{dp_run.base_port + r}/metrics", str(r)) for r in (0, 1)]
    for rank in (0, 1):
        assert value(_final(dp_run, rank), "mindformers_train_rank_info", rank=str(rank)) == 1


def test_file_sd_listed_both_ranks_and_was_removed_after_the_end(dp_run):
    assert dp_run.target_texts, "the target file was never seen"
    groups = json.loads(dp_run.target_texts[-1])
    assert [t for g in groups for t in g["targets"]] == \
        [f"127.0.0.1:{dp_run.base_port}", f"127.0.0.1:{dp_run.base_port + 1}"]
    assert not dp_run.target_file_after  # a normal end removes it


def test_prometheus_scraped_both_ranks_through_file_sd(dp_run):
    up = dp_run.prom["up"]
    assert sorted(r["metric"]["instance"] for r in up) == \
        [f"127.0.0.1:{dp_run.base_port}", f"127.0.0.1:{dp_run.base_port + 1}"]
    assert sorted(r["metric"]["rank"] for r in dp_run.prom["rank_info"]) == ["0", "1"]


def test_job_level_recording_rules_have_values(dp_run):
    prom = dp_run.prom
    assert sorted(r["metric"]["rank"] for r in prom["step_mean"]) == ["0", "1"]
    # each step sleeps (train_dp.py's Truth callback, before OTelMonitor's end mark): the mean
    # of the raw samples is at least that; the recorded rate() mean is within what extrapolating
    # _sum and _count by 0 to 1.1 scrape intervals each can make of it (_raw_step_means)
    raw = prom["step_mean_raw"]
    assert [r["rank"] for r in raw] == ["0", "1"], raw
    for r in raw:
        assert r["raw"] >= STEP_SLEEP, raw
        k = r["samples"] - 1  # scrape intervals the window's samples span
        assert k >= 1, raw
        assert k / (k + 1.1) <= r["recorded"] / r["raw"] <= (k + 1.1) / k, raw
    assert value_of(prom["ranks_running"]) == [2.0]
    assert value_of(prom["samples_rate"])[0] > 0
    assert value_of(prom["spread"])[0] >= 1


def test_both_ranks_pushed_otlp_with_their_rank_attributes(dp_run):
    last_loss: dict[str, float] = {}
    for request in dp_run.pushed:  # the last push of each rank is its final one, at shutdown
        for point in points(request):
            if point.name == "mindformers.train.loss":
                assert point.attributes["job_name"] == JOB
                assert point.resource["mfotel.rank"] == int(point.attributes["rank"])
                last_loss[point.attributes["rank"]] = point.value
    assert sorted(last_loss) == ["0", "1"]
    for rank in (0, 1):
        assert last_loss[str(rank)] == dp_run.truth[rank]["losses"][str(_last_step(dp_run, rank))]


def test_multirank_rules_score_both_ranks(dp_run):
    # time outside the step above the median rank's: of two ranks, plus and minus half their
    # difference; two healthy ranks wait for neither (well below the straggler threshold)
    scores = {r["metric"]["rank"]: float(r["value"][1]) for r in dp_run.prom["waited_for"]}
    assert sorted(scores) == ["0", "1"]
    assert abs(sum(scores.values())) < 1e-9
    assert all(abs(v) < RulesConfig().straggler_wait_ratio for v in scores.values()), scores
    assert value_of(dp_run.prom["reporting"]) == [2.0]
