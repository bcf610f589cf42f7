"""The promtool tests `mfotel assets` writes beside the rules: rendered for the same `--set`
settings, they pass the real `promtool test rules` against the rules of those settings (and
the tests of the defaults fail against changed rules, so they do follow the settings)."""
from __future__ import annotations

import ast
import dataclasses
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml

from mfotel.alerting import rule_tests
from mfotel.alerting.rule_tests import RuleTestError, evaluate, human, render_rule_tests
from mfotel.alerting.rules import ALERTS_FILE, RECORDING_FILE, RulesConfig, render_rules
from mfotel.cli import main
from tests.support import promtool_split
from tests.support.paths import ROOT
from tests.support.promtool import TIMEOUT, promtool, promtool_env

#: Every threshold and duration of RulesConfig: key -> (moved one way, moved the other).
MOVED = {
    "stall_seconds": ("1800", "600"),
    "stall_step_factor": ("20", "5"),
    "step_interval_window": ("2h", "30m"),
    "stall_for": ("5m", "1m"),
    "rank_down_lookback": ("2h", "30m"),
    "rank_down_for": ("5m", "1m"),
    "failed_lookback": ("30m", "10m"),
    "loss_spike_factor": ("2", "1.2"),
    "loss_spike_window": ("1h", "15m"),
    "loss_spike_for": ("5m", "1m"),
    "grad_norm_spike_factor": ("10", "3"),
    "grad_norm_spike_window": ("2h", "30m"),
    "grad_norm_spike_for": ("5m", "1m"),
    "throughput_drop_ratio": ("0.3", "0.7"),
    "throughput_window": ("10m", "3m"),
    "throughput_baseline_window": ("2h", "30m"),
    "throughput_drop_for": ("15m", "5m"),
    "straggler_wait_ratio": ("0.2", "0.05"),
    "slowest_wait_ratio": ("0.05", "0.005"),
    "straggler_for": ("15m", "5m"),
    "overflow_storm_ratio": ("0.3", "0.7"),
    "overflow_window": ("10m", "3m"),
    "overflow_storm_for": ("10m", "2m"),
    "ranks_missing_for": ("10m", "2m"),
    "rank_unresponsive_for": ("20m", "5m"),
    "loss_divergence_window": ("30m", "5m"),
    "loss_divergence_tolerance": ("0.3", "0.8"),
    "loss_divergence_for": ("30m", "10m"),
    "step_drift_seconds": ("300", "60"),
    "step_drift_for": ("10m", "2m"),
    "checkpoint_max_age_seconds": ("3600", "10800"),
    "checkpoint_interval_factor": ("2", "4"),
    "checkpoint_rate_window": ("30m", "10m"),
    "checkpoint_for": ("10m", "2m"),
    "nonfinite_window": ("10m", "3m"),
    "nonfinite_settle": ("3m", "30s"),
    "grad_norm_nonfinite_for": ("3m", "30s"),
    "departure_seconds": ("12", "5"),
    "departure_step_factor": ("5", "2"),
    "cascade_window": ("2h", "30m"),
    "culprit_keep_firing_for": ("2m", "30s"),
    "goodput_run_window": ("60d", "7d"),
    "goodput_floor_ratio": ("0.5", "0.7"),
    "goodput_for": ("30m", "10m"),
    "restart_storm_restarts": ("3", "1"),
}
LOOSER = {key: values[0] for key, values in MOVED.items()}
STRICTER = {key: values[1] for key, values in MOVED.items()}
#: The settings whose rendered tests promtool runs (a run of all files, each test with only the
#: rules it reads, costs ~11 CPU-seconds: the selector rides with the stricter thresholds,
#: which it is independent of, rather than costing a run of its own).
SETTINGS = {
    "defaults": {},
    "looser": LOOSER,
    "stricter-with-a-selector": {**STRICTER, "selector": 'cluster="a", instance=~".+"',
                                 "runbook_base_url": "https://wiki.example.org/runbook"},
    "one-threshold": {"stall_seconds": "1800"},
}


#: Settings whose promtool run takes only the files they change (see below).
EVERY_FILE_RUN_BY_OTHERS = frozenset({"one-threshold"})


def _body(text: str) -> str:
    """A rendered test file without its comments (the header names the settings)."""
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))


def assets(out: Path, settings: dict[str, str]) -> Path:
    sets = [arg for key, value in settings.items() for arg in ("--set", f"{key}={value}")]
    assert main(["assets", "--out", str(out), *sets]) == 0
    return out / "prometheus" / "tests"


def promtool_test(tests_dir: Path, *names: str) -> subprocess.CompletedProcess[str]:
    """`promtool test rules` on each test of the test files `names` of `tests_dir` (default:
    all) with only the rules it reads (tests/support/promtool_split.py: a fifth of the CPU;
    test_rules.py runs the shipped files as written)."""
    files = sorted(tests_dir.glob("*.yml"))
    assert len(files) == len(rule_tests.templates())
    if names:
        files = [tests_dir / name for name in names]
    split = promtool_split.split(files, Path(tempfile.mkdtemp(dir=tests_dir.parent)))
    return subprocess.run([promtool(), "test", "rules", *map(str, split)], capture_output=True,
                          text=True, cwd=tests_dir, timeout=TIMEOUT, env=promtool_env())


def test_the_changed_settings_move_every_threshold():
    """A new RulesConfig field is moved in both directions here, so its tests must follow it."""
    fields = {f.name for f in dataclasses.fields(RulesConfig)}
    assert set(MOVED) == fields - {"selector", "runbook_base_url"}


def test_every_rule_covered_by_the_tests_has_a_template():
    assert set(rule_tests.templates()) == {p.name for p in (ROOT / "prometheus" / "tests").glob(
        "*.yml")}


def test_the_repository_copies_are_the_rendered_defaults():
    for name, text in render_rule_tests().items():
        assert (ROOT / "prometheus" / "tests" / name).read_text() == text, \
            f"prometheus/tests/{name} is stale: run `make assets`"


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_assets_writes_rule_tests_that_promtool_passes(name, tmp_path):
    tests_dir = assets(tmp_path, SETTINGS[name])
    if not SETTINGS[name]:
        # the defaults are the repository's rules and tests, which
        # test_rules.py::test_promtool_unit_tests_pass runs through promtool: written alike,
        # they pass alike
        for folder in ("rules", "tests"):
            written = {p.name: p.read_bytes() for p in (tmp_path / "prometheus" / folder).iterdir()}
            shipped = {p.name: p.read_bytes() for p in (ROOT / "prometheus" / folder).iterdir()}
            assert written == shipped, f"prometheus/{folder} is stale: run `make assets`"
        return
    names = sorted(rule_tests.templates())
    if name in EVERY_FILE_RUN_BY_OTHERS:
        # a file rendered as for the defaults (its header aside) does not depend on these
        # settings: had it a hidden dependency, the looser and stricter runs, which move every
        # setting and run every file, would fail it
        defaults = render_rule_tests()
        names = [n for n in names if _body((tests_dir / n).read_text()) != _body(defaults[n])]
        assert names, "the setting changed no test: it is not tested here"
    done = promtool_test(tests_dir, *names)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert done.stdout.count("SUCCESS") == sum(len(yaml.safe_load((tests_dir / n).read_text())[
        "tests"]) for n in names)
    header = (tests_dir / "stall-down-failed.yml").read_text().splitlines()[0]
    for key in SETTINGS[name]:
        assert f"{key}=" in header and "${" not in (tests_dir / "checkpoints.yml").read_text()


def test_every_test_file_orders_the_groups_records_first():
    """promtool orders the groups at random in each run without `group_eval_order`: the spike
    alerts, which read the finite samples recorded by mindformers-loss.rules at the same
    evaluation, failed 10 runs of 12. Every file names every group, the recording ones first."""
    rules = {name: yaml.safe_load(text) for name, text in render_rules().items()}
    recording = [g["name"] for g in rules[RECORDING_FILE]["groups"]]
    alerting = [g["name"] for g in rules[ALERTS_FILE]["groups"]]
    for settings in ({}, {"selector": 'cluster="a"'}):
        for name, text in render_rule_tests(RulesConfig(**settings)).items():
            order = yaml.safe_load(text)["group_eval_order"]
            assert order == recording + alerting, (name, order)
    assert "mindformers-loss.rules" in recording and "mindformers-dynamics.alerts" in alerting


def test_the_rendered_tests_follow_the_settings(tmp_path):
    """The defaults' tests fail against rules with a later stall threshold: the tests that
    pass there are the ones rendered for it."""
    default_tests = assets(tmp_path / "default", {})
    changed = assets(tmp_path / "changed", {"stall_seconds": "1800"})
    (changed / "stall-down-failed.yml").write_text(
        (default_tests / "stall-down-failed.yml").read_text())
    done = promtool_test(changed, "stall-down-failed.yml")   # [one-threshold]: what it changes
    assert done.returncode == 1 and "MindFormersTrainingStalled" in done.stdout + done.stderr
    stalled = yaml.safe_load((tmp_path / "default" / "prometheus" / "tests" /
                              "stall-down-failed.yml").read_text())["tests"][0]
    later = yaml.safe_load(render_rule_tests(RulesConfig(stall_seconds=1800))[
        "stall-down-failed.yml"])["tests"][0]
    fired = [c["eval_time"] for t in (stalled, later) for c in t["alert_rule_test"]
             if c["exp_alerts"]]
    assert fired == ["28m", "43m"]       # 10 + 900 s / 60 + 1 + for 2m; 10 + 30 + 1 + 2


def test_the_selector_labels_go_on_the_rules_series_and_what_keeps_them():
    text = render_rule_tests(RulesConfig(selector='cluster="a"'))["stall-down-failed.yml"]
    document = yaml.safe_load(text)
    # MindFormersRankDown keeps every label of the rank's series, the selector's with them
    first = next(t for t in document["tests"]
                 if t["name"] == "a rank that vanishes while running is down")
    assert all('cluster="a"' in s["series"] for s in first["input_series"])
    alert = next(c for c in first["alert_rule_test"] if c["exp_alerts"])["exp_alerts"][0]
    assert alert["exp_labels"]["cluster"] == "a"
    multirank = yaml.safe_load(render_rule_tests(RulesConfig(selector='cluster="a"'))[
        "multirank.yml"])
    joins = multirank["tests"][-1]
    assert all("cluster" not in s["series"] for s in joins["input_series"]
               if s["series"].startswith(("npu_", "DCGM_")))


def test_a_selector_the_tests_cannot_match_writes_no_tests_and_says_so(tmp_path, capsys):
    assert main(["assets", "--out", str(tmp_path), "--set", 'selector=job=~"trainer-.*"']) == 0
    assert "no rule tests written" in capsys.readouterr().err
    assert (tmp_path / "prometheus" / "rules").is_dir()
    assert not (tmp_path / "prometheus" / "tests").exists()


@pytest.mark.parametrize("settings, why", [
    ({"rank_down_for": "0s"}, "rank_down_for must be at least 1m"),
    ({"straggler_wait_ratio": 0.5}, "straggler_wait_ratio and slowest_wait_ratio must be below"),
    ({"slowest_wait_ratio": 0.3}, "slowest_wait_ratio must be below 0.24"),
])
def test_settings_a_test_cannot_be_built_for_are_refused_by_name(settings, why):
    with pytest.raises(RuleTestError, match=why):
        render_rule_tests(RulesConfig(**settings))


# ---------------------------------------------------------------- the template language
def test_expressions_are_arithmetic_over_the_settings():
    names = {"stall_seconds": 900, "stall_for": "2m"}
    assert evaluate("10 + floor(max(stall_seconds, 600) / 60) + 1", names) == 26
    assert evaluate("minutes(stall_for) + minutes(90)", names) == 4
    assert evaluate("3 if stall_seconds > 600 and 1 else 4", names) == 3
    for bad in ("__import__('os')", "stall_seconds.real", "open('x')", "[1, 2]", "x"):
        with pytest.raises(RuleTestError):
            evaluate(bad, names)


@pytest.mark.parametrize("seconds, text", [
    (0, "0s"), (0.5, "0.5s"), (59, "59s"), (60, "1m 0s"), (1080, "18m 0s"),
    (4500, "1h 15m 0s"), (90061, "1d 1h 1m 1s")])
def test_human_is_prometheus_humanize_duration(seconds, text):
    assert human(seconds) == text


def test_alerting_rules_do_not_import_the_assets_module():
    """One direction: mfotel.assets imports the rule generators, never the other way."""
    for module in ("rules.py", "rule_tests.py"):
        tree = ast.parse((ROOT / "mfotel" / "alerting" / module).read_text())
        imported = {node.module or "" for node in ast.walk(tree)
                    if isinstance(node, ast.ImportFrom)}
        imported |= {a.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                     for a in node.names}
        assert not any("assets" in name for name in imported), (module, imported)
