"""The knobs of the rules: selectors and thresholds (`RulesConfig`), monitoring-mixin style.

    RulesConfig(stall_seconds=1800, selector='cluster="a"')
    RulesConfig(**parse_set(["stall_seconds=1800"]))     # `mfotel rules --set KEY=VALUE`
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

RUNBOOK_BASE_URL = "https://github.com/mfotel/mfotel/blob/main/prometheus/runbook.md"

_DURATION = re.compile(r"^([0-9]+(ms|s|m|h|d|w|y))+$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}


def duration_seconds(text: str) -> float:
    """Seconds of a Prometheus duration ("1h30m", "90s"); ValueError if it is not one."""
    if not isinstance(text, str) or not _DURATION.match(text):
        raise ValueError(f"{text!r} is not a Prometheus duration")
    return sum(int(n) * _UNIT_SECONDS[u] for n, u in re.findall(r"([0-9]+)(ms|s|m|h|d|w|y)", text))


@dataclass(frozen=True)
class RulesConfig:
    """Selectors and thresholds of the rules (the only knobs; the rules follow from them).

    `selector` is added to every raw metric selector, e.g. `cluster="a"` or
    `job=~"mindformers.*"`. Durations are Prometheus durations ("90s", "5m", "1h").
    """

    selector: str = ""
    runbook_base_url: str = RUNBOOK_BASE_URL
    # loss / grad norm not finite: look-back for the non-finite counters
    nonfinite_window: str = "5m"
    # the rank a non-finite loss started on is named once every rank has been scraped past
    # the job's first non-finite step (a NaN reaches the other ranks one step later), or
    # after this long
    nonfinite_settle: str = "1m"
    # a non-finite grad norm with a finite loss and no overflow (weights turning NaN) pages
    # after this long: the loss of the rank it started on is NaN at the same step, and this
    # leaves Prometheus time to scrape it (then the loss alert pages instead)
    grad_norm_nonfinite_for: str = "1m"
    # stalled: no step for max(stall_seconds, stall_step_factor x mean step interval)
    stall_seconds: int = 900
    stall_step_factor: float = 10.0
    step_interval_window: str = "1h"
    stall_for: str = "2m"
    # rank down: last status scraped within the look-back was "running" and the rank is gone
    rank_down_lookback: str = "1h"
    rank_down_for: str = "2m"
    # a rank reported status 3 (failed/stopped) within the look-back
    failed_lookback: str = "15m"
    # spikes: last value above factor x its average over the window
    loss_spike_factor: float = 1.5
    loss_spike_window: str = "30m"
    loss_spike_for: str = "2m"
    grad_norm_spike_factor: float = 5.0
    grad_norm_spike_window: str = "1h"
    grad_norm_spike_for: str = "2m"
    # throughput drop: step rate over `throughput_window` below ratio x the rate of the
    # `throughput_baseline_window` before it
    throughput_drop_ratio: float = 0.5
    throughput_window: str = "5m"
    throughput_baseline_window: str = "1h"
    throughput_drop_for: str = "10m"
    # straggler: the other ranks wait for a rank (it spends this much more of its time outside
    # the training step than the job's median rank; they wait inside theirs)
    straggler_wait_ratio: float = 0.1
    straggler_for: str = "10m"
    # the "slowest rank" of the cluster panels: the rank waited for most, once the others wait
    # for it at least this share of the time (below, every rank's excess is noise)
    slowest_wait_ratio: float = 0.01
    # overflow storm: fraction of steps with a loss-scale overflow
    overflow_storm_ratio: float = 0.5
    overflow_window: str = "5m"
    overflow_storm_for: str = "5m"
    # ranks missing: fewer ranks report than the world_size label of their rank_info, while
    # at least one rank of the job runs (one alert per job, no rank label)
    ranks_missing_for: str = "5m"
    # node agent (mfotel-instrument): a rank alive but its /metrics silent this long warns
    # (graph compilation holds the GIL for minutes); longer than rank_down_for on purpose
    rank_unresponsive_for: str = "10m"
    # loss divergence: a running rank's mean loss over the window is further than
    # tolerance x the median over the job's ranks from that median (data parallel)
    loss_divergence_window: str = "10m"
    loss_divergence_tolerance: float = 0.5
    loss_divergence_for: str = "15m"
    # step drift: a running rank more than this many seconds of training (steps behind the
    # job's leading rank / the job's step rate) behind
    step_drift_seconds: int = 120
    step_drift_for: str = "5m"
    # checkpoint too old: a running rank's last checkpoint (before its first: its start) is
    # older than max(checkpoint_max_age_seconds, factor x its configured interval), a step
    # interval turned into seconds by the step rate over the window
    checkpoint_max_age_seconds: int = 7200
    checkpoint_interval_factor: float = 3.0
    checkpoint_rate_window: str = "15m"
    checkpoint_for: str = "5m"
    # cascades (mfotel.alerting.cascade): a rank has left the healthy state when it stayed out
    # of the step while another waits inside a later one, or stayed silent, for longer than
    # max(departure_seconds, departure_step_factor x its mean step interval); how long a
    # departure is held: the first cause and what follows it (HCCL's time-out is 30 min)
    departure_seconds: int = 10
    departure_step_factor: float = 3.0
    cascade_window: str = "1h"
    # the culprit's page keeps firing this long after its expression last held (Prometheus'
    # keep_firing_for): the facts a departure is read from move between sources as the job
    # ends (a rank's series, its node agent's, the held records), and one evaluation between
    # them must not resolve the page and page again
    culprit_keep_firing_for: str = "1m"
    # goodput (mfotel.alerting.goodput): a run's account covers its life up to this long;
    # a warning when its goodput over the last hour stays below the floor for goodput_for
    goodput_run_window: str = "30d"
    goodput_floor_ratio: float = 0.6
    goodput_for: str = "15m"
    # restart storm: this many attempts within an hour each resumed from no later a step than
    # the attempt before it (no checkpoint saved in between)
    restart_storm_restarts: int = 2

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name.endswith(("_window", "_for", "_lookback", "_settle")) and \
                    not _DURATION.match(value):
                raise ValueError(f"RulesConfig.{f.name}={value!r} is not a Prometheus "
                                 "duration; use e.g. '90s', '5m', '1h'")
            if f.name.endswith(("_window", "_lookback", "_settle")) and \
                    duration_seconds(value) <= 0:
                raise ValueError(f"RulesConfig.{f.name}={value!r} must be longer than 0s: it "
                                 "is a range or an offset, and Prometheus refuses to load a "
                                 "rule file with a 0s one (every alert would be off)")
            if f.name.endswith("_factor") and not value > 1:
                raise ValueError(f"RulesConfig.{f.name}={value!r} must be > 1")
            if f.name.endswith("_ratio") and not 0 < value < 1:
                raise ValueError(f"RulesConfig.{f.name}={value!r} must be in (0, 1)")
        for name in ("stall_seconds", "step_drift_seconds", "loss_divergence_tolerance",
                     "checkpoint_max_age_seconds", "departure_seconds"):
            if not getattr(self, name) > 0:
                raise ValueError(f"RulesConfig.{name}={getattr(self, name)!r} must be > 0")
        if not (isinstance(self.restart_storm_restarts, int) and self.restart_storm_restarts >= 1):
            raise ValueError(f"RulesConfig.restart_storm_restarts={self.restart_storm_restarts!r} "
                             "must be a whole number >= 1")
        if duration_seconds(self.grad_norm_nonfinite_for) <= 0:
            raise ValueError(f"RulesConfig.grad_norm_nonfinite_for="
                             f"{self.grad_norm_nonfinite_for!r} must be longer than 0s: the "
                             "grad norm of a NaN loss's step is NaN too, and would page beside "
                             "the loss alert before Prometheus scraped the loss")
        if self.selector.strip().startswith("{") or self.selector.strip().endswith(","):
            raise ValueError(f"RulesConfig.selector={self.selector!r}: give bare matchers "
                             "without braces, e.g. 'cluster=\"a\"'")

    def m(self, name: str, *matchers: str) -> str:
        """`name{matchers, selector}`."""
        parts = [*matchers, *([self.selector] if self.selector else [])]
        return f"{name}{{{', '.join(parts)}}}" if parts else name

    def runbook_url(self, alertname: str) -> str:
        return f"{self.runbook_base_url}#{alertname.lower()}"


def parse_set(items: Sequence[str]) -> dict[str, Any]:
    """`--set KEY=VALUE` items -> RulesConfig keyword arguments (SystemExit naming the keys)."""
    fields = {f.name: f for f in dataclasses.fields(RulesConfig)}
    overrides: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or key not in fields:
            hint = ", ".join(sorted(fields))
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE with KEY one of: {hint}")
        default: Any = fields[key].default   # every RulesConfig field has one
        kind = type(default)
        try:
            overrides[key] = kind(raw)
        except ValueError:
            raise SystemExit(f"--set {item!r}: {raw!r} is not a {kind.__name__}") from None
    return overrides
