"""The shipped Prometheus rules, their promtool tests, the example configs and the runbook.

The promtool/amtool checks never skip: a missing binary fails with the install command
(`apt-get install prometheus prometheus-alertmanager`).
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mfotel.alerting import rule_health, rules
from mfotel.cli import main as cli_main
from mfotel.contract import COMMON_LABELS, CONTRACT
from mfotel.localstack.servers import find_binary
from mfotel.node.metrics import SERIES as NODE_SERIES
from tests.support import promtool_split
from tests.support.paths import ROOT
from tests.support.promtool import TIMEOUT, promtool_env

RULES_DIR = ROOT / "prometheus" / "rules"
TESTS_DIR = ROOT / "prometheus" / "tests"
ALERTS = RULES_DIR / rules.ALERTS_FILE
RECORDING = RULES_DIR / rules.RECORDING_FILE
RUNBOOK = ROOT / "prometheus" / "runbook.md"
PROMETHEUS_YML = ROOT / "prometheus" / "prometheus.yml"
ALERTMANAGER_YML = ROOT / "alertmanager" / "alertmanager.yml"

#: Alerts about a whole job rather than one rank: their expression aggregates `rank` away, so
#: their description names job_name only. Keep this list explicit and short.
JOB_LEVEL_ALERTS = frozenset({"MindFormersRanksMissing", "MindFormersThroughputDrop",
                              "MindFormersGradNormNotFinite", "MindFormersGoodputLow",
                              "MindFormersRestartStorm", "MindFormersExportFailing"})
#: Alerts that name the rank(s) the others wait for, else the job when no rank stands out.
RANK_OR_JOB_ALERTS = frozenset({"MindFormersTrainingStalled"})
#: The pages of a cascade's culprit (mfotel.alerting.cascade): they carry a stacks_url.
CULPRIT_ALERTS = frozenset({"MindFormersTrainingStalled", "MindFormersRankFailed",
                            "MindFormersRankExited", "MindFormersRankDown"})
#: Alerts on a rule evaluator (mfotel.alerting.rule_health): per evaluator and rule group, no
#: job (one evaluator serves every job whose ranks it holds).
EVALUATOR_ALERTS = frozenset(rule_health.ALERTS)

INSTALL = {"promtool": "apt-get install prometheus",
           "amtool": "apt-get install prometheus-alertmanager"}


def tool(name: str) -> str:
    path = find_binary((name,))
    if path is None:
        pytest.fail(f"{name} not found on PATH; install it: {INSTALL[name]}")
    return path


def run_tool(*argv: str) -> subprocess.CompletedProcess:
    result = subprocess.run([tool(argv[0]), *argv[1:]], capture_output=True, text=True,
                            cwd=ROOT, timeout=TIMEOUT, env=promtool_env())
    assert result.returncode == 0, f"{' '.join(argv)} failed:\n{result.stdout}\n{result.stderr}"
    return result


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def alert_rules() -> list[dict]:
    return [r for g in load(ALERTS)["groups"] for r in g["rules"]]


def recording_rules() -> list[dict]:
    return [r for g in load(RECORDING)["groups"] for r in g["rules"]]


# ---------------------------------------------------------------- the binaries
def test_promtool_check_rules_accepts_the_rule_files() -> None:
    out = run_tool("promtool", "check", "rules", str(RECORDING), str(ALERTS)).stdout
    assert f"SUCCESS: {len(alert_rules())} rules found" in out


def test_promtool_unit_tests_pass(tmp_path: Path) -> None:
    """Every test of prometheus/tests, each with only the rules it reads (a fifth of the CPU of
    the files as written: tests/support/promtool_split.py, whose closure is tested in
    test_promtool_split.py), and one file as written, as docs/alerting.md's command runs it."""
    test_files = sorted(TESTS_DIR.glob("*.yml"))
    assert test_files, "no promtool tests in prometheus/tests"
    split = promtool_split.split(test_files, tmp_path)
    assert len(split) == sum(len(load(path)["tests"]) for path in test_files)
    out = run_tool("promtool", "test", "rules", *map(str, split)).stdout
    assert out.count("SUCCESS") == len(split), out
    as_written = run_tool("promtool", "test", "rules", str(TESTS_DIR / "recording.yml")).stdout
    assert as_written.count("SUCCESS") == 1, as_written


def test_promtool_check_config_accepts_the_example_prometheus_yml() -> None:
    out = run_tool("promtool", "check", "config", str(PROMETHEUS_YML)).stdout
    assert "SUCCESS: 2 rule files found" in out


def test_amtool_check_config_accepts_the_example_alertmanager_yml() -> None:
    out = run_tool("amtool", "check-config", str(ALERTMANAGER_YML)).stdout
    assert "SUCCESS" in out and "5 inhibit rules" in out


def test_rules_with_a_custom_selector_and_thresholds_are_valid(tmp_path: Path) -> None:
    config = rules.RulesConfig(selector='cluster="a", job=~"mindformers.*"', stall_seconds=1800,
                               loss_spike_factor=2.0, rank_down_for="5m",
                               loss_divergence_window="30m", ranks_missing_for="0s")
    paths = rules.write_rules(tmp_path, config)
    run_tool("promtool", "check", "rules", *map(str, paths))
    text = (tmp_path / rules.ALERTS_FILE).read_text()
    assert 'mindformers_train_status{cluster="a", job=~"mindformers.*"}' in text
    recorded = (tmp_path / rules.RECORDING_FILE).read_text()
    # the stall threshold with stall_for inside the expression (a consequence pages at once)
    assert "> 1920" in recorded and "for: 5m" in text and "stall_seconds=1800" in text
    assert 'mindformers_train_samples_total{cluster="a", job=~"mindformers.*"}' in recorded
    # the loss records are named after their window, and the alert reads those names
    assert "record: job_name:mindformers_train_loss:rank_median30m" in recorded
    assert "job_name:mindformers_train_loss:rank_median30m > 0" in text
    missing = next(r for g in rules.alerting_rules(config) for r in g["rules"]
                   if r["alert"] == "MindFormersRanksMissing")
    assert "for" not in missing


# ---------------------------------------------------------------- generation
def test_checked_in_rule_files_are_what_the_generator_writes() -> None:
    generated = rules.render_rules()
    for name, text in generated.items():
        assert (RULES_DIR / name).read_text() == text, (
            f"prometheus/rules/{name} is stale: run `make assets`")
    assert rules.stale_rule_files(RULES_DIR) == []


def test_rules_check_command_reports_stale_files(tmp_path: Path) -> None:
    rules.write_rules(tmp_path)
    assert cli_main(["rules", "--out-dir", str(tmp_path), "--check"]) == 0
    (tmp_path / rules.ALERTS_FILE).write_text("groups: []\n")
    assert cli_main(["rules", "--out-dir", str(tmp_path), "--check"]) == 1
    cli = subprocess.run([sys.executable, "-m", "mfotel", "rules", "--out-dir", str(RULES_DIR),
                          "--check"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0, cli.stderr


@pytest.mark.parametrize("override, message", [
    ({"stall_for": "2 minutes"}, "not a Prometheus duration"),
    ({"loss_spike_factor": 0.9}, "must be > 1"),
    ({"throughput_drop_ratio": 1.5}, "must be in"),
    ({"stall_seconds": 0}, "must be > 0"),
    ({"step_drift_seconds": -1}, "must be > 0"),
    ({"loss_divergence_tolerance": 0.0}, "must be > 0"),
    ({"selector": '{cluster="a"}'}, "without braces"),
    ({"nonfinite_settle": "0s"}, "nonfinite_settle='0s' must be longer than 0s"),
    ({"loss_spike_window": "0m"}, "Prometheus refuses to load"),
    ({"rank_down_lookback": "0h"}, "rank_down_lookback='0h' must be longer than 0s"),
    ({"grad_norm_nonfinite_for": "0s"}, "grad_norm_nonfinite_for='0s' must be longer than 0s"),
])
def test_rules_config_rejects_bad_values(override: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        rules.RulesConfig(**override)


def test_rules_set_option_rejects_unknown_keys() -> None:
    with pytest.raises(SystemExit, match="stall_seconds"):
        cli_main(["rules", "--out-dir", "/nonexistent", "--set", "stal_seconds=3"])


# ---------------------------------------------------------------- conventions
def github_anchor(heading: str) -> str:
    slug = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return slug.replace(" ", "-")


def runbook_anchors() -> set[str]:
    anchors, fenced = set(), False
    for line in RUNBOOK.read_text().splitlines():
        fenced ^= line.startswith("```")
        if line.startswith("#") and not fenced:
            anchors.add(github_anchor(line.lstrip("#")))
    return anchors


def test_design_minimum_alert_set_is_present() -> None:
    names = {r["alert"] for r in alert_rules()}
    assert {"MindFormersLossNotFinite", "MindFormersGradNormNotFinite",
            "MindFormersTrainingStalled", "MindFormersRankDown", "MindFormersGradNormSpike",
            "MindFormersLossSpike", "MindFormersThroughputDrop", "MindFormersStragglerRank",
            "MindFormersLossScaleOverflowStorm"} <= names
    assert names == set(rules.alert_names())
    loss = next(r for r in alert_rules() if r["alert"] == "MindFormersLossNotFinite")
    assert loss["labels"]["severity"] == "critical" and "for" not in loss


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda r: r["alert"])
def test_alert_follows_mixin_conventions(rule: dict) -> None:
    assert re.fullmatch(r"MindFormers[A-Z][A-Za-z]+", rule["alert"])
    severities = ("info",) if rule["alert"] in rules.INFO_ALERTS else ("critical", "warning")
    assert rule["labels"]["severity"] in severities
    annotations = rule["annotations"]
    # a culprit's page links the stacks its node agent captured (mfotel.alerting.cascade)
    extra = {"stacks_url"} if rule["alert"] in CULPRIT_ALERTS else set()
    assert set(annotations) == {"summary", "description", "runbook_url", *extra}
    assert "{{" not in annotations["summary"], "summary must be static"
    description = annotations["description"]
    if rule["alert"] in EVALUATOR_ALERTS:   # an evaluator and its group, no job
        assert set(re.findall(r"\$labels\.(\w+)", description)) == {"instance", "rule_group"}
    elif rule["alert"] in JOB_LEVEL_ALERTS:
        assert "$labels.job_name" in description
        assert "$labels.rank" not in description, "job-level alert names a rank"
    else:
        assert "$labels.job_name" in description and "$labels.rank" in description
    if rule["alert"] in RANK_OR_JOB_ALERTS:
        assert "{{ if $labels.rank }}" in annotations["description"], "says which it is"
    base, _, anchor = annotations["runbook_url"].partition("#")
    assert base == rules.RUNBOOK_BASE_URL and anchor == rule["alert"].lower()
    assert anchor in runbook_anchors(), f"prometheus/runbook.md has no section {rule['alert']}"


def test_info_alerts_only_mute_and_are_sent_nowhere() -> None:
    """An info alert reaches a receiver without integrations, and mutes another alert."""
    config = load(ALERTMANAGER_YML)
    receivers = {r["name"]: r for r in config["receivers"]}
    info_routes = [r for r in config["route"]["routes"]
                   if r.get("matchers") == ['severity = "info"']]
    assert [r["receiver"] for r in info_routes] == ["mfotel-none"]
    assert set(receivers["mfotel-none"]) == {"name"}, "no integration: nothing is sent"
    assert config["route"]["routes"][0] is info_routes[0], "before any route that would send it"
    sources = {m for rule in config["inhibit_rules"] for m in rule["source_matchers"]}
    for name in rules.INFO_ALERTS:
        assert f'alertname = "{name}"' in sources, f"{name} mutes nothing"


def test_job_level_alerts_are_shipped_and_grouped_by_job() -> None:
    assert JOB_LEVEL_ALERTS <= set(rules.alert_names()), "stale JOB_LEVEL_ALERTS entry"
    route = load(ALERTMANAGER_YML)["route"]
    # grouping by a label a job-level alert lacks would split or merge notifications oddly
    assert set(route["group_by"]) <= {"job_name", "alertname", "severity"}


def test_runbook_sections_explain_meaning_checks_and_silencing() -> None:
    sections = re.split(r"^## ", RUNBOOK.read_text(), flags=re.M)[1:]
    by_name = {s.splitlines()[0].strip(): s for s in sections}
    assert set(by_name) == set(rules.alert_names())
    for name, text in by_name.items():
        assert "**Meaning.**" in text and "**First checks.**" in text, name
        assert "**Silence.**" in text and "amtool" in text, name


def promtool_cases() -> dict[str, dict[str, int]]:
    """alertname -> {"firing": n, "quiet": n} over prometheus/tests/*.yml."""
    cases: dict[str, dict[str, int]] = {}
    for path in TESTS_DIR.glob("*.yml"):
        for test in load(path).get("tests", []):
            for case in test.get("alert_rule_test", []):
                kind = "firing" if case.get("exp_alerts") else "quiet"
                counts = cases.setdefault(case["alertname"], {"firing": 0, "quiet": 0})
                counts[kind] += 1
    return cases


@pytest.mark.parametrize("name", rules.alert_names())
def test_every_alert_has_firing_and_not_firing_promtool_cases(name: str) -> None:
    counts = promtool_cases().get(name, {"firing": 0, "quiet": 0})
    assert counts["firing"] >= 1, f"no promtool case where {name} fires"
    assert counts["quiet"] >= 2, f"fewer than two promtool cases where {name} stays quiet"


def test_firing_cases_check_labels_and_annotations() -> None:
    for path in TESTS_DIR.glob("*.yml"):
        for test in load(path).get("tests", []):
            for case in test.get("alert_rule_test", []):
                for alert in case.get("exp_alerts") or []:
                    where = f"{path.name}: {test.get('name')} @ {case['eval_time']}"
                    if case["alertname"] in EVALUATOR_ALERTS:
                        assert set(alert["exp_labels"]) == {
                            "severity", "instance", "rule_group"}, where
                    else:
                        assert {"severity", "job_name"} <= set(alert["exp_labels"]), where
                    if case["alertname"] not in RANK_OR_JOB_ALERTS | EVALUATOR_ALERTS:
                        job_level = case["alertname"] in JOB_LEVEL_ALERTS
                        assert ("rank" in alert["exp_labels"]) != job_level, where
                    extra = {"stacks_url"} if case["alertname"] in CULPRIT_ALERTS else set()
                    assert set(alert["exp_annotations"]) == {
                        "summary", "description", "runbook_url", *extra}, where


def test_every_recording_rule_is_unit_tested() -> None:
    tested = " ".join(case["expr"] for path in TESTS_DIR.glob("*.yml")
                      for test in load(path).get("tests", [])
                      for case in test.get("promql_expr_test", []))
    for rule in recording_rules():
        assert rule["record"] in tested, f"no promql_expr_test for {rule['record']}"


def test_dashboard_recording_rule_names_are_kept() -> None:
    """Every recording rule the checked-in dashboards query is still recorded."""
    from mfotel.dashboards.queries import dashboard_queries, metric_names
    records = {r["record"] for r in recording_rules()}
    used = {name for path in (ROOT / "grafana" / "dashboards").glob("*.json")
            for query in dashboard_queries(json.loads(path.read_text()))
            for name in metric_names(query.expr) if name.count(":") == 2}
    assert {rules.WAITED_FOR, rules.OUTSIDE_SHARE, rules.IN_STEP, rules.SLOWEST_RANK} <= used
    assert used <= records, used - records
    quantiles = {r["labels"]["quantile"] for r in recording_rules()
                 if r["record"] == "job_name:mindformers_train_step_duration_seconds:quantile1m"}
    assert quantiles == {"0.5", "0.9", "0.99"}
    for record in records:   # level:metric:operations
        assert re.fullmatch(r"[a-z_]+:[a-z_]+:[a-z0-9_]+", record), record


_SERIES = re.compile(
    r"\b([a-z_]+:[a-z0-9_]+:[a-z0-9_]+|mindformers_[a-z0-9_]+|mfotel_[a-z0-9_]+)\b")


def exposed_sample_names() -> set[str]:
    names = set()
    for spec in CONTRACT:
        if spec.kind == "histogram":
            names |= {spec.prometheus_name + s for s in ("_bucket", "_sum", "_count")}
        else:
            names.add(spec.sample_name)
    return names


def test_every_series_named_in_rules_is_in_the_contract_or_recorded() -> None:
    known = exposed_sample_names() | {r["record"] for r in recording_rules()} | {
        series.name for series in NODE_SERIES}   # the node agent's (mfotel-instrument)
    used: set[str] = set()
    for rule in alert_rules() + recording_rules():
        used |= set(_SERIES.findall(rule["expr"]))
        for text in rule.get("annotations", {}).values():
            used |= set(_SERIES.findall(text.split("#")[0]))   # not the runbook anchor
    assert used, "no series found in the rules"
    assert used <= known, f"unknown series in rules: {sorted(used - known)}"


def test_rules_group_by_contract_labels_only() -> None:
    # the contract's labels (rank_info's world_size, nonfinite_total's metric, ...) and
    # Prometheus' target and histogram labels
    allowed = set(COMMON_LABELS) | {label for spec in CONTRACT for label in spec.labels} | {
        "job", "instance", "le", "namespace", "pod_name", "how", "run_id", "category",
        "rule_group", "status"} | {
        # + rank_info's Kubernetes labels and run identity, `how` a rank left the healthy state
        # (the cascade records make it), a goodput `category` (the goodput records make it),
        # an evaluator's `rule_group` (Prometheus' own; vmalert's `group` relabelled), the
        # `status` count_values makes of a rank's status
        label for series in NODE_SERIES for label in series.labels}  # + the node agent's
    for rule in alert_rules() + recording_rules():
        for clause in re.findall(r"\b(?:by|on|without|ignoring)\s*\(([^)]*)\)", rule["expr"]):
            labels = {label.strip() for label in clause.split(",") if label.strip()}
            assert labels <= allowed, (rule.get("alert") or rule["record"], labels - allowed)
