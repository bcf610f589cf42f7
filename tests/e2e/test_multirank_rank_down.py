"""Killing one rank mid-run fires MindFormersRankDown for that rank only; the job short of a
rank is that page's consequence, not a MindFormersRanksMissing of its own (real Prometheus,
the shipped rules).

msrun tears the whole job down as soon as one worker dies (measured: the other rank is gone
within a second), so here the two ranks are independent training processes of
examples/multirank/train_dp.py (RANK_ID 0 and 1 of a 2-rank job, no collective): one can die
while the other keeps training. Prometheus finds them through a file_sd file written by
`python -m mfotel.cluster.discovery` (`mfotel targets`), as a launcher would.
"""
from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time

import pytest

from mfotel.alerting.rules import RulesConfig, write_rules
from mfotel.localstack.servers import Prometheus
from tests.support.multirank import (
    EXAMPLE,
    child_env,
    free_port_block,
    start,
    stop,
)
from tests.support.prometheus import INTERVAL, prometheus_config
from tests.support.waiting import settle, startup, wait_for

pytestmark = pytest.mark.slow

JOB = "mfotel-rank-down"


def test_killed_rank_fires_rank_down_for_that_rank_only(tmp_path):
    base = free_port_block(2)
    targets = tmp_path / "targets" / "job.json"
    cli = subprocess.run([sys.executable, "-m", "mfotel.cluster.discovery", "--hosts", "127.0.0.1",
                          "--ranks-per-node", "2", "--port", str(base), "--label", "cluster=ci",
                          "--out", str(targets)], capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0, cli.stderr
    assert json.loads(targets.read_text()) == [
        {"targets": [f"127.0.0.1:{base}", f"127.0.0.1:{base + 1}"], "labels": {"cluster": "ci"}}]
    # both alerts fire on their first true evaluation (no `for`)
    # no `for`: RankDown fires at the first evaluation after the scrape that finds rank 1 gone
    rules = write_rules(tmp_path, RulesConfig(rank_down_for="0s", ranks_missing_for="0s"))
    prom = Prometheus(prometheus_config(rule_files=[r.name for r in rules],
                                        targets_glob=str(tmp_path / "targets" / "*.json")),
                      rule_files=rules, workdir=tmp_path / "prom")
    ranks = {}
    with prom:
        try:
            for rank in (0, 1):
                env = child_env(RANK_ID=str(rank), RANK_SIZE="2", LOCAL_RANK=str(rank),
                                LOCAL_WORLD_SIZE="2")
                ranks[rank] = start([sys.executable, str(EXAMPLE), "--steps", "3000",
                                     "--step-sleep", "0.2", "--port", str(base),
                                     "--job-name", JOB], env, tmp_path / f"rank{rank}.log",
                                    tmp_path)
            running = f'mindformers_train_status{{job_name="{JOB}", cluster="ci"}} == 1'
            wait_for(lambda: len(prom.query(running)) == 2, startup() + settle(INTERVAL),
                     message="both ranks running in Prometheus", alive=[ranks[1]])
            ranks[1].send_signal(signal.SIGKILL)
            killed_at = time.time()
            ranks[1].wait(timeout=30)
            firing = 'ALERTS{alertname="MindFormersRankDown", alertstate="firing"}'
            alerts = wait_for(lambda: prom.query(firing), settle(INTERVAL, INTERVAL),
                              message="MindFormersRankDown firing", alive=[ranks[0]])
            labels = [a["metric"] for a in alerts]
            assert [(a["rank"], a["job_name"], a["severity"], a["instance"]) for a in labels] == \
                [("1", JOB, "critical", f"127.0.0.1:{base + 1}")]
            # rank 0 kept running and was never reported down
            assert [r["metric"]["instance"] for r in prom.query('up{job="mfotel"} == 1')] == \
                [f"127.0.0.1:{base}"]
            assert prom.query(f'{running.replace(" == 1", "")} == 1')[0]["metric"]["rank"] == "0"
            assert prom.query('count_over_time(ALERTS{alertname="MindFormersRankDown", '
                              'rank="0"}[5m])') == []
            # the job is short of rank 1, which its own page names: no second page (since the
            # kill: with no `for`, a rank that starts a scrape later than the other is missing
            # for a moment, which is that alert's job)
            time.sleep(3 * INTERVAL)
            since_kill = math.ceil(time.time() - killed_at)
            assert prom.query(f'count_over_time(ALERTS{{alertname="MindFormersRanksMissing"}}'
                              f'[{since_kill}s])') == []
            assert float(prom.query(f'job_name:mindformers_train_ranks_reporting:count'
                                    f'{{job_name="{JOB}"}}')[0]["value"][1]) == 1
        finally:
            for process in ranks.values():
                stop(process)
