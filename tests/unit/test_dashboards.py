"""Dashboards as code, checked without Grafana: generation, structure and queries (promtool).

No Grafana server runs here. tests/e2e/test_dashboards_e2e.py parses every query in a real
(empty) Prometheus and runs them against a Prometheus fed by a real training run;
tests/unit/test_compose.py checks the compose stack and Grafana's provisioning.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from mfotel import contract
from mfotel.contract import CONTRACT
from mfotel.dashboards.common import MAX_RANK_LINES, RUN_MATCHER
from mfotel.dashboards.queries import ALL, PanelQuery, dashboard_queries, metric_names, substitute
from tests.support.paths import ROOT
from tests.support.promtool import TIMEOUT, promtool_env

DASHBOARD_DIR = ROOT / "grafana" / "dashboards"
RULES_DIR = ROOT / "prometheus" / "rules"

#: Recording rules the dashboards may use (prometheus/rules/mindformers-recording.yml).
RECORDING_RULES = frozenset({
    "job_name:mindformers_train_samples:rate1m",
    "job_name:mindformers_train_tokens:rate1m",
    "job_name_rank:mindformers_train_step_duration_seconds:mean1m",
    "job_name:mindformers_train_step_duration_seconds:quantile1m",
    "job_name:mindformers_train_step_duration_seconds:rank_median1m",
    "job_name:mindformers_train_step_duration_seconds:rank_spread1m",
    "job_name:mindformers_train_ranks_running:count",
    "job_name_rank:mindformers_train_step_outside:ratio1m",
    "job_name_rank:mindformers_train_waited_for:ratio1m",
    "job_name_rank:mindformers_train_in_step:bool",
    "job_name:mindformers_train_first_nonfinite_step:min",
    "job_name_status:mindformers_train_ranks:count",
    "job_name:mindformers_train_progress_ratio:min",
    "job_name:mindformers_train_rank_info:slowest1m",
    "job_name_rank:mindformers_train_step_duration_seconds:quantile1m",
    # goodput across restarts (mfotel/alerting/goodput.py)
    "job_name_run_id_category:mindformers_train_time_seconds:increase1m",
    "job_name_run_id_category:mindformers_train_time_seconds:total",
    "job_name_run_id:mindformers_train_wall_seconds:total",
    "job_name_run_id_category:mindformers_train_time:ratio_total",
    "job_name_run_id_category:mindformers_train_time:ratio1h",
    "job_name_run_id:mindformers_train_recomputed_steps:total",
    "job_name_run_id:mindformers_train_attempts:increase1m",
    "job_name_run_id:mindformers_train_attempt_start_timestamp_seconds:min",
    "job_name_run_id:mindformers_train_restarts_without_progress:increase1m",
})
#: mindformers-native metrics bridged by mfotel when native monitoring is on.
NATIVE_METRICS = frozenset({
    "mindformers_train_weight_norm",
    "mindformers_train_optimizer_state_norm",
    "mindformers_train_local_norm",
    "mindformers_train_local_loss",
    "mindformers_train_device_local_loss",
    "mindformers_train_throughput_linearity",
})
#: Series of Prometheus itself.
PROMETHEUS_SERIES = frozenset({"up", "ALERTS"})
#: Device exporters the cluster dashboard joins through mindformers_train_rank_info
#: (MindCluster NPU-Exporter, NVIDIA dcgm-exporter); listed one by one, not by prefix.
HARDWARE_EXPORTER_METRICS = frozenset({
    "npu_chip_info_utilization",
    "DCGM_FI_DEV_GPU_UTIL",
})


def contract_series() -> set[str]:
    """Every sample name the metric contract exposes."""
    names: set[str] = set()
    for spec in CONTRACT:
        if spec.kind == "histogram":
            names |= {f"{spec.prometheus_name}_{s}" for s in ("bucket", "sum", "count")}
        else:
            names.add(spec.sample_name)
    return names


def load_dashboards() -> dict[str, dict[str, Any]]:
    return {path.name: json.loads(path.read_text())
            for path in sorted(DASHBOARD_DIR.glob("*.json"))}


DASHBOARDS = load_dashboards()
QUERIES: list[PanelQuery] = [q for d in DASHBOARDS.values() for q in dashboard_queries(d)]


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    found = []
    for panel in dashboard["panels"]:
        found.append(panel)
        found.extend(panel.get("panels", []))
    return found


# ---------------------------------------------------------------- generation

def test_checked_in_dashboards_are_what_the_code_generates(tmp_path):
    from mfotel.dashboards import write_dashboards
    written = write_dashboards(tmp_path)
    assert sorted(p.name for p in written) == sorted(DASHBOARDS), \
        "grafana/dashboards/ holds other files than the generator writes"
    stale = [p.name for p in written if p.read_text() != (DASHBOARD_DIR / p.name).read_text()]
    assert not stale, (f"stale dashboards {stale}: regenerate with "
                       f"`python -m mfotel.dashboards --out grafana/dashboards`")


def test_generation_is_deterministic():
    from mfotel.dashboards import render_all
    assert render_all() == render_all()


def test_check_mode_reports_a_stale_file(tmp_path, capsys):
    from mfotel.dashboards.build import main
    assert main(["--out", str(tmp_path)]) == 0
    assert main(["--check", "--out", str(tmp_path)]) == 0
    victim = next(tmp_path.glob("*.json"))
    victim.write_text(victim.read_text().replace("MindFormers", "Mindformers"))
    assert main(["--check", "--out", str(tmp_path)]) == 1
    assert victim.name in capsys.readouterr().err


def test_three_dashboards_exist():
    assert {d["uid"] for d in DASHBOARDS.values()} == {
        "mfotel-training-overview", "mfotel-cluster-health", "mfotel-parameter-health"}


def test_a_panel_without_a_unit_is_rejected_at_definition():
    from mfotel.dashboards.common import Panel, Target
    with pytest.raises(ValueError, match="unit"):
        Panel("Loss", "", (Target("mindformers_train_loss"),))


def test_layout_wraps_rows_at_24_columns():
    from mfotel.dashboards.common import DashboardSpec, Panel, Row, Target
    from mfotel.dashboards.render import layout
    wide = Panel("a", "s", (Target("up"),), width=16, height=4)
    spec = DashboardSpec("u", "t", (Row("r1", (wide, wide)), Row("r2", (wide,))))
    assert layout(spec) == [(0, [(0, 1), (0, 5)]), (9, [(0, 10)])]


# ---------------------------------------------------------------- structure

@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_dashboard_is_portable(name):
    dashboard = DASHBOARDS[name]
    assert "id" in dashboard and dashboard["id"] is None
    assert dashboard["uid"] == name.removesuffix(".json")
    assert "mfotel" in dashboard["tags"]
    assert "${datasource}" in json.dumps(dashboard)
    # no data source uid other than the variable anywhere in the JSON
    uids = _values_of(dashboard, "uid", skip_top=True)
    assert set(uids) == {"${datasource}"}, f"hard-coded data source uids: {set(uids)}"


def _values_of(node: Any, key: str, skip_top: bool = False) -> list[Any]:
    found = []
    if isinstance(node, dict):
        for k, v in node.items():
            if k == key and not skip_top:
                found.append(v)
            found.extend(_values_of(v, key))
    elif isinstance(node, list):
        for item in node:
            found.extend(_values_of(item, key))
    return found


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_dashboard_has_datasource_job_run_and_rank_variables(name):
    variables = {v["name"]: v for v in DASHBOARDS[name]["templating"]["list"]}
    assert list(variables) == ["datasource", "job_name", "run_id", "rank"]
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["run_id"]["query"].startswith("label_values(mindformers_train_rank_info")
    for var in ("job_name", "run_id", "rank"):
        v = variables[var]
        assert v["type"] == "query" and v["multi"] and v["includeAll"], var
        assert v["allValue"] == ".*", var
        assert v["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert v["query"].startswith("label_values("), var
        assert v["query"].rstrip(")").endswith(var), var


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_every_panel_has_a_unit_a_datasource_and_a_unique_id(name):
    dashboard = DASHBOARDS[name]
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids)), f"duplicate panel ids in {name}"
    assert all(isinstance(i, int) and i > 0 for i in ids)
    for panel in panels(dashboard):
        if panel["type"] == "row":
            continue
        where = f"{name} / {panel['title']}"
        assert panel["fieldConfig"]["defaults"].get("unit"), f"{where}: no unit"
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where
        assert panel["targets"], f"{where}: no query"
        for target in panel["targets"]:
            assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, f"{where}: off the grid"


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_panels_do_not_overlap(name):
    cells: dict[tuple[int, int], str] = {}
    for panel in panels(DASHBOARDS[name]):
        g = panel["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_time_series_legends_are_tables_with_last_and_max(name):
    series = [p for p in panels(DASHBOARDS[name]) if p["type"] == "timeseries"]
    assert series
    for panel in series:
        legend = panel["options"]["legend"]
        assert legend["displayMode"] == "table", panel["title"]
        assert legend["showLegend"] is True, panel["title"]
        assert {"lastNotNull", "max"} <= set(legend["calcs"]), panel["title"]


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_annotations_read_the_datasource_variable(name):
    for annotation in DASHBOARDS[name]["annotations"]["list"]:
        assert annotation["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert annotation["expr"] and annotation["titleFormat"], annotation["name"]


def test_overview_covers_the_issue_list():
    titles = {p["title"] for p in panels(DASHBOARDS["mfotel-training-overview.json"])}
    assert {"Loss", "Learning rate", "Gradient norm", "Samples per second",
            "Step time quantiles", "Progress", "ETA", "Non-finite steps"} <= titles
    names = {a["name"] for a in DASHBOARDS["mfotel-training-overview.json"]["annotations"]["list"]}
    assert {"First non-finite loss", "Loss-scale overflow", "MindFormers alerts"} <= names


def panel(dashboard: str, title: str) -> dict[str, Any]:
    (found,) = [p for p in panels(DASHBOARDS[f"{dashboard}.json"]) if p["title"] == title]
    return found


def overrides(panel_: dict[str, Any], ref_id: str) -> dict[str, Any]:
    """The override properties of the series of query `ref_id`, as {property id: value}."""
    return {prop["id"]: prop["value"] for o in panel_["fieldConfig"]["overrides"]
            if o["matcher"] == {"id": "byFrameRefID", "options": ref_id}
            for prop in o["properties"]}


# Grafana gives a panel without thresholds green, and red from 80: a global step of 81 in red.
GRAFANA_DEFAULT_THRESHOLDS = [{"color": "green", "value": None}, {"color": "red", "value": 80}]


def test_a_stat_panel_without_thresholds_is_rejected_at_definition():
    from mfotel.dashboards.common import Panel, Target
    with pytest.raises(ValueError, match="thresholds"):
        Panel("Step", "none", (Target("up"),), kind="stat")
    with pytest.raises(ValueError, match="thresholds"):
        Panel("Step", "none", (Target("up"),), kind="stat", thresholds=((0, "red"),))


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_every_stat_panel_has_its_own_thresholds(name):
    for stat in (p for p in panels(DASHBOARDS[name]) if p["type"] == "stat"):
        steps = stat["fieldConfig"]["defaults"].get("thresholds", {}).get("steps")
        assert steps and steps[0]["value"] is None, stat["title"]
        assert steps != GRAFANA_DEFAULT_THRESHOLDS, stat["title"]


@pytest.mark.parametrize("title, flag", [("Loss", "mindformers_train_loss_finite"),
                                         ("Gradient norm", 'metric="grad_norm"')])
def test_loss_and_grad_norm_draw_nonfinite_steps_as_red_bars_and_stop_their_line(title, flag):
    loss = panel("mfotel-training-overview", title)
    bars = [q for q in loss["targets"] if overrides(loss, q["refId"]).get("custom.drawStyle")
            == "bars"]
    assert len(bars) == 2, "one bar series per rank (few ranks), one count per job (many)"
    for bar in bars:
        props = overrides(loss, bar["refId"])
        assert props["color"] == {"mode": "fixed", "fixedColor": "red"}
        assert props["custom.axisPlacement"] == "hidden" and props["min"] == 0
        assert flag in bar["expr"] and "NaN/Inf" in bar["legendFormat"]
    lines = [q for q in loss["targets"] if not overrides(loss, q["refId"])]
    assert lines and all("unless on (job_name, rank) (" in q["expr"] and flag in q["expr"]
                         for q in lines), "the line must stop where the value is not finite"
    assert loss["fieldConfig"]["defaults"]["custom"]["scaleDistribution"] == \
        {"type": "log", "log": 10}


@pytest.mark.parametrize("title", ["Loss", "Learning rate", "Gradient norm"])
def test_the_step_shows_in_the_tooltip_of_step_based_panels(title):
    found = panel("mfotel-training-overview", title)
    steps = [q for q in found["targets"] if "custom.hideFrom" in overrides(found, q["refId"])]
    assert len(steps) == 1 and "mindformers_train_step{" in steps[0]["expr"]
    props = overrides(found, steps[0]["refId"])
    assert props["custom.hideFrom"] == {"viz": True, "legend": True, "tooltip": False}
    # its own scale: the loss axis is not stretched
    assert props["custom.axisPlacement"] == "hidden"


@pytest.mark.parametrize("dashboard, title", [("mfotel-training-overview", "Status"),
                                              ("mfotel-cluster-health", "Status per rank")])
def test_status_is_a_state_timeline_naming_every_status(dashboard, title):
    status = panel(dashboard, title)
    assert status["type"] == "state-timeline"
    (mapping,) = status["fieldConfig"]["defaults"]["mappings"]
    statuses = {contract.STATUS_INITIALISING: "initialising", contract.STATUS_RUNNING: "running",
                contract.STATUS_COMPLETED: "completed", contract.STATUS_FAILED: "failed / stopped",
                contract.STATUS_CANCELLED: "cancelled"}
    assert {int(k): v["text"] for k, v in mapping["options"].items()} == statuses
    assert mapping["options"][str(contract.STATUS_FAILED)]["color"] == "red"


def test_the_worst_status_of_a_job_is_failed_even_beside_a_cancelled_rank(tmp_path):
    """promtool evaluates the status panel's query: failed (3) must win over cancelled (4)."""
    import subprocess

    from mfotel.dashboards.common import worst_status
    expr = worst_status('mindformers_train_status{job_name="j"}')
    tests = {"rule_files": [], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [
            {"series": 'mindformers_train_status{job_name="j",rank="0"}', "values": "3"},
            {"series": 'mindformers_train_status{job_name="j",rank="1"}', "values": "4"},
            {"series": 'mindformers_train_status{job_name="k",rank="0"}', "values": "2"},
            {"series": 'mindformers_train_status{job_name="k",rank="1"}', "values": "4"}],
        "promql_expr_test": [
            {"expr": expr, "eval_time": "0m", "exp_samples": [
                {"labels": '{job_name="j"}', "value": contract.STATUS_FAILED}]},
            {"expr": worst_status('mindformers_train_status{job_name="k"}'), "eval_time": "0m",
             "exp_samples": [{"labels": '{job_name="k"}', "value": contract.STATUS_CANCELLED}]},
        ]}]}
    path = tmp_path / "worst.yml"
    path.write_text(yaml.safe_dump(tests))
    done = subprocess.run(["promtool", "test", "rules", str(path)], capture_output=True,
                          text=True, timeout=TIMEOUT, env=promtool_env())
    assert done.returncode == 0, done.stdout + done.stderr


def test_ranks_now_has_a_loss_finite_column_red_when_not_finite():
    table = panel("mfotel-training-overview", "Ranks now")
    renamed = table["transformations"][1]["options"]["renameByName"]
    assert {"loss", "loss finite", "status"} <= set(renamed.values())
    (column,) = [o for o in table["fieldConfig"]["overrides"]
                 if o["matcher"] == {"id": "byName", "options": "loss finite"}]
    props = {p["id"]: p["value"] for p in column["properties"]}
    assert props["custom.cellOptions"] == {"type": "color-background"}
    assert props["mappings"][0]["options"]["0"] == {"text": "NaN / Inf", "color": "red",
                                                    "index": 0}
    loss = next(q for q in table["targets"]
                if renamed[f"Value #{q['refId']}"] == "loss")
    assert "unless on (job_name, rank) (" in loss["expr"], "a NaN rank shows no stale loss"


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_per_rank_series_give_way_to_a_spread_over_many_ranks(name):
    """Readable at 1000 ranks: a time series with a line per rank has it only while at most
    MAX_RANK_LINES ranks are selected, and a sibling query over the ranks beyond that (or it
    names a bounded number of ranks: topk/bottomk, or the recorded slowest rank of a job)."""
    few, many = f"<= {MAX_RANK_LINES})", f"> {MAX_RANK_LINES})"
    for found in panels(DASHBOARDS[name]):
        if found["type"] not in ("timeseries", "state-timeline"):
            continue
        for query in found["targets"]:
            if "{{rank}}" in query["legendFormat"]:
                assert few in query["expr"] or re.search(
                    r"\b(topk|bottomk)\b|:slowest1m\b", query["expr"]), \
                    f"{found['title']}: {query['legendFormat']}"
        if any(few in q["expr"] for q in found["targets"]):
            assert any(many in q["expr"] for q in found["targets"]), found["title"]


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_every_panel_query_is_cut_to_the_selected_run(name):
    run_filter = f'and on (job_name) max by (job_name) (mindformers_train_rank_info{{' \
                 f'job_name=~"$job_name", {RUN_MATCHER}}})'
    for found in panels(DASHBOARDS[name]):
        for query in found.get("targets", []):
            assert query["expr"].endswith(run_filter) or RUN_MATCHER in query["expr"], \
                f"{found['title']}: {query['expr']}"


# ---------------------------------------------------------------- queries

def test_every_metric_a_query_names_is_in_the_contract_or_the_rules():
    known = (contract_series() | RECORDING_RULES | NATIVE_METRICS | PROMETHEUS_SERIES
             | HARDWARE_EXPORTER_METRICS)
    unknown = {f"{q.where}: {name}" for q in QUERIES for name in metric_names(q.expr)
               if name not in known}
    assert not unknown, "queries name series nobody exposes:\n" + "\n".join(sorted(unknown))


def test_metric_name_lexer_on_tricky_expressions():
    expr = ('sum by (job_name) (rate(a_total{x="b{c}", y=~"$rank"}[5m] offset 1h)) '
            '/ on (job_name) group_left () topk(3, b) > bool 1e3 unless c')
    assert metric_names(expr) == {"a_total", "b", "c"}
    assert metric_names('histogram_quantile(0.9, sum(rate(h_bucket[1m])) by (le))') == {"h_bucket"}


def test_panels_on_native_metrics_say_what_they_need():
    for query in QUERIES:
        if query.origin == "panel" and metric_names(query.expr) & NATIVE_METRICS:
            assert "Needs mindformers native monitoring" in query.description, query.where


def test_panels_on_device_exporter_metrics_say_what_they_need():
    used = set()
    for query in QUERIES:
        names = metric_names(query.expr) & HARDWARE_EXPORTER_METRICS
        if query.origin == "panel" and names:
            assert "Needs MindCluster NPU-Exporter or dcgm-exporter" in query.description, \
                query.where
            used |= names
    assert used == HARDWARE_EXPORTER_METRICS, "stale HARDWARE_EXPORTER_METRICS entries"


def test_slowest_rank_device_panel_joins_each_exporter_to_the_slowest_rank(tmp_path):
    """promtool on the panel's queries: rank 0 waits for rank 1 (rank 1 spends half its time
    outside its steps, rank 0 next to none), which runs on device 1;
    each target returns that device only, in Kubernetes (NPU-Exporter's pod labels) and on
    bare metal (NPU-Exporter's target host, dcgm-exporter's Hostname), and nothing where its
    join does not apply. Other nodes and pods have a device 1 too."""
    promtool = shutil.which("promtool") or shutil.which("promtool", path="/usr/bin")
    if promtool is None:
        pytest.fail("promtool not found on PATH; install it: apt-get install prometheus")
    [npu_k8s, npu_bare, gpu] = [
        substitute(q.expr, {"job_name": ["llama"], "run_id": ALL, "rank": ALL}) for q in QUERIES
        if q.title == "Device of the slowest rank: utilisation"]

    def series(name: str, labels: str, values: str) -> dict[str, str]:
        return {"series": f"{name}{{{labels}}}", "values": values}

    def rank_info(rank: int, extra: str) -> dict[str, str]:
        return series("mindformers_train_rank_info",
                      f'job_name="llama", rank="{rank}", device_id="{rank}", {extra}', "1x10")

    step_time = [series("mindformers_train_step_outside_seconds_total",
                        f'job_name="llama", rank="{rank}"', f"0+{outside}x10")
                 for rank, outside in ((0, 0.1), (1, 30))]
    kubernetes = step_time + [rank_info(r, 'node="llama-0", pod_name="llama-0", '
                                           'namespace="train"') for r in (0, 1)] + [
        series("npu_chip_info_utilization",
               f'instance="10.0.0.{n}:8082", id="{i}", pod_name="{pod}", namespace="train"',
               f"{value}x10")
        for n, i, pod, value in ((1, 0, "llama-0", 10), (1, 1, "llama-0", 20),
                                 (2, 1, "other-0", 30))]
    bare_metal = step_time + [rank_info(r, 'node="node-1"') for r in (0, 1)] + [
        series("npu_chip_info_utilization", f'instance="node-{n}:8082", id="{i}"', f"{v}x10")
        for n, i, v in ((1, 0, 10), (1, 1, 20), (2, 1, 30))] + [
        series("DCGM_FI_DEV_GPU_UTIL", f'Hostname="node-{n}", gpu="1"', f"{v}x10")
        for n, v in ((1, 90), (2, 70))]

    def case(expr: str, labels: str | None, value: float = 0) -> dict[str, Any]:
        samples = [{"labels": labels, "value": value}] if labels else []
        return {"expr": expr, "eval_time": "5m", "exp_samples": samples}
    slowest = 'job_name="llama", rank="1"'
    spec = {"rule_files": [str(RULES_DIR / "mindformers-recording.yml")],
            "evaluation_interval": "1m", "tests": [
                {"interval": "1m", "input_series": kubernetes, "promql_expr_test": [
                    case(npu_k8s, '{instance="10.0.0.1:8082", id="1", pod_name="llama-0", '
                                  f'namespace="train", {slowest}}}', 20),
                    case(npu_bare, None), case(gpu, None)]},
                {"interval": "1m", "input_series": bare_metal, "promql_expr_test": [
                    case(npu_k8s, None),
                    case(npu_bare, f'{{instance="node-1:8082", node="node-1", id="1", {slowest}}}',
                         20),
                    case(gpu, f'{{Hostname="node-1", gpu="1", {slowest}}}', 90)]}]}
    path = tmp_path / "join.yml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    result = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True,
                            text=True, timeout=TIMEOUT, env=promtool_env())
    assert result.returncode == 0, result.stdout + result.stderr


def _promtool_case(tmp_path: Path, input_series: list[dict[str, str]],
                   cases: list[tuple[str, list[tuple[str, float]]]], at: str = "5m") -> None:
    """promtool test rules: each (expr, [(labels, value)]) evaluated at `at` on the series."""
    promtool = shutil.which("promtool") or shutil.which("promtool", path="/usr/bin")
    if promtool is None:
        pytest.fail("promtool not found on PATH; install it: apt-get install prometheus")
    spec = {"rule_files": [], "evaluation_interval": "1m", "tests": [
        {"interval": "1m", "input_series": input_series, "promql_expr_test": [
            {"expr": expr, "eval_time": at,
             "exp_samples": [{"labels": labels, "value": value} for labels, value in samples]}
            for expr, samples in cases]}]}
    path = tmp_path / "case.yml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    result = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True,
                            text=True, timeout=TIMEOUT, env=promtool_env())
    assert result.returncode == 0, result.stdout + result.stderr


def test_scrape_targets_up_counts_the_selected_jobs_targets_only(tmp_path):
    """llama has a rank up and a rank that died 3 minutes ago; an idle port, Prometheus itself
    and another training job are scraped by the same Prometheus but are not llama's."""
    up, down = [substitute(q.expr, {"job_name": ["llama"], "run_id": ALL, "rank": ALL})
                for q in QUERIES if q.title == "Scrape targets up"]

    def series(name: str, labels: str, values: str) -> dict[str, str]:
        return {"series": f"{name}{{{labels}}}", "values": values}
    target = 'job="mindformers", instance="node-1:{}"'
    info = 'job_name="{}", rank="{}", ' + target
    _promtool_case(tmp_path, [
        series("up", target.format(9464), "1x10"),
        series("up", target.format(9465), "1 1 0x8"),
        series("up", target.format(9466), "0x10"),
        series("up", 'job="prometheus", instance="localhost:9090"', "1x10"),
        series("up", 'job="mindformers", instance="node-2:9464"', "1x10"),
        series("mindformers_train_rank_info", info.format("llama", 0, 9464), "1x10"),
        series("mindformers_train_rank_info", info.format("llama", 1, 9465), "1 1 _x8"),
        series("mindformers_train_rank_info",
               'job_name="gpt", rank="0", job="mindformers", instance="node-2:9464"', "1x10"),
    ], [(up, [('{job_name="llama"}', 1)]), (down, [('{job_name="llama"}', 1)])])


def test_recording_rules_used_are_recorded_by_the_rule_files():
    rule_files = sorted(RULES_DIR.glob("*.yml"))
    assert rule_files, "prometheus/rules/ has no rule files: run `mfotel rules`"
    recorded = {rule["record"] for path in rule_files
                for group in yaml.safe_load(path.read_text())["groups"]
                for rule in group["rules"] if "record" in rule}
    used = {name for q in QUERIES for name in metric_names(q.expr) if ":" in name}
    assert used <= recorded, f"not recorded by prometheus/rules: {sorted(used - recorded)}"
    assert used <= RECORDING_RULES


def test_variable_substitution_follows_grafana():
    expr = 'x{job_name=~"$job_name", rank=~"${rank}"}[$__rate_interval]'
    assert substitute(expr, {"job_name": ["a.b", "c"], "rank": ALL}, rate_interval="2m") == \
        'x{job_name=~"(a\\\\.b|c)", rank=~".*"}[2m]'
    assert substitute(expr, {"job_name": ["llama"], "rank": ["3"]}) == \
        'x{job_name=~"llama", rank=~"3"}[1m]'
    with pytest.raises(KeyError):
        substitute("x{a=~\"$nope\"}", {})


# ---------------------------------------------------------------- goodput

def _goodput_queries(title: str, variables: dict[str, Any]) -> dict[str, str]:
    """The queries of an overview panel or annotation by legend (or annotation name),
    substituted."""
    return {q.legend or q.title: substitute(q.expr, variables, range_="47m") for q in QUERIES
            if q.dashboard == "mfotel-training-overview" and q.title == title}


def test_the_goodput_breakdown_stacks_every_category_in_its_colour():
    from mfotel.alerting import goodput
    from mfotel.dashboards.goodput import COLORS
    categories = [*goodput.CATEGORIES, goodput.UNACCOUNTED]
    shares = panel("mfotel-training-overview", "Where the run's time went")
    assert [t["legendFormat"] for t in shares["targets"]] == categories, "goodput at the bottom"
    assert shares["fieldConfig"]["defaults"]["custom"]["stacking"] == {"mode": "normal"}
    colours = {o["matcher"]["options"]: o["properties"][0]["value"]["fixedColor"]
               for o in shares["fieldConfig"]["overrides"]}
    assert colours == dict(COLORS) and colours["goodput"] == "green"
    assert len(set(colours.values())) == len(colours)
    bars = panel("mfotel-training-overview", "Time per minute by category")
    custom = bars["fieldConfig"]["defaults"]["custom"]
    assert (custom["drawStyle"], custom["stacking"]["mode"]) == ("bars", "normal")
    assert bars["interval"] == goodput.INTERVAL, "a bar per evaluation of the records"
    assert [t["legendFormat"] for t in bars["targets"]] == categories[:-1]
    (attempts,) = [a for a in DASHBOARDS["mfotel-training-overview.json"]["annotations"]["list"]
                   if a["name"] == "Attempts"]
    assert attempts["useValueForTime"] is True and goodput.ATTEMPT_START in attempts["expr"]


def test_goodput_panels_show_the_hand_worked_restart(tmp_path):
    """promtool, the shipped rules and the input of the goodput promtool test (a 2-rank run:
    attempt 1 killed at 20m, attempt 2 started at 25m resuming from an older checkpoint,
    completed at 45m; docs/metrics.md's figures): what each goodput panel and annotation of
    the overview shows, for the run and for another run."""
    from mfotel.alerting import goodput as goodput_rules
    cases_file = yaml.safe_load((ROOT / "prometheus" / "tests" / "goodput.yml").read_text())
    (restart,) = [t for t in cases_file["tests"] if "restart that resumes" in t["name"]]
    run = {"job_name": ["llama"], "run_id": ["r1"], "rank": ALL}
    other = {"job_name": ["llama"], "run_id": ["r2"], "rank": ALL}
    wall = 2700.0
    seconds = {"goodput": 957, "recomputed": 423, "startup": 480, "input": 420,
               "checkpoint": 30, "evaluation": 30, "stall": 60, "downtime": 300,
               "unaccounted": 0}
    shares = _goodput_queries("Where the run's time went", run)
    per_minute = _goodput_queries("Time per minute by category", run)
    stat = {title: next(iter(_goodput_queries(title, run).values())) for title in (
        "Goodput, last hour", "Goodput over the run", "Attempts in range", "Recomputed steps",
        "Downtime between attempts", "Run wall clock")}
    over_time = _goodput_queries("Goodput over time", run)
    (attempts,) = _goodput_queries("annotation: Attempts", run).values()
    (no_progress,) = _goodput_queries("annotation: Restart without progress", run).values()
    r1 = '{job_name="llama", run_id="r1"}'

    def recorded(name: str, extra: str = "") -> str:
        return f'{name}{{job_name="llama", run_id="r1"{extra}}}'
    goodput = seconds["goodput"] / wall

    def one(labels: str, value: float) -> list[tuple[str, float]]:
        return [(labels, value)]
    cases: list[tuple[str, str, list[tuple[str, float]]]] = [
        # the run's life: every category's share, adding up to 1
        *(("46m", shares[name], one(f'{{category="{name}"}}', value / wall))
          for name, value in seconds.items()),
        # inside the hang at 41m: its 120 s so far unaccounted, of 2460 s
        ("41m", shares["unaccounted"], one('{category="unaccounted"}', 120 / 2460)),
        ("46m", stat["Goodput over the run"], one(r1, goodput)),
        ("46m", stat["Goodput, last hour"], one(r1, goodput)),
        ("46m", stat["Attempts in range"], one(r1, 2)),
        ("46m", stat["Recomputed steps"], one(recorded(goodput_rules.RECOMPUTED_TOTAL), 95)),
        ("46m", stat["Downtime between attempts"],
         one(recorded(goodput_rules.CATEGORY_TOTAL, ', category="downtime"'), 300)),
        ("46m", stat["Run wall clock"], one(recorded(goodput_rules.WALL), wall)),
        ("46m", over_time["{{job_name}} {{run_id}} since the run's start"], one(r1, goodput)),
        # the minutes: the save, the downtime when the next attempt shows up, the redone steps
        ("10m", per_minute["checkpoint"], one('{category="checkpoint"}', 30)),
        ("26m", per_minute["downtime"], one('{category="downtime"}', 300)),
        ("29m", per_minute["recomputed"], one('{category="recomputed"}', 45)),
        ("29m", per_minute["goodput"], one('{category="goodput"}', 0)),
        # a mark at each attempt's process start (ms): 0 s, then 1500 s once it shows up
        ("10m", attempts, one(r1, 0)),
        ("30m", attempts, one(r1, 1500 * 1000)),
        # attempt 2 resumed from step 46, later than attempt 1's start: progress
        ("28m", no_progress, []),
    ]
    cases += [("46m", next(iter(_goodput_queries(title, other).values())), [])
              for title in ("Goodput over the run", "Run wall clock", "annotation: Attempts")]
    spec = {"rule_files": [str(RULES_DIR / "mindformers-recording.yml")],
            "evaluation_interval": "1m", "tests": [
                {"interval": "1m", "input_series": restart["input_series"],
                 "promql_expr_test": [
                     {"expr": expr, "eval_time": at,
                      "exp_samples": [{"labels": labels, "value": value}
                                      for labels, value in samples]}
                     for at, expr, samples in cases]}]}
    path = tmp_path / "goodput-panels.yml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    result = subprocess.run(["promtool", "test", "rules", str(path)], capture_output=True,
                            text=True, timeout=TIMEOUT, env=promtool_env())
    assert result.returncode == 0, result.stdout + result.stderr


# ---------------------------------------------------------------- docker compose
