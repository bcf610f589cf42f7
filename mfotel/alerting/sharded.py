"""The rules split for a job sharded across Prometheus servers (docs/scaling.md, section 7).

When one job's targets are split over several Prometheus servers (`hashmod` of the address,
as the Prometheus Operator's `shards:` does), no server sees all of a job's ranks. The rules
then run in two parts:

- the scraper part (`SCRAPER_FILE`), on every Prometheus shard: what needs one target's series
  only (a rank's own recording rules, its status, its non-finite counters, per-target alerts),
  a heartbeat and the ranks each shard holds, and the alerts on the global layer's own health;
- the global part (`GLOBAL_FILE`), evaluated once by a ruler over the merged store (`vmalert`
  over VictoriaMetrics): what compares ranks (job medians, the rank waited for, the NaN
  origin, ranks missing, the cascade's culprit, job throughput, goodput), and the shards'
  health. Every shard's samples reach the store with its external label `shard`.

A shard that stops (its heartbeat gone) pages once, as `MindFormersScraperDown`, naming it and
the share of each job it held; the ranks it held are left out of the departures, the stall
and the missing-rank count (`UNSEEN`), so they never page as hundreds of ranks down.

    render_sharded_rules(RulesConfig(stall_seconds=60))   # {file name: YAML text}
"""
from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from . import goodput, rule_health
from .cascade import (
    CULPRIT,
    DEPARTURES,
    DEPARTURES_FRESH,
    FIRST,
    SCRAPED,
    STALLED,
    outside_record,
    stalled_ranks,
)
from .goodput_sharded import global_goodput_alerts, global_goodput_records, shard_goodput_records
from .promql import alert, indent, step_interval_record
from .rules import (
    GRAD_NORM_FINITE,
    IN_STEP,
    LOSS_FINITE,
    OUTSIDE_SHARE,
    STEP_MEAN,
    STEP_RANK_QUANTILE,
    RulesConfig,
    _dump,
    alerting_rules,
    duration_seconds,
    loss_mean_record,
    recording_rules,
)

SCRAPER_FILE = "mindformers-scraper.yml"
#: The global ruler's evaluation interval the rules are written for (the shipped 15s), and
#: how long it takes its records to reach the store (vmalert -remoteWrite.flushInterval).
RULER_INTERVAL = "15s"
RULER_FLUSH_SECONDS = 1.0
#: How long the store takes to serve a series it did not hold before (VictoriaMetrics 1.79 on
#: loopback: 8-10 s; a new sample of a series it holds, ~2 s). An incident's records (its
#: departures, its culprit) are new series: each link of the global chain waits that long.
STORE_NEW_SERIES_SECONDS = 10.0
GLOBAL_FILE = "mindformers-global.yml"
#: The external label each shard's samples carry into the store (its `global.external_labels`).
SHARD_LABEL = "shard"
#: The target label of the global layer's own components, scraped by every shard.
COMPONENT_LABEL = "mfotel_component"
COMPONENTS = ("global-ruler", "store")
_UNEVALUATED = ("the rules that compare a job's ranks (stragglers, the NaN origin, the culprit of "
                "a hang or a dead rank, ranks missing, throughput, goodput) are not evaluated")
#: The shards' alerts on the global layer: (alert, component, summary, what it means).
GLOBAL_LAYER_ALERTS = (
    ("MindFormersGlobalRulerDown", "global-ruler",
     "The global ruler of a sharded topology does not answer.", _UNEVALUATED),
    ("MindFormersStoreDown", "store",
     "The store of a sharded topology does not answer.",
     "the shards' samples queue in their remote_write and " + _UNEVALUATED),
)

#: Recorded on every shard: 1 while it evaluates (gone with it), and the ranks it holds per job.
HEARTBEAT = "shard:mfotel_scraper_up:bool"
SHARD_RANKS = "shard_job_name:mfotel_scraper_ranks:count"
#: Recorded globally: shards whose heartbeat stopped, and the ranks last seen through them.
SHARD_DOWN = "shard:mfotel_scraper_down:bool"
UNSEEN = "job_name_rank:mfotel_rank_scraper_down:bool"
#: A rank last scraped this long before its stopped shard's last scrape of any rank went
#: with the shard (longer than a scrape interval); one that vanished earlier left on its own.
WENT_WITH_SHARD = "1m"
#: The condition of a culprit page kept firing (`page`: the alert), recorded globally.
KEPT = "job_name_rank:mfotel_culprit_page:condition"

def scraper_records(cfg: RulesConfig) -> frozenset[str]:
    """Recording rules of one target's series only (a rank's own): evaluated on every shard."""
    return frozenset({STEP_MEAN, STEP_RANK_QUANTILE, step_interval_record(cfg), OUTSIDE_SHARE,
                      IN_STEP, LOSS_FINITE, GRAD_NORM_FINITE, loss_mean_record(cfg),
                      outside_record(cfg), SCRAPED})


#: Alerts on one target's series only (a rank's, or its node agent's), and on the rule
#: evaluators' own metrics (each shard's, and the global ruler's it scrapes).
SCRAPER_ALERTS = frozenset({
    "MindFormersTrainingFailed", "MindFormersLossSpike", "MindFormersGradNormSpike",
    "MindFormersLossScaleOverflowStorm", "MindFormersCheckpointTooOld",
    "MindFormersRankUnresponsive", *rule_health.ALERTS})


def _name(rule: dict[str, Any]) -> str:
    return rule.get("record") or rule["alert"]


def is_scraper_rule(rule: dict[str, Any], cfg: RulesConfig) -> bool:
    """Whether `rule` (of the unsharded rules) needs one target's series only."""
    return rule.get("record") in scraper_records(cfg) or rule.get("alert") in SCRAPER_ALERTS


def _split(groups: list[dict[str, Any]], cfg: RulesConfig, scraper: bool
           ) -> list[dict[str, Any]]:
    """`groups` keeping the rules of one part (groups left empty dropped)."""
    kept = []
    for group in groups:
        rules = [r for r in group["rules"] if is_scraper_rule(r, cfg) == scraper]
        if rules:
            kept.append({**group, "rules": rules})
    return kept


# ---------------------------------------------------------------- the shards' health
def scraper_meta(cfg: RulesConfig) -> list[dict[str, Any]]:
    """What every shard records about itself, and its alerts on the global layer's health."""
    status = cfg.m("mindformers_train_status")
    return [
        {"name": "mfotel-scraper.rules", "rules": [
            {"record": HEARTBEAT, "expr": "vector(1)"},
            {"record": SHARD_RANKS,
             "expr": f"count by (job_name) (max by (job_name, rank) ({status}))"}]},
        {"name": "mfotel-scraper.alerts", "rules": [
            alert(cfg, name, f'up{{{COMPONENT_LABEL}="{component}"}} == 0',
                  cfg.rank_down_for, "critical", summary,
                  "{{ $labels.mfotel_component }} ({{ $labels.instance }}) has not answered "
                  "the shards' scrapes for " + cfg.rank_down_for + f": {what}. Per-rank "
                  "alerts still page from the shards.")
            for name, component, summary, what in GLOBAL_LAYER_ALERTS]},
    ]


def global_meta(cfg: RulesConfig) -> list[dict[str, Any]]:
    """Shards whose heartbeat stopped, the ranks they held, and the shard's page."""
    lookback = cfg.rank_down_lookback
    share = (f"last_over_time({SHARD_RANKS}{{{SHARD_LABEL}='%s'}}[{lookback}]) / on (job_name) "
             f"group_left () sum by (job_name) (last_over_time({SHARD_RANKS}[{lookback}]))")
    jobs = ("{{ range printf \"" + share + "\" $labels." + SHARD_LABEL + " | query }} job "
            "{{ .Labels.job_name }}: {{ .Value | humanizePercentage }} of its ranks;{{ end }}")
    return [{"name": "mfotel-topology.rules", "rules": [
        {"record": SHARD_DOWN,
         "expr": f"max by ({SHARD_LABEL}) (last_over_time({HEARTBEAT}[{lookback}]))\n"
                 f"unless on ({SHARD_LABEL}) max by ({SHARD_LABEL}) ({HEARTBEAT})"},
        # the ranks a stopped shard still scraped near its end (within WENT_WITH_SHARD of its
        # last scrape of any rank); a rank that vanished before, as an incident's culprit, left
        # while the shard still sent: its departure stands
        {"record": UNSEEN,
         "expr": f"max by (job_name, rank) (\n  last_over_time({SCRAPED}[{lookback}])\n"
                 f"  >= on ({SHARD_LABEL}) group_left ()\n"
                 f"  (max by ({SHARD_LABEL}) (last_over_time({SCRAPED}[{lookback}])) - "
                 f"{duration_seconds(WENT_WITH_SHARD):g})\n"
                 f"  and on ({SHARD_LABEL}) {SHARD_DOWN}\n) * 0 + 1"},
    ]}, {"name": "mfotel-topology.alerts", "rules": [
        alert(cfg, "MindFormersScraperDown",
              f"sum by ({SHARD_LABEL}) (last_over_time({SHARD_RANKS}[{lookback}]))\n"
              f"and on ({SHARD_LABEL}) {SHARD_DOWN}\nor\n{SHARD_DOWN} * 0",
              cfg.rank_down_for, "critical", "A Prometheus shard stopped scraping.",
              "Shard {{ $labels.shard }} has sent nothing to the store for "
              f"{cfg.rank_down_for}: the {{{{ $value }}}} rank(s) it scraped are not "
              "monitored:" + jobs + " their own pages (a rank down, ranks missing, a stall) "
              "stay quiet until it is back; the other shards' ranks are paged as before.")]}]


# ---------------------------------------------------------------- shard-aware global rules
#: The culprit's pages for a rank that left for good (mfotel.alerting.cascade).
NEW_CULPRIT_PAGES = ("MindFormersRankDown", "MindFormersRankExited", "MindFormersRankFailed")


def _without_unseen(expr: str) -> str:
    return f"(\n{indent(expr)}\n)\nunless on (job_name, rank) {UNSEEN}"


def _replace_once(text: str, old: str, new: str, where: str) -> str:
    if old not in text:
        raise AssertionError(f"{where}: the generated rule no longer holds {old[:60]!r}...; "
                             "update mfotel/alerting/sharded.py with the generator")
    return text.replace(old, new)


def _kept_firing(rule: dict[str, Any]) -> list[dict[str, Any]]:
    """`rule`, or for an alert with `keep_firing_for` (vmalert 1.79 refuses it) a record of
    its condition (labelled `page`) and the alert on the record's last value within that
    long: it keeps firing as long after its condition last held."""
    keep = rule.get("keep_firing_for")
    if keep is None:
        return [rule]
    name = rule["alert"]
    record = {"record": KEPT, "expr": rule["expr"], "labels": {"page": name}}
    alert = {k: v for k, v in rule.items() if k != "keep_firing_for"}
    alert["expr"] = (f'label_replace(\n  last_over_time({KEPT}{{page="{name}"}}[{keep}]),\n'
                     f'  "page", "", "", ""\n)')
    return [record, alert]


def _shard_aware(rule: dict[str, Any], cfg: RulesConfig, stall_gate: float) -> dict[str, Any]:
    """The global part's rule: ranks of a stopped shard neither depart nor stall nor go
    missing; the stall counts `stall_gate` seconds more."""
    rule = dict(rule)
    name = _name(rule)
    if name == DEPARTURES_FRESH:
        # a stopped shard's ranks leave no new departure; those held before it stopped stay,
        # so an incident it held keeps its culprit and its page
        rule["expr"] = _without_unseen(rule["expr"])
    elif name == DEPARTURES:
        # a rank whose series left the store with its shard's, before the shard's heartbeat
        # did (their staleness may differ by a scrape), did not vanish: held, that would end
        # the culprit it is (its page resolved, then the job's others paged again)
        rule["expr"] = (f"{rule['expr']}\nunless on (job_name, rank, how)\n"
                        f'label_replace({UNSEEN}, "how", "vanished", "", "")')
    elif name in NEW_CULPRIT_PAGES:
        # ranks whose series vanished with their shard before its heartbeat did (the
        # store's staleness of the two may differ by a scrape) are not culprits
        rule["expr"] = f"{rule['expr']}\nunless on (job_name, rank) {UNSEEN}"
    elif name == "MindFormersTrainingStalled":
        # the culprit comes through a chain of records, each read an evaluation later: the
        # stall waits that long, so that the culprit's ranks are there when it counts (else
        # the job's page first, or its ranks in two notifications)
        # (inline, not the STALLED record: a record would add its own lag to the chain)
        later = replace(cfg, stall_for=f"{duration_seconds(cfg.stall_for) + stall_gate:g}s")
        gated = f"{stalled_ranks(later)}\nunless on (job_name, rank) {UNSEEN}"
        rule["expr"] = _replace_once(rule["expr"], STALLED, indent(gated, "    ").strip(), name)
    elif name == "MindFormersThroughputDrop":
        # a job whose rank left the healthy state has its culprit's page coming (one
        # Prometheus has it in time for Alertmanager to mute this warning; vmalert later)
        rule["expr"] = f"{rule['expr']}\nunless on (job_name) {FIRST}"
    elif name == "MindFormersRanksMissing":
        rule["expr"] = f"{rule['expr']}\nunless on (job_name) {UNSEEN}"
    return rule


GOODPUT_RULES = "mindformers-goodput.rules"
GOODPUT_ALERTS = "mindformers-goodput.alerts"


def _goodput(groups: list[dict[str, Any]], cfg: RulesConfig) -> list[dict[str, Any]]:
    """`groups` (of the global part) with the goodput groups' rules replaced by the ones
    combining the shards' accounts (mfotel.alerting.goodput_sharded)."""
    replaced = {GOODPUT_RULES: global_goodput_records, GOODPUT_ALERTS: global_goodput_alerts}
    return [{**g, "rules": replaced[g["name"]](cfg)} if g["name"] in replaced else g
            for g in groups]


def scraper_groups(cfg: RulesConfig) -> list[dict[str, Any]]:
    # goodput's chain over the shard's own ranks (the unsharded goodput group has no rule of
    # one target's series: _split leaves it out)
    shard_goodput = [{"name": GOODPUT_RULES, "interval": goodput.INTERVAL,
                      "rules": shard_goodput_records(cfg)}]
    return [*_split(recording_rules(cfg), cfg, True), *shard_goodput,
            *_split(alerting_rules(cfg), cfg, True), *scraper_meta(cfg)]


def global_groups(cfg: RulesConfig, ruler_interval: str | None = RULER_INTERVAL
                  ) -> list[dict[str, Any]]:
    """The global part, for a ruler evaluating every `ruler_interval` (None: as if it read
    its own records at once)."""
    gate = 0.0 if ruler_interval is None else stall_gate_seconds(cfg, ruler_interval)
    groups = _goodput([*global_meta(cfg), *_split(recording_rules(cfg), cfg, False),
                       *_split(alerting_rules(cfg), cfg, False)], cfg)
    # (the stall alert holds its ranks inline: _shard_aware)
    return [{**g, "rules": [kept for r in g["rules"] if r.get("record") != STALLED
                            for kept in _kept_firing(_shard_aware(r, cfg, gate))]}
            for g in groups]


def record_lag_seconds(ruler_interval: float) -> float:
    """How long after an evaluation the ruler can read a new series it recorded there: its
    flush, the store's delay for a new series, and the next evaluation."""
    return ruler_interval + RULER_FLUSH_SECONDS + STORE_NEW_SERIES_SECONDS


def stall_gate_seconds(cfg: RulesConfig, ruler_interval: str) -> float:
    """How much longer the global part counts a stall: the culprit comes through a chain of
    new records, each read `record_lag_seconds` later (and one more link to spare); a rank
    waited for departs `departure_seconds` after it stopped, so the stall's own threshold
    gives the chain that long already."""
    lag = (global_depths(cfg)[CULPRIT] + 1) * record_lag_seconds(
        duration_seconds(ruler_interval))
    head_start = cfg.stall_seconds + duration_seconds(cfg.stall_for) - cfg.departure_seconds
    return max(0.0, lag - head_start)


def render_sharded_rules(cfg: RulesConfig | None = None,
                         ruler_interval: str = RULER_INTERVAL) -> dict[str, str]:
    """File name -> YAML text of the scraper and global rule files."""
    cfg = cfg or RulesConfig()
    return {SCRAPER_FILE: _dump(scraper_groups(cfg), cfg),
            GLOBAL_FILE: _dump(global_groups(cfg, ruler_interval), cfg)}


_RECORDED = re.compile(r"\b[a-zA-Z_][a-zA-Z0-9_]*:[a-zA-Z0-9_:]*[a-zA-Z0-9_]\b")


def recorded_names_read(groups: list[dict[str, Any]]) -> set[str]:
    """The recorded series (names with a colon) the rules of `groups` read, in their
    expressions and their annotations' queries."""
    found: set[str] = set()
    for group in groups:
        for rule in group["rules"]:
            texts = [rule["expr"], *rule.get("annotations", {}).values()]
            found |= {m for text in texts for m in _RECORDED.findall(text)}
    return found


def recorded_names(groups: list[dict[str, Any]]) -> set[str]:
    return {r["record"] for g in groups for r in g["rules"] if "record" in r}



def global_depths(cfg: RulesConfig) -> dict[str, int]:
    """For each rule of the global part, how many of the part's own records it reads one
    after another (a record read the evaluation it is written in, in Prometheus; a ruler that
    writes its records to a remote store reads each one evaluation later)."""
    groups = global_groups(cfg, None)
    own = recorded_names(groups)
    depth: dict[str, int] = {}
    for _ in range(20):   # to a fixed point: a record may read one defined below it
        changed = False
        for rule in (r for g in groups for r in g["rules"]):
            name = _name(rule)
            read = (set(_RECORDED.findall(rule["expr"])) & own) - {name}
            value = 1 + max((depth.get(r, 0) for r in read), default=0) if read else 0
            if depth.get(name, -1) < value:
                depth[name], changed = value, True
        if not changed:
            return depth
    raise AssertionError("the global records read each other in a cycle")
