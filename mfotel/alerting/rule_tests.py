"""`promtool test rules` files for the rules a `RulesConfig` generates, so that changed
thresholds come with tests that pass (`mfotel assets --set stall_seconds=1800`).

The tests are package data (`promtool_tests/*.yml`), written for `prometheus/tests/` beside
`prometheus/rules/`. Where a number follows from a setting, a template writes it as
`${expression}` over the RulesConfig fields and a few helpers, e.g. the minute a stall alert
fires, `${minutes(max(stall_seconds, 600)) + minutes(stall_for) + 10}m`, or the description
it expects,
`${human(960 + 120)}`; a line `#= name = expression` names a value for the lines below it,
and `${need(condition, "why")}` refuses settings a test cannot be built for:

    files = render_rule_tests(RulesConfig(stall_seconds=1800))   # name -> YAML text

Expressions are arithmetic only (no attribute access, no other names), evaluated with `ast`.
A selector of `label="value"` matchers is added to every input series (and to the expected
labels of alerts that keep every series label); other matchers must already match the
tests' series (e.g. `job=~"mindformers.*"`), else RuleTestError says so.
"""
from __future__ import annotations

import ast
import dataclasses
import math
import operator
import re
from collections.abc import Callable
from importlib import resources
from typing import Any

import yaml

from .rules import (
    RUNBOOK_BASE_URL,
    RulesConfig,
    alerting_rules,
    duration_seconds,
    recording_rules,
)

TEMPLATES = "promtool_tests"
_FIELD = re.compile(r"\$\{([^}]*)\}")
_DEFINE = re.compile(r"^\s*#=\s*([a-z_][a-z0-9_]*)\s*=\s*(.+?)\s*$")
_MATCHER = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*,?')
_SERIES = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)\{(.*)\}$")


class RuleTestError(ValueError):
    """The tests cannot be rendered for these settings (a template or the selector)."""


def human(seconds: float) -> str:
    """Prometheus' `humanizeDuration`, as alert descriptions show a duration."""
    if not math.isfinite(seconds):
        return f"{seconds:.4g}"
    if seconds == 0 or abs(seconds) < 1:
        return f"{seconds:.4g}s"
    sign, whole = ("-" if seconds < 0 else ""), int(abs(seconds))
    days, rest = divmod(whole, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{sign}{days}d {hours}h {minutes}m {secs}s"
    if hours:
        return f"{sign}{hours}h {minutes}m {secs}s"
    if minutes:
        return f"{sign}{minutes}m {secs}s"
    return f"{sign}{abs(seconds):.4g}s"


def _stairs(first: float, increment: float, count: int, width: int) -> str:
    """Expanding notation for `count` values from `first` by `increment`, each held for
    `width` samples: a counter or timestamp that moves every `width` minutes."""
    values = (first + index * increment for index in range(count))
    return " ".join(f"{value:g}x{width - 1}" for value in values)


def _minutes(duration: float | str) -> int:
    """Whole minutes of seconds or of a Prometheus duration, rounded up: the first 1m
    evaluation at or after it."""
    seconds = duration_seconds(duration) if isinstance(duration, str) else duration
    return math.ceil(seconds / 60)


def _need(condition: bool, why: str) -> str:
    if not condition:
        raise RuleTestError(f"these settings leave no room for this test: {why}")
    return ""


_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "max": max, "min": min, "round": round, "int": int, "ceil": math.ceil, "floor": math.floor,
    "secs": duration_seconds, "minutes": _minutes, "human": human,
    "num": lambda x: f"{x:g}", "need": _need,
    "pct": lambda ratio: f"{ratio:.0%}", "hpct": lambda ratio: f"{ratio * 100:.4g}%",
    "fixed": lambda x, digits: f"{x:.{digits}f}", "stairs": _stairs,
}
_OPERATORS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
    ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos,
    ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge,
    ast.Eq: operator.eq, ast.NotEq: operator.ne,
}


def evaluate(expression: str, names: dict[str, Any]) -> Any:
    """The value of an arithmetic `expression` over `names` and the helper functions."""
    def value(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, str)):
            return node.value
        if isinstance(node, ast.Name) and node.id in names:
            return names[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and \
                type(node.ops[0]) in _OPERATORS:
            return _OPERATORS[type(node.ops[0])](value(node.left), value(node.comparators[0]))
        if isinstance(node, ast.BoolOp):
            values = [value(operand) for operand in node.values]
            return all(values) if isinstance(node.op, ast.And) else any(values)
        if isinstance(node, ast.IfExp):
            return value(node.body) if value(node.test) else value(node.orelse)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in _FUNCTIONS and not node.keywords:
            return _FUNCTIONS[node.func.id](*map(value, node.args))
        raise RuleTestError(f"${{{expression}}}: {ast.unparse(node)} is not allowed here "
                            f"(numbers, RulesConfig fields, + - * / // % **, comparisons, "
                            f"and, or, x if c else y, {', '.join(sorted(_FUNCTIONS))})")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise RuleTestError(f"${{{expression}}}: {exc.msg}") from None
    return value(tree)


def _fill(text: str, names: dict[str, Any], where: str) -> str:
    """`${expr}` replaced by its value; `#= name = expr` lines define names for the lines
    below them (and are left out)."""
    names = dict(names)

    def one(match: re.Match[str]) -> str:
        result = evaluate(match.group(1), names)
        if isinstance(result, float) and result.is_integer():
            result = int(result)
        return str(result)
    out = []
    for number, line in enumerate(text.splitlines(keepends=True), 1):
        try:
            definition = _DEFINE.match(line)
            if definition:
                names[definition.group(1)] = evaluate(definition.group(2), names)
            else:
                out.append(_FIELD.sub(one, line))
        except RuleTestError as exc:
            raise RuleTestError(f"{where}:{number}: {exc}") from None
    return "".join(out)


def _matchers(selector: str) -> list[tuple[str, str, str]]:
    """(label, operator, value) of a selector's matchers."""
    found, at = [], 0
    while at < len(selector):
        match = _MATCHER.match(selector, at)
        if match is None or match.end() == at:
            raise RuleTestError(f"selector {selector!r}: cannot read the matchers after "
                                f"{selector[:at]!r}")
        value = match.group(3).encode().decode("unicode_escape")
        found.append((match.group(1), match.group(2), value))
        at = match.end()
    return found


def _series_labels(text: str) -> tuple[str, dict[str, str]]:
    match = _SERIES.match(text.strip())
    if match is None:
        return text.strip(), {}
    return match.group(1), {m[0]: m[2].encode().decode("unicode_escape")
                            for m in (_matchers(match.group(2)) if match.group(2) else [])}


def _series_text(name: str, labels: dict[str, str]) -> str:
    inner = ", ".join(f'{k}="{v}"' for k, v in labels.items())
    return f"{name}{{{inner}}}"


def _apply_selector(document: dict[str, Any], matchers: list[tuple[str, str, str]],
                    where: str) -> dict[str, Any]:
    """The rules' input series (mindformers_*, mfotel_*) made to match the selector: `=`
    labels added, the other matchers checked; expected alerts and samples of the same
    targets (job, instance) carry the added labels too."""
    added = {label: value for label, op, value in matchers if op == "="}
    for test in document.get("tests", []):
        targets: set[tuple[Any, Any]] = set()
        for series in test.get("input_series", []):
            name, labels = _series_labels(series["series"])
            if not name.startswith(("mindformers_", "mfotel_")):
                continue            # another exporter's series: the rules do not select it
            labels.update(added)
            targets.add((labels.get("job"), labels.get("instance")))
            for label, op, value in matchers:
                got = labels.get(label, "")
                ok = {"=": got == value, "!=": got != value,
                      "=~": re.fullmatch(value, got) is not None,
                      "!~": re.fullmatch(value, got) is None}[op]
                if not ok:
                    raise RuleTestError(
                        f"{where}: the test series {series['series']} cannot match the "
                        f"selector's {label}{op}\"{value}\"; write your own tests for it")
            series["series"] = _series_text(name, labels)

        def carries(labels: dict[str, Any], targets: set[tuple[Any, Any]] = targets) -> bool:
            return (labels.get("job"), labels.get("instance")) in targets
        for case in test.get("alert_rule_test", []):
            for alert in case.get("exp_alerts") or []:
                if carries(alert.get("exp_labels", {})):
                    alert["exp_labels"].update(added)
        for case in test.get("promql_expr_test", []):
            for sample in case.get("exp_samples") or []:
                name, labels = _series_labels(sample.get("labels", ""))
                if carries(labels):
                    sample["labels"] = _series_text(name, {**labels, **added})
    return document


def _header(cfg: RulesConfig, name: str) -> str:
    changed = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
               if getattr(cfg, f.name) != f.default}
    settings = "(" + ", ".join(f"{k}={v!r}" for k, v in changed.items()) + ")" if changed else ""
    return (f"# Generated by `mfotel assets` from mfotel/alerting/{TEMPLATES}/{name} for "
            f"RulesConfig{settings}.\n# Run beside the rules it tests: "
            f"promtool test rules prometheus/tests/*.yml\n")


def templates() -> dict[str, str]:
    """Template name -> text, from the package data."""
    folder = resources.files(__package__).joinpath(TEMPLATES)
    return {node.name: node.read_text(encoding="utf-8")
            for node in sorted(folder.iterdir(), key=lambda n: n.name)
            if node.name.endswith(".yml")}


def _group_order(cfg: RulesConfig) -> str:
    """The test files' `group_eval_order`: every group of the rule files in their order, the
    recording groups first. Without it promtool orders the groups at random in each run, and a
    rule reading another group's record of the same evaluation gets this one's or the one
    before (a spike alert's baseline without its newest sample: 10 of 12 runs failed)."""
    names = [group["name"] for group in (*recording_rules(cfg), *alerting_rules(cfg))]
    return ("# the groups in the order of their reads, records first (promtool's own order is\n"
            "# random in each run; Prometheus runs each group on its own schedule)\n"
            "group_eval_order:\n" + "".join(f"  - {name}\n" for name in names))


def render_rule_tests(cfg: RulesConfig | None = None) -> dict[str, str]:
    """File name -> promtool test file (YAML) for the rules of `cfg` (default thresholds)."""
    cfg = cfg or RulesConfig()
    names = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    matchers = _matchers(cfg.selector) if cfg.selector.strip() else []
    order = _group_order(cfg)   # renders every rule: once, not once a file
    out = {}
    for name, template in templates().items():
        text = _fill(template, names, f"{TEMPLATES}/{name}")
        text = re.sub(r"^evaluation_interval: .*\n", lambda m: m.group(0) + order, text,
                      count=1, flags=re.MULTILINE)
        text = text.replace(RUNBOOK_BASE_URL, cfg.runbook_base_url)
        if matchers:
            document = _apply_selector(yaml.safe_load(text), matchers, name)
            text = yaml.safe_dump(document, sort_keys=False, width=1000, allow_unicode=True)
        out[name] = _header(cfg, name) + text
    return out
