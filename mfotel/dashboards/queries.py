"""The queries a dashboard JSON makes, with Grafana's variables substituted (for tests and
checks that run them against a real Prometheus).

    for query in dashboard_queries(json.load(open("grafana/dashboards/x.json"))):
        expr = substitute(query.expr, {"job_name": ["llama"], "run_id": ALL, "rank": ALL},
                          rate_interval="1m")
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from .common import rank_count_gate

#: A variable set to "All": Grafana sends the variable's allValue (`.*` on ours).
ALL: Sequence[str] = ("$__all",)

_LABEL_VALUES = re.compile(r"^\s*label_values\((?P<selector>.*),\s*(?P<label>\w+)\s*\)\s*$", re.S)


@dataclass(frozen=True)
class PanelQuery:
    """One query of a dashboard: a panel target, an annotation or a variable."""

    dashboard: str
    title: str
    expr: str
    origin: Literal["panel", "annotation", "variable"] = "panel"
    instant: bool = False
    label: str = ""           # variables: the label whose values they list
    description: str = ""
    legend: str = ""          # panel targets: legend format and refId
    ref_id: str = ""

    @property
    def where(self) -> str:
        return f"{self.dashboard} / {self.title}"


def dashboard_queries(dashboard: Mapping[str, Any]) -> list[PanelQuery]:
    """Every query of a dashboard JSON: panel targets (also inside collapsed rows), Prometheus
    annotations, and the series selectors of `label_values()` variables."""
    uid = dashboard["uid"]
    found: list[PanelQuery] = []
    panels = list(dashboard.get("panels", []))
    for panel in panels:
        panels.extend(panel.get("panels", []))  # collapsed rows nest their panels
        for target in panel.get("targets", []):
            if target.get("expr"):
                found.append(PanelQuery(uid, panel["title"], target["expr"],
                                        instant=bool(target.get("instant")),
                                        description=panel.get("description", ""),
                                        legend=target.get("legendFormat", ""),
                                        ref_id=target.get("refId", "")))
    for annotation in dashboard.get("annotations", {}).get("list", []):
        if annotation.get("expr"):
            found.append(PanelQuery(uid, f"annotation: {annotation['name']}", annotation["expr"],
                                    origin="annotation"))
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") != "query":
            continue
        query = variable["query"]
        text = query.get("query", "") if isinstance(query, dict) else query
        match = _LABEL_VALUES.match(text)
        if match is None:
            raise ValueError(f"{uid} / ${variable['name']}: not label_values(...): {text!r}")
        found.append(PanelQuery(uid, f"variable: {variable['name']}", match["selector"],
                                origin="variable", label=match["label"]))
    return found


def with_rank_lines_limit(expr: str, limit: int) -> str:
    """`expr` (before substitution) as if MAX_RANK_LINES were `limit`: with 1, a job of two
    ranks gets the spread over ranks that a job of thousands gets."""
    for op in ("<=", ">"):
        expr = expr.replace(rank_count_gate(op), rank_count_gate(op, limit))
    return expr


def _regex_escape(value: str) -> str:
    # Grafana's prometheusSpecialRegexEscape: a regex escape, doubled inside a PromQL string.
    value = value.replace("\\", "\\\\\\\\")
    return re.sub(r"[$^*{}\[\]'+?.()|]", lambda m: "\\\\" + m.group(0), value)


def grafana_value(values: Sequence[str], all_value: str = ".*") -> str:
    """What Grafana writes for a multi-value variable used in a `=~"..."` matcher."""
    if list(values) == list(ALL):
        return all_value
    escaped = [_regex_escape(v) for v in values]
    return escaped[0] if len(escaped) == 1 else f"({'|'.join(escaped)})"


def substitute(expr: str, variables: Mapping[str, Sequence[str]], rate_interval: str = "1m",
               interval: str = "15s", range_: str = "1h") -> str:
    """`expr` with `$var`/`${var}` and Grafana's `$__rate_interval`, `$__interval`, `$__range`
    replaced. An unknown variable raises KeyError (a typo would otherwise reach the user);
    `$1`, `$2`, ... are label_replace() group references, which Grafana leaves alone."""
    builtins = {"__rate_interval": rate_interval, "__interval": interval, "__range": range_}

    def replace(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name.isdigit():
            return match.group(0)
        if name in builtins:
            return builtins[name]
        if name in variables:
            return grafana_value(variables[name])
        raise KeyError(f"unknown dashboard variable ${name} in {expr!r}")
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", replace, expr)


_KEYWORDS = frozenset({
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
    "and", "or", "unless", "atan2", "inf", "nan", "start", "end"})


def metric_names(expr: str) -> set[str]:
    """Names of the series an expression selects (a small lexer, not a full parser: it drops
    strings, label matchers, ranges and grouping label lists, then keeps identifiers that are
    neither functions nor keywords). Run the expression through Prometheus for syntax."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)
    text = re.sub(r"\{[^{}]*\}", " ", text)
    text = re.sub(r"\[[^\[\]]*\]", " ", text)
    # `sum by (a) (x)`: dropping the clause leaves `sum (x)`, a call
    text = re.sub(r"\s*\b(by|without)\s*\([^()]*\)", "", text)
    text = re.sub(r"\b(on|ignoring|group_left|group_right)\s*\([^()]*\)", " ", text)
    names = set()
    for match in re.finditer(r"(?<![\w:.])([A-Za-z_:][\w:]*)(\s*\()?", text):
        name, call = match.group(1), match.group(2)
        if call or name.lower() in _KEYWORDS:
            continue
        names.add(name)
    return names
