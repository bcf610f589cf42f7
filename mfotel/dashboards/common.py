"""Declarative dashboard definitions and the factory that turns them into Grafana JSON.

Panel modules (`overview.py`, `cluster.py`, `params.py`) only declare `Row`s of `Panel`s of
`Target`s; `to_dict()` lays out the grid, numbers the panels, adds the `$datasource`,
`$job_name` and `$rank` variables and the table legends, and renders the JSON with
grafana-foundation-sdk (current schema, timeseries panels).

    spec = DashboardSpec(uid="mfotel-x", title="X", rows=(
        Row("Loss", (Panel("Loss", "none", (Target(sel("mindformers_train_loss"), RANK),)),)),))
    json_text = render(spec)
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

PanelKind = Literal["timeseries", "stat", "bargauge", "table"]

#: Grafana's variable syntax as it appears in the JSON.
DATASOURCE_UID = "${datasource}"
#: Every dashboard carries this tag; the dashboards link to each other through it.
TAG = "mfotel"
#: The metric the `$job_name`/`$rank` variables read their values from (always on).
VARIABLE_SOURCE = "mindformers_train_step"

#: Legend of a per-rank series.
RANK = "{{job_name}} rank {{rank}}"
#: Legend of a per-job series.
JOB = "{{job_name}}"

JOB_MATCHER = 'job_name=~"$job_name"'
RANK_MATCHER = 'rank=~"$rank"'


def sel(metric: str, *matchers: str, rank: bool = True) -> str:
    """`metric{job_name=~"$job_name", rank=~"$rank", *matchers}`: the dashboard filter.

    `rank=False` for series that carry no rank label (job-level recording rules).
    """
    parts = [JOB_MATCHER, *([RANK_MATCHER] if rank else []), *matchers]
    return f"{metric}{{{', '.join(parts)}}}"


@dataclass(frozen=True)
class Target:
    """One PromQL query of a panel. `instant` for tables and rankings (current value only);
    in a table, `column` names its value column and `unit` overrides the panel unit there."""

    expr: str
    legend: str = ""
    instant: bool = False
    column: str = ""
    unit: str = ""


@dataclass(frozen=True)
class ValueText:
    """Show `text` (in `color`) instead of the number `value` (stat panels of states)."""

    value: int
    text: str
    color: str


@dataclass(frozen=True)
class Panel:
    """A panel: title, Grafana unit id, queries. `needs` names what must run for it to have
    data beyond the core callback (shown in the panel description)."""

    title: str
    unit: str
    targets: tuple[Target, ...]
    kind: PanelKind = "timeseries"
    description: str = ""
    width: int = 12
    height: int = 8
    min: float | None = None
    max: float | None = None
    decimals: int | None = None
    value_texts: tuple[ValueText, ...] = ()
    needs: str = ""

    def __post_init__(self) -> None:
        if self.kind == "table":
            for target in self.targets:
                if target.unit and not target.column:
                    raise ValueError(f"panel {self.title!r}: a column unit needs a column name")
        if not self.unit:
            raise ValueError(f"panel {self.title!r}: every panel needs a unit")
        if not self.targets:
            raise ValueError(f"panel {self.title!r}: no targets")
        if not 1 <= self.width <= 24:
            raise ValueError(f"panel {self.title!r}: width {self.width} outside 1..24")


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...]


@dataclass(frozen=True)
class Annotation:
    """Marks on every time series panel where `expr` returns a value (Prometheus annotation)."""

    name: str
    expr: str
    color: str
    title: str
    text: str = ""
    tag_keys: str = "job_name,rank"


#: Firing MindFormers* alerts of the selected jobs, as marks on every dashboard.
ALERTS_ANNOTATION = Annotation(
    "MindFormers alerts",
    f'ALERTS{{alertname=~"MindFormers.*", alertstate="firing", {JOB_MATCHER}}}', "purple",
    "{{alertname}}", "{{severity}}: {{job_name}} {{rank}}", tag_keys="alertname,severity")


@dataclass(frozen=True)
class DashboardSpec:
    uid: str
    title: str
    rows: tuple[Row, ...]
    description: str = ""
    annotations: tuple[Annotation, ...] = ()
    tags: tuple[str, ...] = ()
    refresh: str = "30s"
    time_from: str = "now-3h"

    @property
    def filename(self) -> str:
        return f"{self.uid}.json"


# ---- rendering (the only part that touches the SDK) -------------------------------------

def _sdk() -> Any:
    try:
        import grafana_foundation_sdk  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "building dashboards needs grafana-foundation-sdk (Python >= 3.11): "
            "pip install 'mfotel[dev]' or pip install "
            "'grafana-foundation-sdk==1769699379!11.6.0'") from exc
    return grafana_foundation_sdk


def _datasource() -> Any:
    from grafana_foundation_sdk.models.dashboard import DataSourceRef
    return DataSourceRef(type_val="prometheus", uid=DATASOURCE_UID)


def _variables() -> list[Any]:
    from grafana_foundation_sdk.builders.dashboard import DatasourceVariable, QueryVariable
    from grafana_foundation_sdk.models.dashboard import (VariableOption, VariableRefresh,
                                                         VariableSort)
    everything = VariableOption(selected=True, text=["All"], value=["$__all"])
    datasource = (DatasourceVariable("datasource").label("Data source").type("prometheus")
                  .current(VariableOption(selected=True, text="default", value="default")))
    job = (QueryVariable("job_name").label("Job").datasource(_datasource())
           .query(f"label_values({VARIABLE_SOURCE}, job_name)")
           .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(VariableSort.ALPHABETICAL_ASC)
           .multi(True).include_all(True).all_value(".*").current(everything))
    rank = (QueryVariable("rank").label("Rank").datasource(_datasource())
            .query(f"label_values({VARIABLE_SOURCE}{{{JOB_MATCHER}}}, rank)")
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(VariableSort.NUMERICAL_ASC)
            .multi(True).include_all(True).all_value(".*").current(everything))
    return [datasource, job, rank]


def _query(target: Target, ref_id: str) -> Any:
    from grafana_foundation_sdk.builders.prometheus import Dataquery
    query = (Dataquery().expr(target.expr).legend_format(target.legend or "__auto")
             .ref_id(ref_id).datasource(_datasource()))
    if target.instant:
        from grafana_foundation_sdk.models.prometheus import PromQueryFormat
        query = query.instant().format(PromQueryFormat.TABLE)
    else:
        query = query.range()
    return query


def _mappings(panel: Panel) -> list[Any]:
    from grafana_foundation_sdk.models.dashboard import ValueMap, ValueMappingResult
    if not panel.value_texts:
        return []
    return [ValueMap(options={str(v.value): ValueMappingResult(text=v.text, color=v.color,
                                                                 index=i)
                              for i, v in enumerate(panel.value_texts)})]


def _ref(index: int) -> str:
    return chr(ord("A") + index)


def _panel(panel: Panel, panel_id: int) -> Any:
    from grafana_foundation_sdk.builders import bargauge, common as common_b, stat, table
    from grafana_foundation_sdk.builders import timeseries
    from grafana_foundation_sdk.models import common as common_m

    builder: Any
    if panel.kind == "timeseries":
        builder = (timeseries.Panel()
                   .legend(common_b.VizLegendOptions()
                           .display_mode(common_m.LegendDisplayMode.TABLE)
                           .placement(common_m.LegendPlacement.BOTTOM)
                           .show_legend(True).calcs(["lastNotNull", "max"])
                           .sort_by("Last *").sort_desc(True))
                   .tooltip(common_b.VizTooltipOptions().mode(common_m.TooltipDisplayMode.MULTI)
                            .sort(common_m.SortOrder.DESCENDING))
                   .fill_opacity(10).show_points(common_m.VisibilityMode.NEVER)
                   .span_nulls(False))
    elif panel.kind == "stat":
        builder = (stat.Panel()
                   .reduce_options(common_b.ReduceDataOptions().calcs(["lastNotNull"]))
                   .graph_mode(common_m.BigValueGraphMode.AREA)
                   .color_mode(common_m.BigValueColorMode.VALUE)
                   .text_mode(common_m.BigValueTextMode.AUTO))
    elif panel.kind == "bargauge":
        builder = (bargauge.Panel()
                   .reduce_options(common_b.ReduceDataOptions().calcs(["lastNotNull"]))
                   .orientation(common_m.VizOrientation.HORIZONTAL)
                   .display_mode(common_m.BarGaugeDisplayMode.BASIC))
    elif panel.kind == "table":
        # One row per series: instant queries merged on their labels; the value columns
        # ("Value #A", ...) renamed after their targets, with their own units.
        from grafana_foundation_sdk.models.dashboard import (DataTransformerConfig,
                                                             DynamicConfigValue)
        columns = {f"Value #{_ref(i)}": t.column for i, t in enumerate(panel.targets)
                   if t.column}
        builder = (table.Panel()
                   .with_transformation(DataTransformerConfig(id_val="merge", options={}))
                   .with_transformation(DataTransformerConfig(
                       id_val="organize",
                       options={"excludeByName": {"Time": True}, "renameByName": columns})))
        for target in panel.targets:
            if target.unit:
                builder = builder.override_by_name(
                    target.column, [DynamicConfigValue(id_val="unit", value=target.unit)])
    else:  # pragma: no cover - PanelKind is closed
        raise ValueError(f"unknown panel kind {panel.kind!r}")

    description = panel.description
    if panel.needs:
        description = f"{description} Needs {panel.needs}.".strip()
    builder = (builder.id(panel_id).title(panel.title).description(description)
               .datasource(_datasource()).unit(panel.unit))
    for attr in ("min", "max", "decimals"):
        value = getattr(panel, attr)
        if value is not None:
            builder = getattr(builder, attr)(value)
    if panel.value_texts:
        builder = builder.mappings(_mappings(panel))
    for index, target in enumerate(panel.targets):
        builder = builder.with_target(_query(target, _ref(index)))
    return builder


def _annotation(annotation: Annotation) -> tuple[Any, dict[str, Any]]:
    from grafana_foundation_sdk.builders.dashboard import AnnotationQuery
    builder = (AnnotationQuery().name(annotation.name).datasource(_datasource())
               .enable(True).hide(False).icon_color(annotation.color).expr(annotation.expr))
    # Prometheus-specific annotation fields the SDK's generic model does not carry.
    extra = {"titleFormat": annotation.title, "textFormat": annotation.text,
             "tagKeys": annotation.tag_keys, "step": "15s", "useValueForTime": False}
    return builder, extra


def layout(spec: DashboardSpec) -> list[tuple[int, list[tuple[int, int]]]]:
    """Grid positions: per row its y and the (x, y) of its panels, left to right, wrapping
    at Grafana's 24 columns; a line is as tall as its tallest panel."""
    placed = []
    y = 0
    for row in spec.rows:
        row_y, y = y, y + 1
        x, line_height, positions = 0, 0, []
        for panel in row.panels:
            if x + panel.width > 24:
                x, y, line_height = 0, y + line_height, 0
            positions.append((x, y))
            x += panel.width
            line_height = max(line_height, panel.height)
        y += line_height
        placed.append((row_y, positions))
    return placed


def to_dict(spec: DashboardSpec) -> dict[str, Any]:
    """The dashboard as a JSON-ready dict: grid laid out, ids numbered, variables added."""
    _sdk()
    from grafana_foundation_sdk.builders.dashboard import Dashboard, DashboardLink
    from grafana_foundation_sdk.builders.dashboard import Row as SdkRow
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import (DashboardCursorSync, DashboardLinkType,
                                                         GridPos)

    builder = (Dashboard(spec.title).uid(spec.uid).description(spec.description)
               .tags(sorted({TAG, *spec.tags})).editable().timezone("browser")
               .refresh(spec.refresh).time(spec.time_from, "now")
               .tooltip(DashboardCursorSync.CROSSHAIR)
               .link(DashboardLink("MindFormers dashboards").type(DashboardLinkType.DASHBOARDS)
                     .tags([TAG]).as_dropdown(True).include_vars(True).keep_time(True)))
    for variable in _variables():
        builder = builder.with_variable(variable)
    extras = []
    for annotation in spec.annotations:
        sdk_annotation, extra = _annotation(annotation)
        builder = builder.annotation(sdk_annotation)
        extras.append(extra)

    next_id = 1
    for row, (row_y, positions) in zip(spec.rows, layout(spec)):
        builder = builder.with_row(SdkRow(row.title).id(next_id)
                                   .grid_pos(GridPos(h=1, w=24, x=0, y=row_y)))
        next_id += 1
        for panel, (x, y) in zip(row.panels, positions):
            builder = builder.with_panel(
                _panel(panel, next_id).grid_pos(GridPos(h=panel.height, w=panel.width, x=x, y=y)))
            next_id += 1

    encoded = json.loads(JSONEncoder(sort_keys=True).encode(builder.build()))
    # `id` is per Grafana instance: null lets provisioning/import assign one.
    encoded["id"] = None
    for entry, extra in zip(encoded.get("annotations", {}).get("list", []), extras):
        entry.update(extra)
    check(encoded)
    return encoded


def check(dashboard: dict[str, Any]) -> None:
    """Invariants every generated dashboard holds; raises AssertionError naming the panel."""
    ids = [panel["id"] for panel in dashboard["panels"]]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    assert not duplicates, f"{dashboard['uid']}: duplicate panel ids {duplicates}"
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        where = f"{dashboard['uid']} / {panel['title']}"
        assert panel.get("fieldConfig", {}).get("defaults", {}).get("unit"), f"{where}: no unit"
        assert panel["datasource"] == {"type": "prometheus", "uid": DATASOURCE_UID}, where
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, f"{where}: off the grid {grid}"


def render(spec: DashboardSpec) -> str:
    """The dashboard JSON text, stable across runs (sorted keys, two-space indent)."""
    return json.dumps(to_dict(spec), indent=2, sort_keys=True) + "\n"
