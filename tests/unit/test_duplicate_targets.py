"""A rank scraped twice: the same target in two scrape jobs (a static list and a file_sd, two
jobs over one service). Every series of the rank then comes twice, labelled with each job.

No rule may fail to evaluate then: a rule whose evaluation fails ("found duplicate series for
the match group") records and pages nothing, for every job of that Prometheus, not only the
doubled one, and says so only in Prometheus' log. Every promtool test of prometheus/tests is
run with each of its input series doubled under a second job: each page comes as with one
scrape (the same rank, the same annotations), beside its twin labelled with the other job, and
every recorded value is as with one scrape (a job's samples per second, its ranks' counts, its
goodput count each rank once), beside its twin where the record keeps the scrape job.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests.support import promtool_split
from tests.support.paths import ROOT
from tests.support.promtool import TIMEOUT, promtool, promtool_env

TESTS_DIR = ROOT / "prometheus" / "tests"
JOB, AGAIN = "mindformers", "mindformers-again"
DUPLICATED = "MindFormersRankDuplicated"
_SCRAPE_JOB = re.compile(rf'(?<!\w)job="{JOB}"')
#: A recording rule's name, with matchers: what a promql_expr_test of a record reads (the other
#: cases query raw series themselves, and count a doubled rank twice as any query would).
_RECORD = re.compile(r"[a-z_]+:[a-z_]+:[a-z0-9_]+(\{.*\})?")


def _again(series: str) -> str | None:
    """`series` as the second scrape job's, or None if no scrape job labels it."""
    doubled = _SCRAPE_JOB.sub(f'job="{AGAIN}"', series)
    return doubled if doubled != series else None


def doubled(document: dict[str, Any], folder: Path) -> dict[str, Any]:
    """The promtool test `document` (of prometheus/tests) with each input series also scraped
    by the job AGAIN, each expected alert and recorded sample of a rank's series with its twin,
    without DUPLICATED's cases and the promql_expr_tests that query raw series (not _RECORD)."""
    tests = []
    for test in document["tests"]:
        series = []
        for entry in test.get("input_series", []):
            series.append(entry)
            twin = _again(entry["series"])
            if twin is not None:
                series.append({**entry, "series": twin})
        cases = []
        for case in test.get("alert_rule_test", []):
            if case["alertname"] == DUPLICATED:   # (its point: it names every doubled rank)
                continue
            alerts = []
            for alert in case.get("exp_alerts") or []:
                alerts.append(alert)
                if alert["exp_labels"].get("job") == JOB:
                    alerts.append({**alert, "exp_labels": {**alert["exp_labels"], "job": AGAIN}})
            cases.append({**case, "exp_alerts": alerts})
        records = []
        for case in test.get("promql_expr_test", []):
            if not _RECORD.fullmatch(case["expr"]):
                continue
            samples = []
            for sample in case.get("exp_samples") or []:
                samples.append(sample)
                twin = _again(sample.get("labels", ""))
                if twin is not None:
                    samples.append({**sample, "labels": twin})
            records.append({**case, "exp_samples": samples})
        tests.append(test | {"input_series": series, "alert_rule_test": cases,
                             "promql_expr_test": records})
    rule_files = [str((folder / name).resolve()) for name in document["rule_files"]]
    return {**document, "rule_files": rule_files, "tests": tests}


def test_the_doubling_doubles_the_series_and_the_pages_of_a_rank() -> None:
    document = {"rule_files": ["../rules/a.yml"], "tests": [{
        "input_series": [{"series": f'x{{job="{JOB}", job_name="j", rank="0"}}', "values": "1"},
                         {"series": 'y{job_name="j"}', "values": "2"}],
        "promql_expr_test": [
            {"expr": "x", "eval_time": "0s", "exp_samples": []},
            {"expr": 'a:b:c{job_name="j"}', "eval_time": "0s", "exp_samples": [
                {"labels": f'a:b:c{{job="{JOB}", job_name="j"}}', "value": 1},
                {"labels": 'a:b:c{job_name="j"}', "value": 2}]}],
        "alert_rule_test": [{"eval_time": "1m", "alertname": "A", "exp_alerts": [
            {"exp_labels": {"job": JOB, "rank": "0"}}, {"exp_labels": {"job_name": "j"}}]}]}]}
    [test] = doubled(document, Path("/t/tests"))["tests"]
    assert [s["series"] for s in test["input_series"]] == [
        f'x{{job="{JOB}", job_name="j", rank="0"}}', f'x{{job="{AGAIN}", job_name="j", rank="0"}}',
        'y{job_name="j"}']
    # a record's samples with their twins; a query of raw series dropped
    assert test["promql_expr_test"] == [
        {"expr": 'a:b:c{job_name="j"}', "eval_time": "0s", "exp_samples": [
            {"labels": f'a:b:c{{job="{JOB}", job_name="j"}}', "value": 1},
            {"labels": f'a:b:c{{job="{AGAIN}", job_name="j"}}', "value": 1},
            {"labels": 'a:b:c{job_name="j"}', "value": 2}]}]
    assert [a["exp_labels"] for a in test["alert_rule_test"][0]["exp_alerts"]] == [
        {"job": JOB, "rank": "0"}, {"job": AGAIN, "rank": "0"}, {"job_name": "j"}]


def test_every_rule_evaluates_and_pages_as_before_with_every_rank_scraped_twice(tmp_path):
    written = []
    for path in sorted(TESTS_DIR.glob("*.yml")):
        document = yaml.safe_load(path.read_text())
        written.append(tmp_path / "doubled" / path.name)
        written[-1].parent.mkdir(exist_ok=True)
        written[-1].write_text(yaml.safe_dump(doubled(document, path.parent), sort_keys=False))
    split = promtool_split.split(written, tmp_path / "split")
    done = subprocess.run([promtool(), "test", "rules", *map(str, split)], capture_output=True,
                          text=True, timeout=TIMEOUT, env=promtool_env())
    out = done.stdout + done.stderr
    assert " err: " not in out, "a rule failed to evaluate:\n" + "\n".join(
        line for line in out.splitlines() if " err: " in line)
    assert done.returncode == 0 and out.count("SUCCESS") == len(split), out[-6000:]
