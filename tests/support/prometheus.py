"""A real Prometheus for the tests: configs that scrape ranks every second with the generated
rules at test thresholds, and what its alerts say once a run ended."""
from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

from mfotel.alerting.rules import RulesConfig, write_rules
from mfotel.localstack.servers import Prometheus

#: The scrape and rule-evaluation interval of every test Prometheus (seconds).
INTERVAL = 1.0
#: The shipped rules with `for` durations short enough to watch: a rank that vanished while
#: running pages 5 s later, a running rank without a step for 5 s is stalled.
RANK_DOWN_FOR = 5.0
TEST_RULES = RulesConfig(rank_down_for=f"{RANK_DOWN_FOR:.0f}s",
                         ranks_missing_for=f"{RANK_DOWN_FOR:.0f}s", stall_seconds=5,
                         stall_for="0s")
#: The alerts about a rank's status; none may fire for a run that ended normally or cancelled
#: (dynamics alerts such as a loss spike of the toy regression are not about its end).
STATUS_ALERTS = {"MindFormersRankDown", "MindFormersTrainingStalled", "MindFormersRanksMissing",
                 "MindFormersTrainingFailed"}
#: How long "pages nobody" is watched after the process exited: RankDown's `for`, plus the
#: scrape that finds the target gone, plus two evaluations, plus a few seconds of slack.
QUIET_WINDOW = RANK_DOWN_FOR + 3 * INTERVAL + 4.0


def prometheus_config(targets: Sequence[str] = (), rule_files: Sequence[str] = (),
                      targets_glob: str | None = None, job: str = "mfotel") -> str:
    """Scrape `targets` (or the file_sd files matching `targets_glob`) and evaluate
    `rule_files` every INTERVAL."""
    rules = "".join(f"\n  - {name}" for name in rule_files)
    discovery = (f"    file_sd_configs:\n      - files: [\"{targets_glob}\"]\n"
                 f"        refresh_interval: {INTERVAL:.0f}s\n" if targets_glob else
                 f"    static_configs:\n      - targets: {json.dumps(list(targets))}\n")
    return (f"global:\n  scrape_interval: {INTERVAL:.0f}s\n"
            f"  evaluation_interval: {INTERVAL:.0f}s\n  scrape_timeout: {INTERVAL:.0f}s\n"
            f"rule_files:{rules or ' []'}\nscrape_configs:\n  - job_name: {job}\n{discovery}")


def rules_prometheus(workdir: Path, targets: Sequence[str], rules: RulesConfig = TEST_RULES
                     ) -> Prometheus:
    """A Prometheus (start it with `with`) scraping `targets` with the rules `rules` generates."""
    files = write_rules(workdir / "rules", rules)
    return Prometheus(prometheus_config(targets, [path.name for path in files]),
                      rule_files=files, workdir=workdir / "prom")


def alerts_until_quiet(prom: Prometheus, job_name: str, exited_at: float | None,
                       lookback: str = "5m") -> list[dict]:
    """Every status or critical alert (pending or firing) of `job_name`, polled until
    QUIET_WINDOW after the process exited, plus any the history of ALERTS still holds."""
    seen: list[dict] = []
    assert exited_at is not None
    while time.time() < exited_at + QUIET_WINDOW:
        seen += [alert["metric"] for alert in prom.query(f'ALERTS{{job_name="{job_name}"}}')]
        time.sleep(0.25)
    history = prom.query(f'count_over_time(ALERTS{{job_name="{job_name}"}}[{lookback}])')
    return [alert for alert in seen + [alert["metric"] for alert in history]
            if (alert["alertname"] in STATUS_ALERTS or alert["severity"] == "critical")
            and not _ending_job_short_of_a_rank(alert)]


def _ending_job_short_of_a_rank(alert: dict) -> bool:
    """RanksMissing pending, not firing: the ranks of a cancelled job report and exit seconds
    apart (further apart on a loaded machine), and the job is short of a rank meanwhile. The
    rule is built to wait that out (its `for:`; the promtool test "a cancelled job pages
    nobody, even when its ranks stop minutes apart"); firing still counts."""
    return alert["alertname"] == "MindFormersRanksMissing" \
        and alert.get("alertstate") == "pending"


def value_of(result: list[dict]) -> list[float]:
    """The values of an instant query's result."""
    return [float(r["value"][1]) for r in result]
