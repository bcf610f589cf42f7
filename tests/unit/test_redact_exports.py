"""Secret-named resource attributes and target labels never leave the process in clear (issue 33).

The console printed them as ***, but `/metrics` (target_info) and the file_sd file had them in
clear. A real rank process (the callback's path: config, OTEL_* variables, the rank's exporter,
its file_sd file) serves on a real socket and pushes OTLP to a real receiver; every way out
carries `***` in place of the secret's value, and the other values as they are.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from mfotel.config.redact import MASK
from tests.support.metrics import scrape
from tests.support.otlp_receiver import OtlpReceiver, points
from tests.support.users import MFOTEL
from tests.support.waiting import wait_for

SECRETS = ("hunter2-attr", "env-token", "k3y-label")
RANK = """
import json, sys
from mfotel.cluster.rank_setup import set_up_rank
from mfotel.config import parse_config
from mfotel.config.otel_env import resolve_otel_env
from mfotel.identity import RankIdentity
from mfotel.rank_exporter import rank_exporter
cfg = resolve_otel_env(parse_config(json.loads(sys.argv[1]))).config    # as the callback
identity = RankIdentity()
exporter = rank_exporter(cfg, identity, cfg.job_name)
set_up_rank(cfg, identity, cfg.job_name, cfg.prometheus.port, True, "http")
print("ready", flush=True)
sys.stdin.read()                                   # until the test is done
exporter.shutdown()
"""


def test_secret_named_attributes_reach_target_info_otlp_and_file_sd_masked(tmp_path, port):
    targets = tmp_path / "targets" / "{job_name}.json"
    config = {"job_name": "sec-job", "prometheus": {"host": "127.0.0.1", "port": port},
              "resource_attributes": {"db.password": "hunter2-attr", "team": "nlp"},
              "file_sd": {"path": str(targets), "labels": {"api_key": "k3y-label",
                                                           "cluster": "a"}}}
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["OTEL_RESOURCE_ATTRIBUTES"] = "deploy.token=env-token,site=lab"
    with OtlpReceiver() as receiver:
        config["otlp"] = {"endpoint": receiver.url, "interval_seconds": 1}
        rank = subprocess.Popen([sys.executable, "-c", RANK, json.dumps(config)], env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            assert rank.stdout is not None and rank.stdout.readline() == "ready\n", \
                rank.communicate()
            body = scrape(f"http://127.0.0.1:{port}/metrics")
            wait_for(lambda: receiver.requests, 30, message="an OTLP push", alive=[rank])
            pushed = [point.resource for request in receiver.requests
                      for point in points(request)]
            written = Path(str(targets).format(job_name="sec-job")).read_text()
        finally:
            _, err = rank.communicate("", timeout=60)
    assert rank.returncode == 0, err

    (target_info,) = [s.labels for f in text_string_to_metric_families(body)
                      for s in f.samples if s.name == "target_info"]
    assert target_info["db_password"] == MASK and target_info["deploy_token"] == MASK
    assert (target_info["team"], target_info["site"], target_info["job_name"]) == \
        ("nlp", "lab", "sec-job")

    assert pushed and all(r["db.password"] == MASK and r["deploy.token"] == MASK
                          and r["team"] == "nlp" and r["site"] == "lab" for r in pushed)

    assert json.loads(written) == [{"targets": [f"127.0.0.1:{port}"],
                                    "labels": {"api_key": MASK, "cluster": "a"}}]
    for secret in SECRETS:
        assert secret not in body and secret not in written and secret not in err
        assert all(secret not in json.dumps(r) for r in pushed)


def test_mfotel_targets_writes_secret_named_labels_masked(tmp_path):
    out = tmp_path / "sd" / "job.yaml"
    done = subprocess.run([MFOTEL, "targets", "--hosts", "n1", "--ranks-per-node", "1",
                           "--label", "auth_token=s3cret", "--label", "cluster=a",
                           "--out", str(out)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done
    assert out.read_text() == ("- targets:\n  - n1:9464\n  labels:\n    auth_token: '***'\n"
                               "    cluster: a\n")
    assert "s3cret" not in done.stdout + done.stderr
