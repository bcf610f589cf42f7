"""Every dashboard query returns data from a real Prometheus fed by a real MindSpore training.

Two demo ranks of one job and run (`python -c run_demo(...)` with RANK_ID 0 and 1, rank 1
hitting a NaN loss near the end) serve /metrics; the Debian Prometheus scrapes them every second
(rank 1's target found, by file_sd, once the goodput records have read rank 0 alone) and
evaluates the rules of prometheus/rules/ every second (the goodput records every 5 s, 1m as
shipped: the run lasts ~30 s). Once both ranks finished training (they linger, still served),
every panel target, annotation and variable query of every checked-in dashboard runs through the
HTTP API with the variables substituted as Grafana would ($job_name = the job, $run_id and $rank
= All): range queries over the run for time series, instant queries for tables. Queries that
switch from a line per rank to a spread over ranks beyond MAX_RANK_LINES selected ranks run both
ways (the spread as a job of thousands of ranks gets it). Panels that need what the demo cannot
produce are listed in EXPECTED_EMPTY, with the reason. Before that, every query is parsed by an
empty Prometheus (bad_data names a bad one)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

from mfotel.alerting import goodput
from mfotel.alerting.rules import write_rules
from mfotel.cluster.discovery import write_target_file
from mfotel.dashboards.common import rank_count_gate
from mfotel.dashboards.queries import (
    ALL,
    PanelQuery,
    dashboard_queries,
    substitute,
    with_rank_lines_limit,
)
from mfotel.localstack.servers import Prometheus, find_binary, free_port
from tests.support.http import get, get_json
from tests.support.paths import ROOT
from tests.support.waiting import PYTHON_START_SECONDS, settle, wait_for

pytestmark = pytest.mark.slow

JOB = "mfotel-e2e"
RUN_ID = "e2e-run-1"
STEPS = 160
NAN_AT_STEP = 140          # on rank 1 only: non-finite panels, annotations and alerts get data
STEP_SECONDS = 0.1         # ~16 s of training: enough samples for the 1m rate windows

#: The goodput records' interval here (1m as shipped): each increase reads the evaluation one
#: interval before, so the rules are the same.
GOODPUT_INTERVAL = "5s"
GOODPUT_GROUP = "mindformers-goodput.rules"

_LOSS_SCALE = "the demo's CPU train cell reports no loss scale or overflow"
_NATIVE = "no data expected without mindformers native monitoring (TrainingStateMonitor)"
_DEVICE_EXPORTER = ("no NPU-Exporter or dcgm-exporter runs here (CPU demo); the join itself is "
                    "checked by promtool in tests/unit/test_dashboards.py")

#: (dashboard uid, panel title) -> why the demo run leaves it empty.
EXPECTED_EMPTY: dict[tuple[str, str], str] = {
    ("mfotel-training-overview", "Loss scale"): _LOSS_SCALE,
    ("mfotel-training-overview", "Loss-scale overflow steps"): _LOSS_SCALE,
    ("mfotel-training-overview", "annotation: Loss-scale overflow"): _LOSS_SCALE,
    ("mfotel-parameter-health", "Weight norm"): _NATIVE,
    ("mfotel-parameter-health", "Optimizer state norms (top 10)"): _NATIVE,
    ("mfotel-parameter-health", "Local gradient norms (top 10 parameters)"): _NATIVE,
    ("mfotel-parameter-health", "Largest local norms now (top 10)"): _NATIVE,
    ("mfotel-parameter-health", "Local loss per rank"): _NATIVE,
    ("mfotel-parameter-health", "Device accumulated local loss"): _NATIVE,
    ("mfotel-parameter-health", "Throughput linearity"): _NATIVE,
    ("mfotel-cluster-health", "Device of the slowest rank: utilisation"): _DEVICE_EXPORTER,
    ("mfotel-training-overview", "annotation: Restart without progress"):
        "the demo run has one attempt (tests/unit/test_dashboards.py has a restart, promtool)",
}

_DEMO = ("import json, sys; from mfotel.demo.training import run_demo; "
         "run_demo(**json.loads(sys.argv[1]))")


def _queries() -> list[PanelQuery]:
    return [q for path in sorted((ROOT / "grafana" / "dashboards").glob("*.json"))
            for q in dashboard_queries(json.loads(path.read_text()))]


def _api(base_url: str, path: str, params: dict[str, Any]) -> dict[str, Any]:
    body = get_json(f"{base_url}{path}?{urllib.parse.urlencode(params, doseq=True)}", timeout=30)
    assert body["status"] == "success", body
    return body["data"]


def _start_rank(rank: int, port: int, workdir: Path) -> subprocess.Popen:
    # the full linger, not just until the first scrape: rate() windows need the ranks up
    kwargs = {"steps": STEPS, "step_interval": 1, "port": port, "job_name": JOB,
              "linger_seconds": 120, "prometheus": {"linger_until_scraped": False},
              "min_step_seconds": STEP_SECONDS, "seq_length": 32,
              "nan_at_step": NAN_AT_STEP if rank == 1 else None,
              "run": {"id": RUN_ID}, "output": {"console": False},
              # checkpoint, evaluation and MFU panels (toy FLOPs and peak: any positive number)
              "checkpoint_steps": 40, "checkpoint_dir": f"checkpoints/rank{rank}",
              "evaluate": True, "flops_per_token": 1.0e6, "peak_flops": 1.0e12}
    env = {**os.environ, "RANK_ID": str(rank), "RANK_SIZE": "2", "GLOG_v": "3"}
    log = open(workdir / f"rank{rank}.log", "wb")
    try:
        return subprocess.Popen([sys.executable, "-c", _DEMO, json.dumps(kwargs)], env=env,
                                cwd=workdir, stdout=log, stderr=subprocess.STDOUT)
    finally:
        log.close()


def _logs(workdir: Path) -> str:
    return "\n".join(p.read_text()[-2000:] for p in sorted(workdir.glob("rank*.log")))


def rule_files(workdir: Path) -> list[Path]:
    """The shipped rule files with the goodput group evaluated every GOODPUT_INTERVAL: every
    other group as shipped (checked)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(goodput, "INTERVAL", GOODPUT_INTERVAL)
        written = write_rules(workdir / "rules")
    for path in written:
        ours, shipped = (yaml.safe_load(text)["groups"] for text in (
            path.read_text(), (ROOT / "prometheus" / "rules" / path.name).read_text()))
        assert [g["name"] for g in ours] == [g["name"] for g in shipped], path.name
        changed = {g["name"] for g, s in zip(ours, shipped, strict=True) if g != s}
        assert changed <= {GOODPUT_GROUP}, f"{path.name}: {changed} differ from the shipped"
    return sorted(written)


def _targets(path: Path, ports: list[int]) -> None:
    """The file_sd targets of the demo ranks, replaced at once (Prometheus watches the file)."""
    write_target_file(path, [{"targets": [f"127.0.0.1:{port}" for port in ports]}])


@contextmanager
def feed(workdir: Path, extra_config: dict[str, Any] | None = None
         ) -> Iterator[tuple[Prometheus, float, float]]:
    """(prometheus, start time, end time) with two demo ranks trained and still served;
    `extra_config` is merged into the Prometheus config (e.g. a remote_write section)."""
    import mindspore  # noqa: F401 - a test dependency: fail, never skip
    assert find_binary(("prometheus",)), "no prometheus binary: apt-get install prometheus"
    ports = [free_port(), free_port()]
    rules = rule_files(workdir)
    targets = workdir / "targets.json"
    _targets(targets, ports[:1])
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [path.name for path in rules],
        "scrape_configs": [{"job_name": "mindformers",
                            "file_sd_configs": [{"files": [str(targets)]}]}],
        **(extra_config or {}),
    }
    ranks: list[subprocess.Popen] = []
    with Prometheus(json.dumps(config), rule_files=rules,
                    workdir=workdir / "prometheus") as prom:
        start = time.time()
        try:
            ranks = [_start_rank(rank, port, workdir) for rank, port in enumerate(ports)]
            # rank 1 is first scraped after the goodput records read rank 0 alone (as a target
            # discovered late, or a first scrape that failed): its account joins the run's mean
            # without counting rank 0's twice (it did: 13% more than the wall clock once)
            seen = f'{goodput.RANKS_SEEN}{{job_name="{JOB}"}}'
            wait_for(lambda: prom.query(seen), settle(PYTHON_START_SECONDS, 10), 0.5,
                     "the goodput records reading rank 0", alive=ranks,
                     details=lambda: _logs(workdir))
            _targets(targets, ports)

            def trained() -> bool:
                done = prom.query(f'mindformers_train_status{{job_name="{JOB}"}} >= 2')
                return len(done) == 2
            # ~20 s on a quiet machine (compilation, 160 steps, an evaluation)
            wait_for(trained, settle(20), 0.5, "both ranks finished training", alive=ranks,
                     details=lambda: _logs(workdir))
            finished = time.time()

            def rules_caught_up() -> bool:
                # a rule evaluation and a scrape after the end, so the last values are in (the
                # goodput group's too: up to GOODPUT_INTERVAL later)
                seen = [prom.query(f'timestamp({record}{{job_name="{JOB}"}})') for record in
                        ("job_name:mindformers_train_samples:rate1m", goodput.WALL)]
                return all(found and float(found[0]["value"][1]) > finished + 1
                           for found in seen)
            wait_for(rules_caught_up, settle(6, 1), 0.5, "the recording rules after the run",
                     alive=ranks, details=lambda: _logs(workdir))
            yield prom, start, time.time()
        finally:
            # the ranks linger 120 s for the queries; SIGTERM would not cut a linger short (the
            # final values stay served, by design) and nothing is checked after: killed
            for proc in ranks:
                if proc.poll() is None:
                    proc.kill()
            for proc in ranks:
                proc.wait(timeout=10)


@pytest.fixture(scope="module")
def fed_prometheus(tmp_path_factory):
    """(prometheus, start time, end time) with two demo ranks trained and still served."""
    with feed(tmp_path_factory.mktemp("dashboards-e2e")) as fed:
        yield fed


ALL_VARIABLES = {"job_name": [JOB], "run_id": ALL, "rank": ALL}


def _expr(query: PanelQuery, start: float, end: float, variables: dict = ALL_VARIABLES,
          many_ranks: bool = False) -> str:
    """The query as Grafana sends it; `many_ranks`: as a job past MAX_RANK_LINES sees it."""
    expr = with_rank_lines_limit(query.expr, 1) if many_ranks else query.expr
    return substitute(expr, variables, rate_interval="1m", interval="1s",
                      range_=f"{int(end - start) + 1}s")


def _run(prom: Prometheus, query: PanelQuery, start: float, end: float,
         variables: dict = ALL_VARIABLES, many_ranks: bool = False) -> int:
    """How many series (or label values) the query returns, the way Grafana asks for it."""
    expr = _expr(query, start, end, variables, many_ranks)
    if query.origin == "variable":
        data = _api(prom.url, f"/api/v1/label/{query.label}/values",
                    {"match[]": expr, "start": start, "end": end})
        return len(data)
    if query.instant:
        return len(_api(prom.url, "/api/v1/query", {"query": expr, "time": end})["result"])
    data = _api(prom.url, "/api/v1/query_range",
                {"query": expr, "start": start, "end": end, "step": "1s"})
    return len(data["result"])


def _switches(query: PanelQuery) -> bool:
    return rank_count_gate(">") in query.expr or rank_count_gate("<=") in query.expr


def _now(prom: Prometheus, query: PanelQuery, start: float, end: float,
         many_ranks: bool = False) -> dict[str, float]:
    """The query's values at the end of the run, by rank (or by job when it has no rank)."""
    result = prom.query(_expr(query, start, end, many_ranks=many_ranks), end)
    return {r["metric"].get("rank", r["metric"].get("job_name")): float(r["value"][1])
            for r in result}


def _columns(dashboard: str, title: str) -> dict[str, PanelQuery]:
    """The queries of a table panel by the name of the column they fill."""
    found = json.loads((ROOT / "grafana" / "dashboards" / f"{dashboard}.json").read_text())
    (table,) = [p for p in found["panels"] if p["title"] == title]
    names = next(t["options"]["renameByName"] for t in table["transformations"]
                 if t["id"] == "organize")
    return {names[f"Value #{ref}"]: query for ref, query in _panel(dashboard, title).items()}


def _panel(dashboard: str, title: str) -> dict[str, PanelQuery]:
    """The queries of one panel by refId."""
    return {q.ref_id: q for q in _queries() if q.dashboard == dashboard and q.title == title}


def test_expected_empty_panels_exist():
    present = {(q.dashboard, q.title) for q in _queries()}
    assert set(EXPECTED_EMPTY) <= present, f"stale entries: {set(EXPECTED_EMPTY) - present}"


def test_every_dashboard_query_returns_data_from_a_real_training(fed_prometheus):
    prom, start, end = fed_prometheus
    empty, surprises = [], []
    for query in _queries():
        count = _run(prom, query, start, end)
        if _switches(query):   # the spread over ranks, as a job of thousands of ranks sees it
            count = max(count, _run(prom, query, start, end, many_ranks=True))
        reason = EXPECTED_EMPTY.get((query.dashboard, query.title))
        if count == 0 and reason is None:
            empty.append(f"{query.where}\n    {query.expr}")
        elif count and reason is not None:
            surprises.append(query.where)
    assert not empty, ("panels that showed nothing for a real run:\n" + "\n".join(empty))
    if surprises:
        print("expected empty but had data:", surprises)


def test_variables_list_the_job_and_both_ranks(fed_prometheus):
    prom, start, end = fed_prometheus
    jobs = _api(prom.url, "/api/v1/label/job_name/values",
                {"match[]": "mindformers_train_step", "start": start, "end": end})
    ranks = _api(prom.url, "/api/v1/label/rank/values",
                 {"match[]": f'mindformers_train_step{{job_name=~"{JOB}"}}',
                  "start": start, "end": end})
    runs = _api(prom.url, "/api/v1/label/run_id/values",
                {"match[]": f'mindformers_train_rank_info{{job_name=~"{JOB}"}}',
                 "start": start, "end": end})
    assert JOB in jobs
    assert set(ranks) == {"0", "1"}
    assert runs == [RUN_ID]


def test_nan_rank_shows_in_the_health_panels(fed_prometheus):
    prom, _, end = fed_prometheus
    finite = {r["metric"]["rank"]: float(r["value"][1]) for r in
              prom.query(f'mindformers_train_loss_finite{{job_name="{JOB}"}}', end)}
    assert finite == {"0": 1.0, "1": 0.0}
    first = prom.query(f'mindformers_train_first_nonfinite_step{{job_name="{JOB}"}}', end)
    assert [(r["metric"]["rank"], float(r["value"][1])) for r in first] == [("1", NAN_AT_STEP)]


def test_nan_rank_is_flagged_in_the_loss_panel_and_the_ranks_table(fed_prometheus):
    """Rank 1's loss went NaN at step 140: its loss line stops (no stale last finite value),
    the red bars name it (or count it, at many ranks), the ranks table shows no loss and a
    finite flag of 0, the annotation names the step; rank 0 stays a normal line."""
    prom, start, end = fed_prometheus
    loss = _panel("mfotel-training-overview", "Loss")
    lines, bars, count = (next(q for q in loss.values() if cond(q.legend)) for cond in (
        lambda legend: legend == "{{job_name}} rank {{rank}}",
        lambda legend: legend.endswith("rank {{rank}}: loss NaN/Inf"),
        lambda legend: legend.endswith("ranks with loss NaN/Inf")))
    assert set(_now(prom, lines, start, end)) == {"0"}
    assert _now(prom, bars, start, end) == {"1": 1.0}
    assert _now(prom, count, start, end, many_ranks=True) == {JOB: 1.0}
    spread = [q for q in loss.values() if "over ranks" in q.legend]
    assert len(spread) == 3 and all(set(_now(prom, q, start, end, many_ranks=True)) == {JOB}
                                    for q in spread)   # min, median, max of the finite rank

    grad = _panel("mfotel-training-overview", "Gradient norm")
    grad_bars = next(q for q in grad.values() if q.legend.endswith("grad norm NaN/Inf"))
    assert _now(prom, grad_bars, start, end) == {"1": 1.0}

    columns = _columns("mfotel-training-overview", "Ranks now")
    assert _now(prom, columns["loss finite"], start, end) == {"0": 1.0, "1": 0.0}
    assert set(_now(prom, columns["loss"], start, end)) == {"0"}
    assert _now(prom, columns["status"], start, end) == {"0": 2.0, "1": 2.0}
    (stat,) = _panel("mfotel-training-overview", "Loss finite").values()
    assert _now(prom, stat, start, end) == {JOB: 0.0}

    (first,) = [q for q in _queries() if q.title == "annotation: First non-finite loss"]
    marks = prom.query(_expr(first, start, end), end)
    assert [m["metric"]["step"] for m in marks] == [str(NAN_AT_STEP)]


def test_run_selector_keeps_the_run_and_drops_other_runs(fed_prometheus):
    prom, start, end = fed_prometheus
    this_run = {"job_name": [JOB], "run_id": [RUN_ID], "rank": ALL}
    other_run = {"job_name": [JOB], "run_id": ["a-run-that-never-was"], "rank": ALL}
    changed, leaked = [], []
    for query in (q for q in _queries() if q.origin == "panel"):
        everything = _run(prom, query, start, end)
        if _run(prom, query, start, end, this_run) != everything:
            changed.append(query.where)
        if _run(prom, query, start, end, other_run):
            leaked.append(query.where)
    assert not changed, f"selecting the run lost data: {changed}"
    assert not leaked, f"panels showing data of another run: {leaked}"


@pytest.fixture(scope="module")
def empty_prometheus(tmp_path_factory):
    assert find_binary(("prometheus",)), "no prometheus binary: apt-get install prometheus"
    with Prometheus("global:\n  scrape_interval: 15s\n",
                    workdir=tmp_path_factory.mktemp("empty-prometheus")) as prom:
        yield prom


@pytest.mark.parametrize("variables", [
    {"job_name": ALL, "run_id": ALL, "rank": ALL},
    {"job_name": ["llama-7b.sft", "run(2)"], "run_id": ["2026-12-02.a"], "rank": ["0", "7"]},
], ids=["all", "multi"])
def test_every_query_parses_in_prometheus(empty_prometheus, variables):
    """Prometheus' own parser (HTTP API) on every query, variables substituted as Grafana
    does; an empty TSDB answers a valid query with no data and a bad one with bad_data."""
    errors = []
    for query in _queries():
        expr = substitute(query.expr, variables)
        if query.origin == "variable":
            path, params = "/api/v1/series", {"match[]": expr}
        else:
            path, params = "/api/v1/query", {"query": expr}
        # an answer also for 400 (bad_data): the body says why
        body = get(f"{empty_prometheus.url}{path}?{urllib.parse.urlencode(params)}").json()
        if body.get("status") != "success":
            errors.append(f"{query.where}: {expr}\n    {body.get('error')}")
    assert not errors, "queries Prometheus rejects:\n" + "\n".join(errors)


def _by_category(prom: Prometheus, title: str, at: float) -> dict[str, float]:
    """An overview panel's values at `at` by category (one target per category)."""
    values = {}
    for query in _panel("mfotel-training-overview", title).values():
        (row,) = prom.query(substitute(query.expr, ALL_VARIABLES), at)
        values[row["metric"]["category"]] = float(row["value"][1])
    return values


def test_goodput_panels_account_for_the_run(fed_prometheus):
    """The run's time account as the goodput row shows it at the end: every category's share
    of the wall clock, adding up to 1, start-up, steps, saves and the evaluation in it and
    nothing lost to restarts (one attempt); the wall clock from the ranks' own process starts
    and accounts; one attempt, marked at the earliest process start."""
    prom, start, end = fed_prometheus
    shares = _by_category(prom, "Where the run's time went", end)
    assert set(shares) == {*goodput.CATEGORIES, goodput.UNACCOUNTED}
    assert sum(shares.values()) == pytest.approx(1.0, abs=1e-9)
    assert all(shares[name] > 0 for name in ("goodput", "startup", "input", "checkpoint",
                                             "evaluation")), shares
    assert shares["recomputed"] == shares["downtime"] == shares["stall"] == 0, shares
    # the demo's ranks closed their accounts at the end: nothing left unaccounted, rank 1's
    # account taken into the mean after rank 0's alone (`feed`) without counting that twice
    assert abs(shares[goodput.UNACCOUNTED]) < 0.01, shares
    (seen,) = prom.query(f'{goodput.RANKS_SEEN}{{job_name="{JOB}"}}[{int(end - start) + 1}s]',
                         end)
    assert [float(v) for _, v in seen["values"]][0] == 1, seen
    (ranks,) = prom.query(f'{goodput.RANKS}{{job_name="{JOB}"}}', end)
    assert float(ranks["value"][1]) == 2

    def stat(title: str) -> float:
        (query,) = _panel("mfotel-training-overview", title).values()
        (row,) = prom.query(_expr(query, start, end), end)
        assert row["metric"]["run_id"] == RUN_ID
        return float(row["value"][1])
    assert stat("Goodput over the run") == pytest.approx(shares["goodput"], abs=1e-9)
    assert 0 < stat("Goodput, last hour") < 1
    assert stat("Attempts in range") == 1
    assert stat("Recomputed steps") == 0 and stat("Downtime between attempts") == 0
    ranks = f'{{job_name="{JOB}"}}'
    starts = [float(r["value"][1]) for r in prom.query(
        f"mindformers_train_process_start_timestamp_seconds{ranks}", end)]
    ends = [float(r["value"][1]) for r in prom.query(
        f"mindformers_train_process_start_timestamp_seconds{ranks} + on (job_name, rank) "
        f"sum by (job_name, rank) (mindformers_train_time_seconds_total{ranks})", end)]
    assert len(starts) == len(ends) == 2
    # from the first start to the ranks' mean last event
    assert stat("Run wall clock") == pytest.approx(sum(ends) / 2 - min(starts), abs=1e-6)

    (attempts,) = [q for q in _queries() if q.title == "annotation: Attempts"]
    data = _api(prom.url, "/api/v1/query_range", {"query": _expr(attempts, start, end),
                                                  "start": start, "end": end, "step": "15s"})
    (series,) = data["result"]
    # one attempt: at the run's first process start, once both ranks were scraped (the first
    # rank scraped may show its own start for an evaluation: it started 10 ms later once)
    marks = [float(v) for _, v in series["values"]]
    assert marks[-1] == min(starts) * 1000 and set(marks) <= {s * 1000 for s in starts}, marks

    # the bars: seconds of each category per evaluation; the saves and the evaluation in the
    # evaluations they ended in. Each bar is read at the records' own evaluation times: a range
    # at 1 s steps from `start` can step past the last one (its evaluation, within a second of
    # `end`, holds the demo's evaluation and the run's end)
    evaluations = sorted({float(t) for row in prom.query(
        f'{goodput.CATEGORY_INCREASE}{{job_name="{JOB}"}}[{int(end - start) + 1}s]', end)
        for t, _ in row["values"]})
    assert evaluations and evaluations[-1] <= end
    bars = _panel("mfotel-training-overview", "Time per minute by category")
    seen = {}
    for query in bars.values():
        for at in evaluations:
            for row in prom.query(_expr(query, start, end), at):
                name = row["metric"]["category"]
                seen[name] = max(seen.get(name, 0.0), float(row["value"][1]))
    assert set(seen) == set(goodput.CATEGORIES)
    assert all(seen[name] > 0 for name in ("goodput", "startup", "checkpoint", "evaluation")), seen
    # the bars add up to the account: each category's seconds per evaluation, summed, are its
    # total (over the run, one attempt)
    totals = {name: sum(float(row["value"][1]) for at in evaluations for row in prom.query(
        _expr(query, start, end), at)) for query in bars.values()
        for name in [query.legend]}
    run_totals = {r["metric"]["category"]: float(r["value"][1]) for r in prom.query(
        f'{goodput.CATEGORY_TOTAL}{{job_name="{JOB}"}}', end)}
    assert totals == pytest.approx({name: run_totals[name] for name in totals}, abs=1e-6)
