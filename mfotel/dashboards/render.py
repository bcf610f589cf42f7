"""Grafana JSON from the declarative definitions (the only module that touches the SDK).

`to_dict()` lays out the grid, numbers the panels, adds the `$datasource`, `$job_name`,
`$run_id` and `$rank` variables, the table legends, the drawing of each target's role (red
NaN/Inf bars, the step in the tooltip), and cuts run-scoped queries to the selected run;
grafana-foundation-sdk renders the current schema.

    json_text = render(DashboardSpec(uid="mfotel-x", title="X", rows=(...)))
"""
from __future__ import annotations

import json
from typing import Any

from .common import (
    JOB_MATCHER,
    RUN_SOURCE,
    TAG,
    VARIABLE_SOURCE,
    Annotation,
    DashboardSpec,
    Panel,
    Target,
    ValueText,
    in_run,
)

#: Grafana's variable syntax as it appears in the JSON.
DATASOURCE_UID = "${datasource}"

#: Field overrides per target role: NaN/Inf steps as red bars filling the panel's height on an
#: axis of their own; the step hidden from the plot and the legend, shown in the tooltip.
_ROLE_OVERRIDES: dict[str, dict[str, Any]] = {
    "nonfinite": {
        "color": {"mode": "fixed", "fixedColor": "red"},
        "custom.drawStyle": "bars", "custom.fillOpacity": 60, "custom.lineWidth": 0,
        "custom.axisPlacement": "hidden", "custom.scaleDistribution": {"type": "linear"},
        "min": 0, "unit": "none", "decimals": 0},
    "step": {
        "custom.hideFrom": {"legend": True, "tooltip": False, "viz": True},
        "custom.axisPlacement": "hidden", "custom.scaleDistribution": {"type": "linear"},
        "min": 0, "unit": "none", "decimals": 0},
}


def _sdk() -> Any:
    try:
        import grafana_foundation_sdk
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
    from grafana_foundation_sdk.models.dashboard import (
        VariableOption,
        VariableRefresh,
        VariableSort,
    )
    everything = VariableOption(selected=True, text=["All"], value=["$__all"])

    def listing(name: str, label: str, query: str, sort: VariableSort) -> Any:
        return (QueryVariable(name).label(label).datasource(_datasource()).query(query)
                .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(sort)
                .multi(True).include_all(True).all_value(".*").current(everything))
    datasource = (DatasourceVariable("datasource").label("Data source").type("prometheus")
                  .current(VariableOption(selected=True, text="default", value="default")))
    return [datasource,
            listing("job_name", "Job", f"label_values({VARIABLE_SOURCE}, job_name)",
                    VariableSort.ALPHABETICAL_ASC),
            # runs with `run` configured; All also matches series of runs without an id
            listing("run_id", "Run", f"label_values({RUN_SOURCE}{{{JOB_MATCHER}}}, run_id)",
                    VariableSort.ALPHABETICAL_ASC),
            listing("rank", "Rank", f"label_values({VARIABLE_SOURCE}{{{JOB_MATCHER}}}, rank)",
                    VariableSort.NUMERICAL_ASC)]


def _query(target: Target, ref_id: str) -> Any:
    from grafana_foundation_sdk.builders.prometheus import Dataquery
    expr = in_run(target.expr) if target.run_scoped else target.expr
    query = (Dataquery().expr(expr).legend_format(target.legend or "__auto")
             .ref_id(ref_id).datasource(_datasource()))
    if target.instant:
        from grafana_foundation_sdk.models.prometheus import PromQueryFormat
        query = query.instant().format(PromQueryFormat.TABLE)
    else:
        query = query.range()
    return query


def _mappings(texts: tuple[ValueText, ...]) -> list[dict[str, Any]]:
    if not texts:
        return []
    return [{"type": "value", "options": {str(v.value): {"text": v.text, "color": v.color,
                                                         "index": i}
                                          for i, v in enumerate(texts)}}]


def _properties(values: dict[str, Any]) -> list[Any]:
    from grafana_foundation_sdk.models.dashboard import DynamicConfigValue
    return [DynamicConfigValue(id_val=key, value=value) for key, value in values.items()]


def _ref(index: int) -> str:
    return chr(ord("A") + index)


def _builder(panel: Panel) -> Any:
    """The SDK builder of the panel's kind, with its kind-specific options."""
    from grafana_foundation_sdk.builders import bargauge, stat, statetimeline, table, timeseries
    from grafana_foundation_sdk.builders import common as common_b
    from grafana_foundation_sdk.models import common as common_m

    legend = (common_b.VizLegendOptions().display_mode(common_m.LegendDisplayMode.TABLE)
              .placement(common_m.LegendPlacement.BOTTOM).show_legend(True)
              .calcs(["lastNotNull", "max"]).sort_by("Last *").sort_desc(True))
    if panel.kind == "timeseries":
        builder = (timeseries.Panel().legend(legend)
                   .tooltip(common_b.VizTooltipOptions().mode(common_m.TooltipDisplayMode.MULTI)
                            .sort(common_m.SortOrder.DESCENDING))
                   .fill_opacity(10).show_points(common_m.VisibilityMode.NEVER)
                   .span_nulls(False))
        if panel.draw == "bars":
            builder = (builder.draw_style(common_m.GraphDrawStyle.BARS).fill_opacity(80)
                       .line_width(1).bar_alignment(common_m.BarAlignment.BEFORE))
        if panel.stacked:
            builder = builder.stacking(common_b.StackingConfig().mode(
                common_m.StackingMode.NORMAL))
            if panel.draw == "line":
                builder = builder.fill_opacity(60)
        for name, color in panel.colors:
            builder = builder.override_by_name(
                name, _properties({"color": {"mode": "fixed", "fixedColor": color}}))
        if panel.log_scale:
            builder = builder.scale_distribution(
                common_b.ScaleDistributionConfig().type(common_m.ScaleDistribution.LOG).log(10))
        for index, target in enumerate(panel.targets):
            if target.role in _ROLE_OVERRIDES:
                builder = builder.override_by_query(
                    _ref(index), _properties(_ROLE_OVERRIDES[target.role]))
        return builder
    if panel.kind == "state-timeline":
        return (statetimeline.Panel().show_value(common_m.VisibilityMode.AUTO)
                .merge_values(True).row_height(0.8).fill_opacity(80).line_width(0)
                .legend(common_b.VizLegendOptions().show_legend(True)
                        .display_mode(common_m.LegendDisplayMode.LIST)
                        .placement(common_m.LegendPlacement.BOTTOM))
                .tooltip(common_b.VizTooltipOptions().mode(common_m.TooltipDisplayMode.MULTI)
                         .sort(common_m.SortOrder.NONE)))
    if panel.kind == "stat":
        return (stat.Panel()
                .reduce_options(common_b.ReduceDataOptions().calcs(["lastNotNull"]))
                .graph_mode(common_m.BigValueGraphMode.AREA)
                .color_mode(common_m.BigValueColorMode.VALUE)
                .text_mode(common_m.BigValueTextMode.AUTO))
    if panel.kind == "bargauge":
        return (bargauge.Panel()
                .reduce_options(common_b.ReduceDataOptions().calcs(["lastNotNull"]))
                .orientation(common_m.VizOrientation.HORIZONTAL)
                .display_mode(common_m.BarGaugeDisplayMode.BASIC))
    if panel.kind == "table":
        # One row per series: instant queries merged on their labels; the value columns
        # ("Value #A", ...) renamed after their targets, with their own units and states.
        from grafana_foundation_sdk.models.dashboard import DataTransformerConfig
        columns = {f"Value #{_ref(i)}": t.column for i, t in enumerate(panel.targets)
                   if t.column}
        builder = (table.Panel()
                   .with_transformation(DataTransformerConfig(id_val="merge", options={}))
                   .with_transformation(DataTransformerConfig(
                       id_val="organize",
                       options={"excludeByName": {"Time": True}, "renameByName": columns})))
        for target in panel.targets:
            column: dict[str, Any] = {"unit": target.unit} if target.unit else {}
            if target.value_texts:
                column.update({"mappings": _mappings(target.value_texts),
                               "custom.cellOptions": {"type": "color-background"}})
            if column:
                builder = builder.override_by_name(target.column, _properties(column))
        return builder
    raise ValueError(f"unknown panel kind {panel.kind!r}")  # pragma: no cover - closed Literal


def _panel(panel: Panel, panel_id: int) -> Any:
    from grafana_foundation_sdk.builders.dashboard import ThresholdsConfig
    from grafana_foundation_sdk.models.dashboard import Threshold, ThresholdsMode

    description = panel.description
    if panel.needs:
        description = f"{description} Needs {panel.needs}.".strip()
    builder = (_builder(panel).id(panel_id).title(panel.title).description(description)
               .datasource(_datasource()).unit(panel.unit))
    for attr in ("min", "max", "decimals"):
        value = getattr(panel, attr)
        if value is not None:
            builder = getattr(builder, attr)(value)
    if panel.value_texts:
        builder = builder.mappings(_mappings(panel.value_texts))
    if panel.min_interval:
        builder = builder.interval(panel.min_interval)
    if panel.thresholds:
        builder = builder.thresholds(ThresholdsConfig().mode(ThresholdsMode.ABSOLUTE).steps(
            [Threshold(value=value, color=color) for value, color in panel.thresholds]))
    for index, target in enumerate(panel.targets):
        builder = builder.with_target(_query(target, _ref(index)))
    return builder


def _annotation(annotation: Annotation) -> tuple[Any, dict[str, Any]]:
    from grafana_foundation_sdk.builders.dashboard import AnnotationQuery
    builder = (AnnotationQuery().name(annotation.name).datasource(_datasource())
               .enable(True).hide(False).icon_color(annotation.color).expr(annotation.expr))
    # Prometheus-specific annotation fields the SDK's generic model does not carry.
    extra = {"titleFormat": annotation.title, "textFormat": annotation.text,
             "tagKeys": annotation.tag_keys, "step": "15s",
             "useValueForTime": annotation.value_is_time}
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
    from grafana_foundation_sdk.models.dashboard import (
        DashboardCursorSync,
        DashboardLinkType,
        GridPos,
    )

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
    for row, (row_y, positions) in zip(spec.rows, layout(spec), strict=True):
        builder = builder.with_row(SdkRow(row.title).id(next_id)
                                   .grid_pos(GridPos(h=1, w=24, x=0, y=row_y)))
        next_id += 1
        for panel, (x, y) in zip(row.panels, positions, strict=True):
            builder = builder.with_panel(
                _panel(panel, next_id).grid_pos(GridPos(h=panel.height, w=panel.width, x=x, y=y)))
            next_id += 1

    encoded = json.loads(JSONEncoder(sort_keys=True).encode(builder.build()))
    # `id` is per Grafana instance: null lets provisioning/import assign one.
    encoded["id"] = None
    for entry, extra in zip(encoded.get("annotations", {}).get("list", []), extras, strict=True):
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
