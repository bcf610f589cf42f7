"""Actions without MindSpore: config, the plateau rule, the control files, rank agreement, alerts.

Ranks are simulated by several ActionEngine instances sharing one real control directory.
"""
from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mfotel.actions.control import (
    CONTROL_FILE,
    SCHEDULE_FILE,
    AlertControl,
    FileWatch,
    Request,
    job_dir_for,
    main,
    new_request,
    write_request,
)
from mfotel.actions.engine import ActionEngine, Plateau
from mfotel.alerting.receiver import AlertsReceiver, ReceivedAlert
from mfotel.config import ConfigError, PlateauRule, parse_config
from mfotel.endpoint.auth import Credentials
from mfotel.localstack.servers import free_port
from tests.support import http
from tests.support.http import bearer
from tests.support.waiting import startup, wait_for


def actions_cfg(**actions):
    return parse_config({"actions": actions}).actions


# ---------------------------------------------------------------- config
def test_actions_section_parses_with_defaults():
    cfg = actions_cfg(plateau={"patience": 3, "action": "scale_lr", "factor": 0.1},
                      nonfinite={}, control_dir="/shared/ctl/{job_name}")
    assert cfg.plateau == PlateauRule(action="scale_lr", factor=0.1, patience=3, min_delta=0.0)
    assert cfg.nonfinite.action == "stop" and cfg.lead_steps == 3
    assert cfg.resolved_control_dir("llama") == Path("/shared/ctl/llama")
    assert cfg.enabled and cfg.may_scale_lr
    assert not parse_config({}).actions.enabled


@pytest.mark.parametrize("actions, key, words", [
    ({"plateau": {"patiense": 3}}, "actions.plateau.patiense", "did you mean 'patience'"),
    ({"plateau": {"factor": 0.5}}, "actions.plateau.factor", "set action: scale_lr"),
    ({"plateau": {"patience": 0}}, "actions.plateau.patience", "whole number >= 1"),
    ({"plateau": {"min_delta": -1}}, "actions.plateau.min_delta", "number >= 0"),
    ({"nonfinite": {"action": "halt"}}, "actions.nonfinite.action", "stop, scale_lr, warn"),
    ({"nonfinite": {"action": "scale_lr", "factor": 0}}, "actions.nonfinite.factor", "positive"),
    ({"control_dir": "/ctl/{rank}"}, "actions.control_dir", "only {job_name}"),
    ({"lead_steps": 0}, "actions.lead_steps", "between 1 and 100000"),
    ({"stop_on": "nan"}, "actions.stop_on", "known keys"),
])
def test_bad_actions_name_key_and_fix(actions, key, words):
    with pytest.raises(ConfigError) as info:
        parse_config({"actions": actions}, source="train.yaml")
    assert info.value.key == f"monitor_config.{key}"
    assert words in str(info.value) and "train.yaml" in str(info.value)


def test_on_nonfinite_stop_and_nonfinite_rule_conflict():
    with pytest.raises(ConfigError, match="keep actions.nonfinite"):
        parse_config({"on_nonfinite": "stop", "actions": {"nonfinite": {"action": "warn"}}})


# ---------------------------------------------------------------- plateau
@pytest.mark.parametrize("losses, patience, min_delta, fires", [
    ([5, 4, 3, 2, 1], 2, 0.0, []),                          # always improving
    ([5, 5, 5, 5, 5], 2, 0.0, [2, 4]),                      # flat: every `patience` records
    ([5, 4.9, 4.8, 4.7], 3, 0.5, [3]),                      # improving, but less than min_delta
    ([5, 6, 4, 6, 6, 6], 3, 0.0, [5]),                      # an improvement resets the count
    ([5, math.nan, math.inf, None, 5, 5], 2, 0.0, [5]),     # NaN/Inf/None are not records
])
def test_plateau_fires_after_patience_records_without_improvement(losses, patience, min_delta,
                                                                  fires):
    rule = Plateau(PlateauRule(patience=patience, min_delta=min_delta))
    assert [i for i, loss in enumerate(losses) if rule.update(loss)] == fires


# ---------------------------------------------------------------- control files
def test_request_validation():
    assert new_request("scale_lr", 0.5).factor == 0.5
    assert new_request("stop", 0.5).factor is None
    for action, factor in (("halt", None), ("scale_lr", None), ("scale_lr", -1),
                           ("scale_lr", math.inf), ("scale_lr", True)):
        with pytest.raises(ValueError):
            new_request(action, factor)
    with pytest.raises(ValueError, match="source"):
        new_request("stop", source="cron")
    with pytest.raises(ValueError, match="no id"):
        Request.from_json({"action": "stop"})


def test_cli_writes_the_request_atomically(tmp_path, capsys):
    assert main([str(tmp_path), "--scale-lr", "0.25", "--reason", "flat"]) == 0
    data = json.loads((tmp_path / CONTROL_FILE).read_text())
    assert (data["action"], data["factor"], data["source"], data["reason"]) == \
        ("scale_lr", 0.25, "control", "flat")
    assert data["id"] in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == [CONTROL_FILE]  # no temp file left
    assert main([str(tmp_path), "--show"]) == 0
    assert '"factor": 0.25' in capsys.readouterr().out


def test_cli_errors(tmp_path, capsys):
    assert main([str(tmp_path / "missing"), "--stop"]) == 2
    assert "not a control directory" in capsys.readouterr().err
    assert main([str(tmp_path), "--scale-lr", "-2"]) == 2
    assert "positive factor" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--stop", "--scale-lr", "0.5"])  # one action at a time


def test_cli_as_a_module(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mfotel.actions.control", str(tmp_path), "--stop"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / CONTROL_FILE).read_text())["action"] == "stop"


def test_file_watch_reads_only_changes(tmp_path):
    watch = FileWatch(tmp_path / CONTROL_FILE)
    assert watch.poll() == (False, None)
    write_request(tmp_path, Request("a", "stop"))
    changed, data = watch.poll()
    assert changed and data["id"] == "a"
    assert watch.poll() == (False, None)
    write_request(tmp_path, Request("b", "stop"))
    assert watch.poll()[1]["id"] == "b"
    (tmp_path / CONTROL_FILE).write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        watch.poll()


# ---------------------------------------------------------------- engines as ranks
def ranks(tmp_path, world: int, **actions) -> list[ActionEngine]:
    cfg = actions_cfg(control_dir=str(tmp_path / "{job_name}"), **actions)
    engines = [ActionEngine(cfg, "job", rank, world) for rank in range(world)]
    for engine in engines:  # rank 0 creates the directory
        engine.start()
    return engines


def run_steps(engines, steps, losses=None, order=None, between=None):
    """Step every rank through `steps`; returns {rank: [(step, action, source), ...]}."""
    applied = {e.rank: [] for e in engines}
    for step in steps:
        if between:
            between(step)
        for engine in (order(step) if order else engines):
            loss = losses(engine.rank, step) if losses else 1.0
            for r in engine.step_end(step, loss, True):
                applied[engine.rank].append((step, r.action, r.source))
    return applied


def test_single_rank_applies_a_control_request_at_the_next_step(tmp_path):
    (engine,) = ranks(tmp_path, 1)
    job_dir = tmp_path / "job"
    applied = run_steps([engine], range(1, 8),
                        between=lambda s: s == 4 and main([str(job_dir), "--stop"]))
    assert applied == {0: [(4, "stop", "control")]}
    assert engine.counts[("stop", "control")] == 1 and engine.counts[("scale_lr", "control")] == 0
    (scheduled,) = json.loads((job_dir / SCHEDULE_FILE).read_text())["actions"]
    assert scheduled["step"] == 4


@pytest.mark.parametrize("order", ["rank0-first", "rank0-last"])
def test_all_ranks_apply_at_the_step_rank0_scheduled(tmp_path, order):
    engines = ranks(tmp_path, 4, lead_steps=2)
    job_dir = tmp_path / "job"
    arrange = (lambda s: engines) if order == "rank0-first" else (lambda s: engines[::-1])
    applied = run_steps(engines, range(1, 12), order=arrange,
                        between=lambda s: s == 5 and main([str(job_dir), "--stop"]))
    assert set(map(tuple, applied.values())) == {((7, "stop", "control"),)}
    assert all(e.counts[("stop", "control")] == 1 for e in engines)


def test_only_rank0_decides_local_rules(tmp_path):
    # rank 1 sees a NaN loss and a plateau first; only rank 0's losses count
    engines = ranks(tmp_path, 2, lead_steps=3, nonfinite={"action": "warn"},
                    plateau={"patience": 2})
    losses = {0: [3, 2, 1, 1, 1, 1, math.nan, 1, 1], 1: [math.nan, 5, 5, 5, 5, 5, 5, 5, 5]}
    applied = run_steps(engines, range(1, 10), losses=lambda r, s: losses[r][s - 1])
    # rank 0: records 4 and 5 bring no improvement -> plateau decided at 5, applied after 8
    assert applied[0] == applied[1] == [(8, "stop", "plateau")]
    scheduled = json.loads((tmp_path / "job" / SCHEDULE_FILE).read_text())["actions"]
    # NaN at 7 -> step 10; records 6 and 8 (7 is NaN, not a record) -> plateau again at 11
    assert [(r["source"], r["step"]) for r in scheduled] == \
        [("plateau", 8), ("nonfinite", 10), ("plateau", 11)]


def test_stale_requests_from_before_the_run_are_ignored(tmp_path, caplog):
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    write_request(job_dir, Request("old", "stop"))
    (job_dir / SCHEDULE_FILE).write_text(json.dumps(
        {"actions": [{"id": "old2", "action": "stop", "step": 1}]}))
    with caplog.at_level(logging.WARNING, logger="mfotel"):
        engines = [ActionEngine(actions_cfg(control_dir=str(tmp_path / "{job_name}")), "job", r, 2)
                   for r in (1, 0)]  # rank 1 starts first and reads the old schedule
        for engine in engines:
            engine.start()
    assert run_steps(engines, range(1, 6)) == {0: [], 1: []}
    assert "ignoring" in caplog.text and "old" in caplog.text


def test_a_rank_that_reads_the_schedule_late_applies_at_once_and_says_so(tmp_path, caplog):
    rank0, rank1 = ranks(tmp_path, 2, lead_steps=1)
    write_request(tmp_path / "job", Request("x", "stop"))
    rank0.step_end(3, 1.0, True)        # scheduled for step 4
    rank0.step_end(4, 1.0, True)
    with caplog.at_level(logging.ERROR, logger="mfotel"):
        (late,) = rank1.step_end(6, 1.0, True)
    assert late.step == 4 and "2 steps after the scheduled step 4" in caplog.text


def test_local_rules_on_several_ranks_need_a_control_dir():
    engine = ActionEngine(actions_cfg(plateau={}), "job", rank=0, world_size=2)
    with pytest.raises(ConfigError, match="control_dir"):
        engine.start()


def test_unwritable_control_dir_is_an_error_at_start(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    engine = ActionEngine(actions_cfg(control_dir=str(blocker / "{job_name}")), "job")
    with pytest.raises(ConfigError, match="cannot write"):
        engine.start()


def test_nonfinite_rule_fires_when_the_loss_turns_nonfinite(tmp_path):
    (engine,) = [ActionEngine(actions_cfg(nonfinite={"action": "warn"}), "job")]
    engine.start()
    losses = [1, math.nan, math.nan, 1, math.inf]
    applied = run_steps([engine], range(1, 6), losses=lambda r, s: losses[s - 1])
    assert applied[0] == [(2, "warn", "nonfinite"), (5, "warn", "nonfinite")]


# ---------------------------------------------------------------- alerts -> control
def alert(status="firing", name="MindFormersLossNotFinite", job="llama", rank="0",
          starts_at="2025-01-01T00:00:00Z"):
    """An alert as Alertmanager sends it: its fingerprint hashes its labels, and startsAt
    tells one firing episode from the next."""
    labels = {"alertname": name, "job_name": job, "rank": rank}
    return ReceivedAlert(status=status, labels=labels, annotations={}, starts_at=starts_at,
                         fingerprint=f"fp-{name}-{job}-{rank}")


def test_alert_control_acts_once_per_firing_alert_of_a_job(tmp_path):
    (tmp_path / "llama").mkdir()
    control = AlertControl(str(tmp_path), ["MindFormersLossNotFinite"], out=None)
    assert control.handle(alert(rank="0")) == tmp_path / "llama" / CONTROL_FILE
    first = json.loads((tmp_path / "llama" / CONTROL_FILE).read_text())
    assert (first["action"], first["source"]) == ("stop", "alert")
    assert "MindFormersLossNotFinite" in first["reason"]
    assert control.handle(alert(rank="1")) is None           # another rank, same alert
    assert control.handle(alert(name="MindFormersLossSpike")) is None  # not allow-listed
    assert control.handle(alert(status="resolved")) is None
    assert control.handle(alert(rank="1", status="resolved")) is None
    again = "2025-01-01T01:00:00Z"                            # a new episode fires
    assert control.handle(alert(starts_at=again)) is not None
    assert len(control.written) == 2


def test_alert_control_leaves_unknown_and_unsafe_jobs_alone(tmp_path):
    out_dir = tmp_path / "ctl"
    control = AlertControl(str(out_dir / "{job_name}"), ["MindFormersLossNotFinite"], out=None)
    assert control.handle(alert(job="no-such-job")) is None       # not using the channel
    assert control.handle(alert(job="../../etc")) is None
    with pytest.raises(ValueError):
        job_dir_for(str(out_dir), "..")
    assert not out_dir.exists()


def test_alert_control_validates_at_construction():
    with pytest.raises(ValueError, match="positive factor"):
        AlertControl("/x", ["A"], action="scale_lr")
    with pytest.raises(ValueError, match="at least one"):
        AlertControl("/x", [])


TOKEN = "test-token-7f3a"


def post_json(url: str, body: dict, token: str | None = TOKEN) -> int:
    return http.post(url, body, auth=bearer(token) if token else None, timeout=5).status


def webhook(status: str = "firing", job: str = "llama") -> dict:
    """An Alertmanager (v4) notification with one MindFormersLossNotFinite alert."""
    labels = {"alertname": "MindFormersLossNotFinite", "severity": "critical",
              "job_name": job, "rank": "0"}
    return {"version": "4", "status": status, "receiver": "mfotel-pager", "groupKey": "k",
            "alerts": [{"status": status, "labels": labels, "annotations": {},
                        "startsAt": "2025-01-01T00:00:00Z", "fingerprint": "f0"}]}


def test_receiver_with_control_writes_the_jobs_control_file(tmp_path):
    (tmp_path / "llama").mkdir()
    control = AlertControl(str(tmp_path / "{job_name}"), ["MindFormersLossNotFinite"], out=None)
    with AlertsReceiver(port=0, out=None, control=control,
                        auth=Credentials(bearer_token=TOKEN.encode())) as receiver:
        assert post_json(receiver.url, webhook()) == 200
        assert post_json(receiver.url, webhook()) == 200      # a repeat notification
    data = json.loads((tmp_path / "llama" / CONTROL_FILE).read_text())
    assert (data["action"], data["source"]) == ("stop", "alert")
    assert control.written == [tmp_path / "llama" / CONTROL_FILE]


def test_receiver_command_line_control_option(tmp_path):
    (tmp_path / "llama").mkdir()
    (tmp_path / "token").write_text(TOKEN + "\n")   # trailing newline trimmed, as Alertmanager does
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mfotel.alerting.receiver", "--port", str(port),
                             "--control-dir", str(tmp_path), "--control-action", "scale_lr",
                             "--control-factor", "0.5",
                             "--bearer-token-file", str(tmp_path / "token")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}/alerts"
        status = wait_for(lambda: post_json(url, webhook()), startup(), message="the receiver up",
                          alive=[proc], ignore=(OSError,))
        assert status == 200
    finally:
        proc.terminate()
        output = proc.communicate(timeout=30)[0]
    data = json.loads((tmp_path / "llama" / CONTROL_FILE).read_text())
    assert (data["action"], data["factor"], data["source"]) == ("scale_lr", 0.5, "alert")
    assert "MindFormersLossNotFinite -> scale_lr requested for job llama" in output


def test_receiver_rejects_a_bad_control_factor():
    done = subprocess.run([sys.executable, "-m", "mfotel.alerting.receiver", "--port", "0",
                           "--control-dir", "/tmp", "--control-action", "scale_lr"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "positive factor" in done.stderr


def test_a_scale_lr_that_cannot_apply_is_logged_not_counted(tmp_path, caplog):
    (engine,) = ranks(tmp_path, 1)
    write_request(tmp_path / "job", new_request("scale_lr", 0.5))
    with caplog.at_level(logging.ERROR, logger="mfotel"):
        assert engine.step_end(1, 1.0, True, optimizer=None) == []
    assert "cannot apply scale_lr x0.5" in caplog.text and "no optimizer" in caplog.text
    assert engine.counts[("scale_lr", "control")] == 0


@settings(max_examples=40, deadline=None)
@given(order=st.lists(st.integers(0, 2), min_size=60, max_size=60),
       write_at=st.integers(0, 40), lead=st.integers(1, 3))
def test_ranks_in_lockstep_always_apply_at_the_same_step(order, write_at, lead):
    """Any interleaving of 3 data-parallel ranks (none more than a step ahead of another: the
    all-reduce) and any moment of the request: every rank applies it after the same step."""
    with tempfile.TemporaryDirectory() as tmp:
        engines = ranks(Path(tmp), 3, lead_steps=lead)
        done = [0, 0, 0]
        applied: dict[int, list[int]] = {0: [], 1: [], 2: []}
        for move, rank in enumerate(order):
            if move == write_at:
                write_request(Path(tmp) / "job", new_request("stop"))
            if done[rank] + 1 > min(done) + 1:
                continue  # would run ahead of a rank still in the previous step
            done[rank] += 1
            for request in engines[rank].step_end(done[rank], 1.0, True):
                assert request.step == done[rank], "applied late"
                applied[rank].append(done[rank])
        steps = [s for rank_steps in applied.values() for s in rank_steps]
        assert len(set(steps)) <= 1
        if all(d >= max(steps, default=0) for d in done):
            # every rank got past the scheduled step: each applied it exactly once, on time
            assert all(len(applied[r]) == len(applied[0]) for r in applied)
