"""Each test of a promtool test file as a file of its own, beside copies of only the rules it
can read.

`promtool test rules` evaluates every rule of its rule files at every evaluation step of a
test, although a test checks only the alerts it names (`alert_rule_test`) and the expressions
it evaluates (`promql_expr_test`). What a test checks depends only on the rules those read,
directly or through recording rules, alert templates and ALERTS: the others are evaluated for
nothing. Over the shipped rules (88 rules, 94 tests) a run of the split tests took 10.8
CPU-seconds where the files as written took 48-55.

The closure is built to keep too much rather than too little:
- a rule reads every name that appears anywhere in its expression, its labels and its
  annotations (templates may query), whether or not it is a metric name;
- a rule or expression that reads ALERTS or ALERTS_FOR_STATE reads every alert;
- where a rule matches metric names by `__name__`, every rule is kept.
Kept rules stay in their groups, in their order, with the groups' own settings, so every kept
rule is evaluated as in the whole file.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_Dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)

#: PromQL identifiers (metric and recording rule names, functions, labels; the surplus only
#: keeps more rules).
_NAME = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_ALERTS = frozenset({"ALERTS", "ALERTS_FOR_STATE"})
_EVERY_ALERT = "alert *"


def _reads(*texts: str) -> set[str]:
    names = set(_NAME.findall(" ".join(texts)))
    return names | {_EVERY_ALERT} if names & _ALERTS else names


def _rule_reads(rule: dict[str, Any]) -> set[str]:
    templates = [str(value) for key in ("labels", "annotations")
                 for value in (rule.get(key) or {}).values()]
    return _reads(str(rule["expr"]), *templates)


def _rule_writes(rule: dict[str, Any]) -> set[str]:
    if "record" in rule:
        return {rule["record"]}
    return {f"alert {rule['alert']}", _EVERY_ALERT, *_ALERTS}


def _reads_by_name(rules: list[dict[str, Any]]) -> dict[str, set[str]]:
    """What the rules writing each name read (an alert's own name with them: ALERTS reads it)."""
    readers: dict[str, set[str]] = {}
    for rule in rules:
        reads = _rule_reads(rule) | ({f"alert {rule['alert']}"} if "alert" in rule else set())
        for name in _rule_writes(rule):
            readers.setdefault(name, set()).update(reads)
    return readers


def _closure(roots: set[str], readers: dict[str, set[str]]) -> set[str]:
    """The names `roots` read, through every rule writing one of them."""
    needed: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name not in needed:
            needed.add(name)
            todo.extend(readers.get(name, ()))
    return needed


def _test_reads(test: dict[str, Any]) -> set[str]:
    alerts = {f"alert {case['alertname']}" for case in test.get("alert_rule_test") or []}
    return alerts.union(*(_reads(str(case["expr"])) for case in test.get("promql_expr_test") or []))


def _kept(rule: dict[str, Any], needed: set[str]) -> bool:
    if "record" in rule:
        return rule["record"] in needed
    return f"alert {rule['alert']}" in needed


def split(test_files: Iterable[Path], out: Path) -> list[Path]:
    """Write each test of `test_files` to a folder of `out` of its own, with copies of the rule
    files it names (relative to it, as promtool reads them) pruned to the rules it can read;
    return the new test files, in order."""
    written: list[Path] = []
    groups: dict[Path, list[dict[str, Any]]] = {}
    for test_file in test_files:
        document = yaml.load(test_file.read_text(), Loader=_Loader)
        rule_files = [(test_file.parent / name).resolve()
                      for name in document.get("rule_files") or []]
        for path in rule_files:
            if path not in groups:
                groups[path] = (yaml.load(path.read_text(), Loader=_Loader) or {}).get(
                    "groups") or []
        readers = _reads_by_name([rule for path in rule_files for group in groups[path]
                                  for rule in group["rules"]])
        whole = any("__name__" in path.read_text() for path in rule_files)
        for index, test in enumerate(document["tests"]):
            needed = _closure(_test_reads(test), readers)
            folder = out / f"{test_file.stem}-{index}"
            folder.mkdir(parents=True)
            names = []
            for number, path in enumerate(rule_files):
                kept = [{**group, "rules": [rule for rule in group["rules"]
                                            if whole or _kept(rule, needed)]}
                        for group in groups[path]]
                name = f"{number}-{path.name}"
                (folder / name).write_text(yaml.dump(
                    {"groups": [group for group in kept if group["rules"]]}, Dumper=_Dumper,
                    sort_keys=False))
                names.append(name)
            one = {**document, "rule_files": names, "tests": [test]}
            written.append(folder / test_file.name)
            written[-1].write_text(yaml.dump(one, Dumper=_Dumper, sort_keys=False))
    return written
