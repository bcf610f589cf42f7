"""The store a cluster grows into: a real training scraped by a real Prometheus with the shipped
rules and the remote_write block and external labels of examples/prometheus/victoriametrics.yml
(the scrape targets and a 1 s scrape and evaluation interval changed, as an operator would),
writing into a real VictoriaMetrics (Debian's 1.79); every dashboard query is run against both
through the Prometheus HTTP API and compared at the same evaluation timestamps.

The queries whose values legitimately differ are listed in DIFFERS with the reason (and in
docs/scaling.md section 5); every other query must return the same series and values.
"""
from __future__ import annotations

import json
import math
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from mfotel.dashboards.queries import PanelQuery
from tests.e2e.test_dashboards_e2e import ALL_VARIABLES, _expr, _queries, feed
from tests.support.paths import ROOT
from tests.support.promtool import TIMEOUT, promtool
from tests.support.victoria_metrics import VictoriaMetrics

pytestmark = pytest.mark.slow

EXAMPLE = ROOT / "examples" / "prometheus" / "victoriametrics.yml"
REL, ABS = 1e-9, 1e-12             # float tolerance: the same samples, other arithmetic

_RATE = ("rate()/increase() of a raw counter at query time: MetricsQL does not extrapolate to "
         "the window's edges as Prometheus does, and counts from the last sample before the "
         "window (from the first sample of a new series): increase() gives whole steps, rate() "
         "the increase over the time its samples span, and a series' first timestamp has a "
         "value. Panels reading the recorded rates (job_name:*:rate1m) are the same.")
_OR = ("`x or 0 * y` fills the timestamps where x is absent with 0 in Prometheus; MetricsQL "
       "(1.79) drops y's series wherever a series with the same labels exists in x at any "
       "time of the range, so those timestamps have no point instead of 0.")

_NAN = ("VictoriaMetrics 1.79 drops NaN samples at ingestion: where Prometheus holds a rank's "
        "NaN loss / grad norm (left out of the finite samples, so out of the job mean), the "
        "store has no sample, and its lookback finds the rank's last finite one, which enters "
        "the job mean and the rank's deviation.")
#: The gauges /metrics exposes as they are (NaN included): Prometheus stores their NaN.
NAN_SERIES = "mindformers_train_(loss|grad_norm)"

#: (dashboard uid, panel title, refId) -> why VictoriaMetrics answers otherwise (MetricsQL).
#: The series are the same for every query; these differ in values or timestamps only.
DIFFERS: dict[tuple[str, str, str], str] = {
    ("mfotel-cluster-health", "Steps per second", "A"): _RATE,
    ("mfotel-training-overview", "Samples per second", "B"): _RATE,
    ("mfotel-training-overview", "Tokens per second", "B"): _RATE,
    ("mfotel-cluster-health", "Export errors", "A"): _RATE,
    ("mfotel-training-overview", "Non-finite steps", "A"): _RATE,
    ("mfotel-cluster-health", "Ranks initialising", "A"): _OR,
    ("mfotel-cluster-health", "Ranks running", "A"): _OR,
    ("mfotel-cluster-health", "Ranks completed", "A"): _OR,
    ("mfotel-cluster-health", "Loss deviation from the job mean", "A"): _NAN,
    ("mfotel-cluster-health", "Grad norm deviation from the job mean", "A"): _NAN,
}


def _get(url: str, path: str, params: dict[str, Any]) -> Any:
    query = urllib.parse.urlencode(params, doseq=True)
    with urllib.request.urlopen(f"{url}{path}?{query}", timeout=60) as response:
        body = json.loads(response.read())
    assert body["status"] == "success", body
    return body["data"]


def _raw(url: str, start: float, end: float, names: str) -> list[tuple[float, str]]:
    """(time, value) of every raw sample the store holds for the run in the series whose name
    matches `names`."""
    window = f"{int(end - start) + 2}s"
    result = _get(url, "/api/v1/query", {"query": f'{{__name__=~"{names}"}}[{window}]',
                                         "time": end})["result"]
    return [(float(at), value) for series in result for at, value in series["values"]]


def _samples(url: str, start: float, end: float) -> int:
    """Raw samples the store holds for the run, every series (scraped and recorded): the
    numbers (VictoriaMetrics drops NaN samples at ingestion)."""
    return sum(value != "NaN" for _, value in _raw(url, start, end, ".+"))


def _nan_times(url: str, start: float, end: float, names: str) -> set[float]:
    """When the series matching `names` hold a NaN sample: Prometheus's API leaves out its
    staleness markers, VictoriaMetrics's shows them as NaN (a scrape that failed under load
    writes one for every series of its target, at that scrape's time)."""
    return {at for at, value in _raw(url, start, end, names) if value == "NaN"}


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> Iterator[tuple[str, str, float, float, set[str]]]:
    """(prometheus URL, VictoriaMetrics URL, start, end, external label names) once the store
    holds every sample Prometheus holds."""
    work = tmp_path_factory.mktemp("victoriametrics-e2e")
    example = yaml.safe_load(EXAMPLE.read_text())
    external = example["global"]["external_labels"]
    with VictoriaMetrics(work / "vm") as vm:
        remote = example["remote_write"]
        remote[0]["url"] = vm.write_url
        remote[0]["queue_config"]["batch_send_deadline"] = "1s"   # the test waits less
        extra = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s",
                            "external_labels": external}, "remote_write": remote}
        with feed(work, extra) as (prom, start, end):
            # whole seconds; counted two scrapes after the end, so every sample up to it is
            # settled in Prometheus (a rule evaluation just before it may still be appending)
            start, end = math.ceil(start), math.floor(end)
            while time.time() < end + 2:
                time.sleep(0.2)
            wanted = _samples(prom.url, start, end)
            # the NaN loss /metrics exposes as it is: Prometheus stores it, VictoriaMetrics
            # 1.79 drops NaN samples at ingestion (not its staleness markers): `x != x`
            # finds nothing there, the finite-sample queries answer the same
            nan_scraped = _nan_times(prom.url, start, end, NAN_SERIES)
            assert nan_scraped
            deadline = time.monotonic() + 90
            while _samples(vm.url, start, end) < wanted:
                assert time.monotonic() < deadline, \
                    f"VictoriaMetrics holds {_samples(vm.url, start, end)} of {wanted} samples"
                time.sleep(0.5)
            assert not nan_scraped & _nan_times(vm.url, start, end, NAN_SERIES)
            yield prom.url, vm.url, start, end, set(external)


def _key(labels: dict[str, str], external: set[str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in labels.items() if k not in external))


def _close(a: float, b: float, absolute: float = ABS) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b or abs(a - b) <= max(absolute, REL * max(abs(a), abs(b)))


def _answer(url: str, query: PanelQuery, start: float, end: float,
            external: set[str]) -> dict[Any, Any]:
    """The query as Grafana asks it: label values, an instant vector at the end, or a range
    at 1 s steps; series by their labels (the store's external labels left out)."""
    expr = _expr(query, start, end, ALL_VARIABLES)
    if query.origin == "variable":
        values = _get(url, f"/api/v1/label/{query.label}/values",
                      {"match[]": expr, "start": start, "end": end})
        return {value: {} for value in values}
    if query.instant:
        result = _get(url, "/api/v1/query", {"query": expr, "time": end})["result"]
        return {_key(r["metric"], external): {end: float(r["value"][1])} for r in result}
    result = _get(url, "/api/v1/query_range",
                  {"query": expr, "start": start, "end": end, "step": "1s"})["result"]
    return {_key(r["metric"], external): {float(t): float(v) for t, v in r["values"]}
            for r in result}


def series_differ(prom: dict[Any, Any], vm: dict[Any, Any]) -> str | None:
    if set(prom) == set(vm):
        return None
    only_p, only_v = set(prom) - set(vm), set(vm) - set(prom)
    return f"series: only Prometheus {sorted(only_p)[:3]}, only VM {sorted(only_v)[:3]}"


#: Seconds after a staleness marker (a scrape that failed under load) in which the two stores
#: may answer a range query at different timestamps: the marker's own scrape, the rule
#: evaluation that drops the series' records, and the next step.
STALE_SECONDS = 3.0


def compare(prom: dict[Any, Any], vm: dict[Any, Any], absolute: float = ABS,
            stale: frozenset[float] = frozenset()) -> str | None:
    """None when the answers agree; else what differs. Timestamps in only one answer are
    allowed within STALE_SECONDS after a time in `stale`."""
    worst = series_differ(prom, vm)
    for series, points in prom.items():
        other = vm[series]
        apart = set(points) ^ set(other)
        if any(not any(0 <= at - marker <= STALE_SECONDS for marker in stale) for at in apart):
            return (f"timestamps of {dict(series)}: {len(points)} vs {len(other)} points, "
                    f"{len(apart)} not in both")
        for at, value in points.items():
            if at in apart:
                continue
            if not _close(value, other[at], absolute):
                worst = worst or f"{dict(series)} at {at}: {value!r} vs {other[at]!r}"
    return worst


def test_the_example_remote_write_config_is_valid():
    done = subprocess.run([promtool(), "check", "config", str(EXAMPLE)], capture_output=True,
                          text=True, timeout=TIMEOUT, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 2 rule files found" in done.stdout
    (remote,) = yaml.safe_load(EXAMPLE.read_text())["remote_write"]
    assert remote["url"].endswith(":8428/api/v1/write")


def test_every_dashboard_query_answers_the_same_from_victoriametrics(stores):
    prom_url, vm_url, start, end, external = stores
    differ: dict[tuple[str, str, str], str] = {}
    series: list[str] = []
    compared = 0
    # VictoriaMetrics may hand a unix time (1.8e9 s, 16 digits, stored as a decimal) back a
    # few float64 ULPs (2.4e-7 s each) off: `time() - x` shows it
    unix_ulps = 16 * math.ulp(float(end))
    markers = frozenset(_nan_times(vm_url, start, end, ".+"))   # VictoriaMetrics keeps them
    for query in _queries():
        prom = _answer(prom_url, query, start, end, external)
        vm = _answer(vm_url, query, start, end, external)
        compared += 1
        if series_differ(prom, vm):
            series.append(f"{query.where}: {series_differ(prom, vm)}")
        problem = compare(prom, vm, unix_ulps if "time()" in query.expr else ABS, markers)
        if problem:
            differ[(query.dashboard, query.title, query.ref_id)] = problem
    report = "\n".join(f"{k}: {v}" for k, v in sorted(differ.items()))
    print(f"\n{compared} queries compared; {len(differ)} differ:\n{report}")
    assert not series, "queries answering other series:\n" + "\n".join(series)
    unexplained = {k: v for k, v in differ.items() if k not in DIFFERS}
    assert not unexplained, "queries VictoriaMetrics answers otherwise:\n" + "\n".join(
        f"{k}: {v}" for k, v in sorted(unexplained.items()))
    # an `x or 0 * y` panel differs only where x is absent for part of the range (e.g. the
    # ranks running once the run has completed): the same when x covers it all
    stale = {k for k in set(DIFFERS) - set(differ) if DIFFERS[k] is not _OR}
    assert not stale, f"documented as different but the same now: {sorted(stale)}"
    assert compared >= 100
    # docs/scaling.md section 5 says the same
    section = (ROOT / "docs" / "scaling.md").read_text().split("### VictoriaMetrics", 1)[1]
    assert f"dashboards' {compared} queries" in section
    assert f"except for {len(DIFFERS)} queries" in section
    for _, title, _ in DIFFERS:
        assert title in section, title
