"""The rules split for a sharded topology (mfotel/alerting/sharded.py): every rule in exactly
one part, the global part reading only what the shards forward or it records itself, both
files accepted by promtool and the global one by the real vmalert. (The unsharded files stay
as shipped: tests/unit/test_assets.py.)"""
from __future__ import annotations

import subprocess
from collections import Counter
from pathlib import Path

import pytest
import yaml

from mfotel import assets
from mfotel.alerting import goodput, goodput_sharded, sharded
from mfotel.alerting.cascade import STALLED
from mfotel.alerting.rules import RulesConfig, alerting_rules, recording_rules
from mfotel.localstack.servers import find_binary
from mfotel.simulation.run import SIM_RULES
from tests.support.promtool import TIMEOUT, promtool, promtool_env

CONFIGS = [RulesConfig(), RulesConfig(**SIM_RULES)]


def _names(groups: list[dict]) -> list[str]:
    return [r.get("record") or r["alert"] for g in groups for r in g["rules"]]


def _condition(groups: list[dict], alertname: str) -> str:
    """The expression an alert of the global part fires on: its own, or for a page kept
    firing, its condition's record's."""
    rules = [r for g in groups for r in g["rules"]]
    kept = [r["expr"] for r in rules if r.get("labels", {}).get("page") == alertname]
    return kept[0] if kept else next(r["expr"] for r in rules if r.get("alert") == alertname)


def _rule_keys(groups: list[dict]) -> list[tuple[str, str]]:
    """(name, labels) of each rule: a record may be defined once per label set."""
    return [(r.get("record") or r["alert"], repr(sorted(r.get("labels", {}).items())))
            for g in groups for r in g["rules"]]


@pytest.mark.parametrize("cfg", CONFIGS, ids=["shipped", "simulation"])
def test_every_rule_lands_in_exactly_one_part(cfg):
    unsharded = Counter(_rule_keys(recording_rules(cfg)) + _rule_keys(alerting_rules(cfg)))
    scraper, global_ = sharded.scraper_groups(cfg), sharded.global_groups(cfg)
    meta = Counter(_rule_keys(sharded.scraper_meta(cfg)) + _rule_keys(sharded.global_meta(cfg)))
    split = Counter(_rule_keys(scraper) + _rule_keys(global_))
    kept = Counter(k for k in _rule_keys(global_) if k[0] == sharded.KEPT)
    # goodput: the chain on every shard, the combination globally (the next test)
    goodput = Counter(_rule_keys([_group(scraper, sharded.GOODPUT_RULES)])
                      + _rule_keys([_group(global_, sharded.GOODPUT_RULES)]))
    unsharded_goodput = Counter(_rule_keys([_group(recording_rules(cfg),
                                                   sharded.GOODPUT_RULES)]))
    # the stalled ranks' record: inline in the global stall alert (the next test but one)
    stalled = Counter(k for k in unsharded if k[0] == STALLED)
    assert split - meta - kept - goodput == unsharded - unsharded_goodput - stalled
    # the culprit pages kept firing as in one Prometheus, through a record of their condition
    assert len(kept) == 4 if cfg.culprit_keep_firing_for != "0s" else not kept
    # the per-rank parts run on every shard, the comparisons once
    assert {"MindFormersLossSpike", sharded.HEARTBEAT} <= set(_names(scraper))
    assert {"MindFormersRanksMissing", "MindFormersStragglerRank", "MindFormersRankDown",
            "MindFormersLossNotFinite", "MindFormersScraperDown"} <= set(_names(global_))
    assert not set(_names(scraper)) & set(_names(global_))


def _group(groups: list[dict], name: str) -> dict:
    (group,) = [g for g in groups if g["name"] == name]
    return group


@pytest.mark.parametrize("cfg", CONFIGS, ids=["shipped", "simulation"])
def test_goodput_chains_on_the_shards_and_the_global_part_never_reads_its_own_records(cfg):
    """vmalert reads its records a flush after its group ran: the chain (each goodput record
    reads those before it in the same evaluation) runs on the shards, and the global part
    reads only the shards' records, under the names the dashboards and alerts read."""
    unsharded = [r["record"] for r in _group(recording_rules(cfg), sharded.GOODPUT_RULES)["rules"]]
    on_shards = _group(sharded.scraper_groups(cfg), sharded.GOODPUT_RULES)
    in_global = _group(sharded.global_groups(cfg), sharded.GOODPUT_RULES)
    assert on_shards["interval"] == in_global["interval"] == goodput.INTERVAL
    # the shards' weight is the chain's own count of the run's ranks
    assert goodput_sharded.RANKS in unsharded
    assert [r["record"] for r in on_shards["rules"]] == [
        *(goodput_sharded.shard(n) for n in unsharded if n not in goodput_sharded.SHARES),
        *(goodput_sharded.shard(n) for n in (goodput_sharded.ATTEMPTS_TOTAL,
                                             goodput_sharded.RESTARTS_NO_PROGRESS_TOTAL))]
    # every shard record reads shard records only, never a global one
    shard_names = {r["record"] for r in on_shards["rules"]}
    assert sharded.recorded_names_read([on_shards]) <= shard_names
    written = {r["record"] for r in in_global["rules"]}
    assert sharded.recorded_names_read([in_global]) <= shard_names
    assert not sharded.recorded_names_read([in_global]) & written
    # what the dashboards and the goodput alerts read is recorded globally
    dashboards = b"".join(c for n, c in assets.all_files().items() if n.endswith(".json"))
    read = {n for n in unsharded if n.encode() in dashboards}
    read |= sharded.recorded_names_read([_group(sharded.global_groups(cfg),
                                                sharded.GOODPUT_ALERTS)]) & set(unsharded)
    assert len(read) >= 8 and read <= written, read - written


@pytest.mark.parametrize("cfg", CONFIGS, ids=["shipped", "simulation"])
def test_the_scraper_part_reads_only_its_own_records_and_the_global_part_what_is_forwarded(cfg):
    scraper, global_ = sharded.scraper_groups(cfg), sharded.global_groups(cfg)
    scraper_records = sharded.recorded_names(scraper)
    global_records = sharded.recorded_names(global_)
    # a shard holds part of a job: it never reads what compares the job's ranks
    assert sharded.recorded_names_read(scraper) <= scraper_records
    # the store holds every shard's samples (raw and recorded) and the ruler's own records
    assert sharded.recorded_names_read(global_) <= scraper_records | global_records
    assert sharded.recorded_names_read(global_) & scraper_records   # it does read them


def test_the_global_part_leaves_the_ranks_of_a_stopped_shard_out():
    groups = sharded.global_groups(RulesConfig())
    rules = {r.get("record") or r["alert"]: r for g in groups for r in g["rules"]}
    assert f"unless on (job_name, rank) {sharded.UNSEEN}" in rules[
        "job_name_rank_how:mindformers_train_departure_timestamp_seconds:fresh"]["expr"]
    for name in ("MindFormersTrainingStalled", "MindFormersRankDown", "MindFormersRankExited",
                 "MindFormersRankFailed"):
        assert f"unless on (job_name, rank) {sharded.UNSEEN}" in _condition(groups, name), name
    # an incident held before the shard stopped keeps its culprit: of the departures held,
    # only a stopped shard's ranks' vanishing is void
    assert rules["job_name_rank_how:mindformers_train_departure_timestamp_seconds:valid"][
        "expr"].endswith(f'unless on (job_name, rank, how)\nlabel_replace({sharded.UNSEEN}, '
                         '"how", "vanished", "", "")')
    assert rules["MindFormersThroughputDrop"]["expr"].endswith(
        "unless on (job_name) job_name_rank:mindformers_train_departure_timestamp_seconds:first")
    assert rules["MindFormersRanksMissing"]["expr"].endswith(
        f"unless on (job_name) {sharded.UNSEEN}")
    assert not any("keep_firing_for" in r for r in rules.values())   # vmalert 1.79
    assert rules["MindFormersRankDown"]["expr"] == (
        f'label_replace(\n  last_over_time({sharded.KEPT}{{page="MindFormersRankDown"}}[1m]),\n'
        '  "page", "", "", ""\n)')


def test_the_global_stall_waits_for_the_culprit_chain():
    """vmalert reads each of its records an evaluation (and a flush) after writing it: the
    stall counts that much longer than in one Prometheus, so that the culprit is known."""
    cfg = RulesConfig(**SIM_RULES)
    culprit = "job_name_rank_how:mindformers_train_culprit_timestamp_seconds:first"
    depth = sharded.global_depths(cfg)[culprit]
    assert depth == 6
    # (depth + 1) x (interval + 1 s flush + 10 s for the store to serve a new series) less
    # the head start the stall gives the chain: stall_seconds + stall_for - departure_seconds
    # (30 s here, 1010 s shipped)
    assert sharded.stall_gate_seconds(RulesConfig(), "15s") == 0
    for interval, gate in (("1s", 54), ("5s", 82), ("15s", 152)):
        stalled = _condition(sharded.global_groups(cfg, interval), "MindFormersTrainingStalled")
        assert stalled.count(f") > {30 + 10 + gate}\n") == 3, interval
    # one Prometheus: the alert's three branches read the stalled ranks' record
    [plain] = [r for g in alerting_rules(cfg) for r in g["rules"]
               if r.get("alert") == "MindFormersTrainingStalled"]
    assert plain["expr"].count(STALLED) == 3 and ") > 40\n" not in plain["expr"]
    [record] = [r for g in recording_rules(cfg) for r in g["rules"] if r.get("record") == STALLED]
    assert record["expr"].count(") > 40\n") == 1
    # the global part holds them inline (a record would add its lag): no record, no reader
    assert STALLED not in {n for n in _names(sharded.global_groups(cfg, "1s"))}
    assert STALLED not in stalled


@pytest.mark.parametrize("cfg", CONFIGS, ids=["shipped", "simulation"])
def test_promtool_and_vmalert_accept_both_parts(tmp_path, cfg):
    promtool, vmalert = find_binary(("promtool",)), find_binary(("vmalert",))
    assert promtool and vmalert, "install: apt-get install prometheus victoria-metrics"
    paths = assets.write_files(assets.sharded_rule_files(cfg), tmp_path)
    done = subprocess.run([promtool, "check", "rules", *map(str, paths)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    counts = [int(line.split()[1]) for line in done.stdout.splitlines() if "rules found" in line]
    assert sum(counts) == len(_names(sharded.scraper_groups(cfg))) + len(
        _names(sharded.global_groups(cfg)))
    checked = subprocess.run([vmalert, "-dryRun", f"-rule={tmp_path / sharded.GLOBAL_FILE}"],
                             capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stderr[-3000:]


def test_mfotel_rules_and_assets_write_the_sharded_topology(tmp_path):
    from mfotel.cli import main
    assert main(["rules", "--topology", "sharded", "--out", str(tmp_path / "r")]) == 0
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == sorted(
        [sharded.SCRAPER_FILE, sharded.GLOBAL_FILE])
    assert main(["rules", "--topology", "sharded", "--check", "--out", str(tmp_path / "r")]) == 0
    assert main(["assets", "--topology", "sharded", "--out", str(tmp_path / "a")]) == 0
    rules = sorted(p.name for p in (tmp_path / "a" / "prometheus" / "rules").iterdir())
    assert rules == sorted([sharded.SCRAPER_FILE, sharded.GLOBAL_FILE])
    config = yaml.safe_load((tmp_path / "a" / "prometheus" / "prometheus.yml").read_text())
    assert config["rule_files"] == [f"rules/{sharded.SCRAPER_FILE}"]
    assert not Path(tmp_path / "a" / "prometheus" / "tests").exists()


def test_the_example_shard_config_is_the_tested_topology_and_promtool_accepts_it(tmp_path):
    from mfotel.localstack.alerting import shipped_files
    from mfotel.localstack.sharded import shard_config
    from tests.support.paths import ROOT
    example = ROOT / "examples" / "prometheus" / "sharded-scraper.yml"
    (tmp_path / "sharded-scraper.yml").write_text(example.read_text())
    assets.write_files(assets.sharded_rule_files(), tmp_path / "rules")
    promtool = find_binary(("promtool",))
    assert promtool, "install: apt-get install prometheus"
    done = subprocess.run([promtool, "check", "config", str(tmp_path / "sharded-scraper.yml")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 1 rule files found" in done.stdout
    shipped = yaml.safe_load(example.read_text())
    tested = yaml.safe_load(shard_config(
        shipped_files()["prometheus"], 0, 2, "/shared/prom-targets/*.json", 15.0,
        "http://victoriametrics:8428", ["alertmanager-0:9093", "alertmanager-1:9093"],
        {"store": "victoriametrics:8428", "global-ruler": "vmalert:8880"}))
    assert shipped["global"]["external_labels"] == tested["global"]["external_labels"]
    assert shipped["rule_files"] == ["rules/" + tested["rule_files"][0]]
    assert shipped["alerting"] == tested["alerting"]
    assert [j["job_name"] for j in shipped["scrape_configs"]] == [
        j["job_name"] for j in tested["scrape_configs"]]
    assert shipped["scrape_configs"][0]["relabel_configs"] == \
        tested["scrape_configs"][0]["relabel_configs"]
    for ours, theirs in zip(shipped["scrape_configs"][1:], tested["scrape_configs"][1:],
                            strict=True):
        assert ours["static_configs"] == theirs["static_configs"]
    assert shipped["remote_write"][0]["url"] == tested["remote_write"][0]["url"]
    assert shipped["remote_write"][0]["queue_config"] == tested["remote_write"][0]["queue_config"]
    assert shipped["remote_write"][0]["write_relabel_configs"] == \
        tested["remote_write"][0]["write_relabel_configs"]


def test_the_repository_copies_beside_the_example_are_the_rendered_rules():
    """examples/prometheus/rules/ holds what the example's `mfotel rules --topology sharded
    --out rules` writes (`make assets` renders them), so the example runs as it is."""
    from tests.support.paths import ROOT
    folder = ROOT / "examples" / "prometheus" / "rules"
    shipped = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert shipped == assets.sharded_rule_files(), \
        "examples/prometheus/rules is stale: run `make assets`"


def test_the_global_account_adds_up_to_the_wall_when_a_shard_round_lands_in_pieces(tmp_path):
    """A shard's records reach the store one by one. The global part reads the shards' rounds
    of count_late() intervals ago, whole by then; and were one read between two of its records,
    as shard 0 (7 of the run's 8 ranks) here shows its wall clock of one round (120 s) beside
    its categories of the round before (60 s, nothing unaccounted), the run's categories,
    `unaccounted` the wall less the others as read, still add up to its wall clock, and its
    shares to 1 (from the shards' own unaccounted they added up to 52.5 s less)."""
    run = 'job_name="j", run_id="r"'
    records = {goodput.WALL: ("60 120", "60 120"), goodput_sharded.RANKS: ("7 7", "1 1")}
    totals = {"goodput": ("60 60", "60 120"), goodput.UNACCOUNTED: ("0 0", "0 0")}
    series = [{"series": f"{goodput_sharded.shard(name)}{{{run}, shard=\"{shard}\"}}",
               "values": values[shard]}
              for name, values in records.items() for shard in (0, 1)]
    series += [{"series": f"{goodput_sharded.shard(goodput.CATEGORY_TOTAL)}"
                f"{{{run}, category=\"{category}\", shard=\"{shard}\"}}", "values": values[shard]}
               for category, values in totals.items() for shard in (0, 1)]
    paths = assets.write_files(assets.sharded_rule_files(RulesConfig()), tmp_path)
    (rules,) = [p for p in paths if p.name == sharded.GLOBAL_FILE]

    def sample(name: str, category: str | None, value: float) -> dict:
        labels = f'{run}, category="{category}"' if category else run
        return {"labels": f"{name}{{{labels}}}", "value": value}
    share = goodput.SHARE_RUN
    at = f"{1 + goodput_sharded.count_late()}m"   # the samples at 1m, read that much later
    test = {"rule_files": [str(rules)], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": series,
        "promql_expr_test": [
            {"expr": goodput.WALL, "eval_time": at,
             "exp_samples": [sample(goodput.WALL, None, 120)]},
            # (7 x 60 + 120) / 8 s of goodput; unaccounted 120 less that
            {"expr": goodput.CATEGORY_TOTAL, "eval_time": at,
             "exp_samples": [sample(goodput.CATEGORY_TOTAL, "goodput", 67.5),
                             sample(goodput.CATEGORY_TOTAL, goodput.UNACCOUNTED, 52.5)]},
            {"expr": share, "eval_time": at,
             "exp_samples": [sample(share, "goodput", 0.5625),
                             sample(share, goodput.UNACCOUNTED, 0.4375)]}]}]}
    path = tmp_path / "pieces.yml"
    path.write_text(yaml.safe_dump(test, sort_keys=False, width=1000))
    done = subprocess.run([promtool(), "test", "rules", str(path)], capture_output=True,
                          text=True, timeout=TIMEOUT, env=promtool_env())
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
