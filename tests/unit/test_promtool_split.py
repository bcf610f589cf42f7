"""tests/support/promtool_split.py: each promtool test with only the rules it can read, and the
split tests pass the real promtool as the whole file does."""
from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests.support.promtool import TIMEOUT, promtool, promtool_env
from tests.support.promtool_split import split

RULES = {"groups": [
    {"name": "records", "interval": "30s", "rules": [
        {"record": "job:up:sum", "expr": "sum by (job) (up)"},
        {"record": "job:up:min", "expr": "min by (job) (job:up:sum)"},
        {"record": "job:other:sum", "expr": "sum by (job) (other)"},
        {"record": "job:told:max", "expr": "max by (job) (told)"},
    ]},
    {"name": "alerts", "rules": [
        {"alert": "Down", "expr": "job:up:min == 0",
         "annotations": {"summary": '{{ with query "job:told:max" }}told{{ end }}'}},
        {"alert": "Other", "expr": "job:other:sum > 1"},
    ]},
]}
WATCHER = {"alert": "AnyFiring", "expr": 'count(ALERTS{alertstate="firing"}) > 0'}


def _test(**checks: Any) -> dict[str, Any]:
    return {"interval": "1m", "input_series": [
        {"series": 'up{job="a", instance="x"}', "values": "1 0 0 0"},
        {"series": 'other{job="a"}', "values": "5 5 5 5"},
        {"series": 'told{job="a"}', "values": "1 1 1 1"}], **checks}


def _split(tmp_path: Path, rules: dict[str, Any], *tests: dict[str, Any]) -> list[Path]:
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    (tmp_path / "t.yml").write_text(yaml.safe_dump({
        "rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": list(tests)}))
    return split([tmp_path / "t.yml"], tmp_path / "split")


def _kept(test_file: Path) -> list[tuple[str, str | None, list[str]]]:
    """(group, its interval, its rules' names) of the rules a split test runs beside."""
    document = yaml.safe_load(test_file.read_text())
    groups = [g for name in document["rule_files"]
              for g in yaml.safe_load((test_file.parent / name).read_text())["groups"]]
    return [(g["name"], g.get("interval"), [r.get("record") or r["alert"] for r in g["rules"]])
            for g in groups]


def test_an_alert_keeps_what_it_reads_through_records_and_templates_and_nothing_else(tmp_path):
    down = _test(alert_rule_test=[{"alertname": "Down", "eval_time": "1m", "exp_alerts": []}])
    [one] = _split(tmp_path, RULES, down)
    # job:told:max is read only by Down's annotation template; the group keeps its interval
    assert _kept(one) == [("records", "30s", ["job:up:sum", "job:up:min", "job:told:max"]),
                          ("alerts", None, ["Down"])]
    assert yaml.safe_load(one.read_text())["tests"] == [down]


def test_each_test_of_a_file_gets_its_own_rules(tmp_path):
    other = _test(promql_expr_test=[{"expr": "job:other:sum", "eval_time": "0m",
                                     "exp_samples": [{"labels": 'job:other:sum{job="a"}',
                                                      "value": 5}]}])
    nothing = _test(alert_rule_test=[{"alertname": "Missing", "eval_time": "1m"}])
    first, second = _split(tmp_path, RULES, other, nothing)
    assert _kept(first) == [("records", "30s", ["job:other:sum"])]
    assert _kept(second) == []


def test_a_reader_of_alerts_keeps_every_alert_and_a_name_matcher_every_rule(tmp_path):
    watched = {**RULES, "groups": [*RULES["groups"], {"name": "meta", "rules": [WATCHER]}]}
    [one] = _split(tmp_path / "alerts", watched, _test(alert_rule_test=[
        {"alertname": "AnyFiring", "eval_time": "3m"}]))
    assert [names for _, _, names in _kept(one)] == [
        ["job:up:sum", "job:up:min", "job:other:sum", "job:told:max"], ["Down", "Other"],
        ["AnyFiring"]]
    by_name = {**RULES, "groups": [*RULES["groups"], {"name": "meta", "rules": [
        {"record": "count:all", "expr": 'count({__name__=~"job:.+"})'}]}]}
    [every] = _split(tmp_path / "names", by_name, _test(promql_expr_test=[
        {"expr": "count:all", "eval_time": "0m"}]))
    assert sum(len(names) for _, _, names in _kept(every)) == 7


def test_split_tests_pass_and_fail_in_the_real_promtool_as_the_whole_file(tmp_path):
    fires = [{"exp_labels": {"alertname": "Down", "job": "a"},
              "exp_annotations": {"summary": "told"}}]
    tests = [_test(alert_rule_test=[{"alertname": "Down", "eval_time": "2m", "exp_alerts": fires},
                                    {"alertname": "Other", "eval_time": "2m", "exp_alerts": [
                                        {"exp_labels": {"alertname": "Other", "job": "a"}}]}]),
             _test(alert_rule_test=[{"alertname": "Down", "eval_time": "0m", "exp_alerts": fires}])]
    files = _split(tmp_path, RULES, *tests)

    def run(*paths: Path) -> str:
        done = subprocess.run([promtool(), "test", "rules", *map(str, paths)], capture_output=True,
                              text=True, timeout=TIMEOUT, env=promtool_env())
        return done.stdout + done.stderr
    whole, parts = run(tmp_path / "t.yml"), run(*files)
    # the first passes (Down's template read the record kept for it), the second fails
    assert [whole.count("SUCCESS"), whole.count("FAILED")] == [0, 1]
    assert [parts.count("SUCCESS"), parts.count("FAILED")] == [1, 1]
    assert "alertname: Down" in parts.split("FAILED", 1)[1]
