"""A control directory another user could write or replace is never used (issue 33).

Two real users: the trainer runs as `nobody` (a real process running the real ActionEngine, as
rank 0 does after every step), the other user as uid 4243 (setpriv). `/shared/pub` is mode
1777, as /tmp or a scratch file system. Needs root; fails (never skips) otherwise.
"""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mfotel.actions.control import CONTROL_FILE, SCHEDULE_FILE
from mfotel.actions.ownership import UnsafeControlDir, check_control_dir
from tests.support.users import (
    MFOTEL,
    NOBODY,
    OPERATOR_UID,
    OPS_GID,
    OUTSIDER_UID,
    as_user,
    require_root,
)

OTHER = as_user(OPERATOR_UID, OPERATOR_UID)   # the other user, in no group of the trainer
TRAINER = """
import json, logging, os, sys, time
from pathlib import Path
from mfotel.actions.engine import ActionEngine
from mfotel.config import parse_config
os.umask(0)     # the loosest umask: what rank 0 creates is still nobody else's to write
logging.basicConfig(level=logging.WARNING, format="%(message)s")
cfg = parse_config({"actions": {"control_dir": sys.argv[1]}}).actions
errors = []
engine = ActionEngine(cfg, "jobP", on_error=errors.append)
engine.start()
print("started", flush=True)
applied, step, end = [], 0, None
while end is None or step < end:        # until the test says so, then 10 steps more
    step += 1
    applied += [r.action for r in engine.step_end(step, 1.0, True)]
    if end is None and Path(sys.argv[2]).exists():
        end = step + 10
    time.sleep(0.01)
accepted = [r.action for r in engine._schedule]
print(json.dumps({"applied": applied, "accepted": accepted, "errors": errors}), flush=True)
"""


@pytest.fixture(autouse=True, scope="module")
def _two_users() -> None:
    """Root, and a Python with mfotel that `nobody` may run (a checkout under /root may not be)."""
    require_root()
    probe = subprocess.run([*as_user(NOBODY, NOBODY), sys.executable, "-c", "import mfotel"],
                           cwd="/", capture_output=True, text=True, timeout=60)
    if probe.returncode:
        pytest.fail(f"user nobody cannot run {sys.executable} with mfotel: make the checkout and "
                    f"its virtualenv readable by others (chmod o+rX): {probe.stderr[-500:]}",
                    pytrace=False)


@pytest.fixture
def pub(shared: Path) -> Path:
    """A world-writable parent with the sticky bit, as /tmp."""
    path = shared / "pub"
    path.mkdir()
    path.chmod(0o1777)
    return path


def train(shared: Path, pub: Path, *requests: list[str]) -> tuple[dict, str]:
    """Run the trainer as nobody on `pub/{job_name}`; write each of `requests` (an argument
    list for `mfotel control`, prefixed by the user to run it as) while it trains."""
    done = shared / "done"
    process = subprocess.Popen(
        [*as_user(NOBODY, NOBODY), sys.executable, "-c", TRAINER, str(pub / "{job_name}"),
         str(done)], cwd=shared / "home", env={**os.environ, "HOME": str(shared / "home")},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None and process.stdout.readline() == "started\n", \
            process.communicate()
        for request in requests:
            written = subprocess.run(request, capture_output=True, text=True, timeout=60)
            assert written.returncode == 0, written   # the writer's side has nothing to refuse
            time.sleep(0.3)                           # some 30 steps
        done.touch()
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1]), err


def test_a_directory_another_user_made_first_is_refused_and_their_requests_ignored(shared, pub):
    """The issue: the other user makes pub/jobP (0777) before the run; their --stop and
    --scale-lr were applied to a job not theirs (exit 0). Now rank 0 says once whose the
    directory is, its mode and the fix, uses none of it, and trains on."""
    job_dir = pub / "jobP"
    made = subprocess.run([*OTHER, "mkdir", "-m", "0777", str(job_dir)], capture_output=True,
                          text=True, timeout=60)
    assert made.returncode == 0, made
    result, log = train(shared, pub,
                        [*OTHER, MFOTEL, "control", str(job_dir), "--stop"],
                        [*OTHER, MFOTEL, "control", str(job_dir), "--scale-lr", "0.000001"])
    assert result["applied"] == [] and result["accepted"] == [], result
    warning = (f"mfotel: not using the control directory {job_dir}: it belongs to uid "
               f"{OPERATOR_UID}, not to the trainer, user nobody (uid {NOBODY}) (owner uid "
               f"{OPERATOR_UID}, group gid {OPERATOR_UID}, mode drwxrwxrwx), so another user "
               f"could stop the job or scale its learning rate. Fix: remove {job_dir} (its "
               "owner or root can) and let rank 0 create it, or choose another "
               "actions.control_dir; rank 0 ignores control requests and schedules for this "
               "run, training goes on")
    assert log.count("not using the control directory") == 1, log
    assert warning in log, log
    assert 'mfotel_export_errors_total{stage="control"}' in log
    assert result["errors"] == ["control"]
    assert not (job_dir / SCHEDULE_FILE).exists()   # nothing of the trainer's written there
    assert (job_dir / CONTROL_FILE).stat().st_uid == OPERATOR_UID


def test_the_trainers_own_directory_under_a_sticky_parent_is_used(shared, pub):
    """The same parent, the directory made by rank 0 (umask 000): nobody else may write it,
    and a request root writes for the trainer is applied."""
    job_dir = pub / "jobP"
    result, log = train(shared, pub, [MFOTEL, "control", str(job_dir), "--stop"])
    assert result["applied"] == ["stop"] and result["errors"] == [], (result, log)
    st = job_dir.stat()
    assert st.st_uid == NOBODY and stat.S_IMODE(st.st_mode) == 0o775
    assert "not using" not in log


def make(path: Path, uid: int, gid: int, mode: int) -> Path:
    path.mkdir()
    os.chown(path, uid, gid)
    path.chmod(mode)
    return path


def refusal(job_dir: Path) -> str:
    with pytest.raises(UnsafeControlDir) as info:
        check_control_dir(job_dir, NOBODY)
    return str(info.value)


def test_each_way_to_replace_the_directory_is_refused_with_owner_mode_and_fix(shared):
    root = make(shared / "root", 0, 0, 0o755)
    other = make(root / "other", NOBODY, NOBODY, 0o777)
    assert "it may be written by others (owner user nobody (uid 65534), group " in \
        refusal(other)
    assert f"Fix: chmod o-w {other} " in refusal(other)

    loose = make(root / "loose", 0, 0, 0o777)          # others may rename the job's directory
    message = refusal(make(loose / "job", NOBODY, NOBODY, 0o700))
    assert f"{loose} on its path may be written by others" in message
    assert "mode drwxrwxrwx" in message and f"Fix: chmod +t {loose} " in message

    team = make(root / "team", 0, OPS_GID, 0o775)      # a group that may not write requests
    message = refusal(make(team / "job", NOBODY, NOBODY, 0o755))
    assert f"{team} on its path may be written by group gid {OPS_GID}" in message
    assert "mode drwxrwxr-x" in message

    theirs = make(root / "theirs", OPERATOR_UID, OPERATOR_UID, 0o755)
    message = refusal(make(theirs / "job", NOBODY, NOBODY, 0o700))
    assert f"{theirs} on its path belongs to uid {OPERATOR_UID}, who could put" in message

    sticky = make(root / "sticky", 0, 0, 0o1777)
    mine = make(root / "mine", NOBODY, NOBODY, 0o700)
    (sticky / "link").symlink_to(mine)
    os.lchown(sticky / "link", OPERATOR_UID, OPERATOR_UID)   # they could point it elsewhere
    assert f"the link {sticky / 'link'} on its path belongs to uid {OPERATOR_UID}" in \
        refusal(sticky / "link")


def test_the_group_model_and_sticky_parents_are_accepted(shared):
    root = make(shared / "root", 0, 0, 0o755)
    ctl = make(root / "ctl", 0, OPS_GID, 0o2770)        # the documented shared control root
    check_control_dir(make(ctl / "job", NOBODY, OPS_GID, 0o2770), NOBODY)
    sticky = make(root / "sticky", 0, 0, 0o1777)
    check_control_dir(make(sticky / "job", NOBODY, NOBODY, 0o755), NOBODY)
    (sticky / "link").symlink_to(sticky / "job")         # root's link: followed and checked
    check_control_dir(sticky / "link", NOBODY)
    (root / "loop").symlink_to(root / "loop")
    with pytest.raises(OSError):
        check_control_dir(root / "loop", NOBODY)


def test_a_user_outside_the_control_group_is_told_owner_mode_and_fix(shared):
    """Was a bare `[Errno 13] Permission denied: '.../ctl/job'`."""
    ctl = make(shared / "ctl", 0, OPS_GID, 0o2770)
    job_dir = make(ctl / "job", NOBODY, OPS_GID, 0o2770)
    outsider = as_user(OUTSIDER_UID, OUTSIDER_UID)
    expected = (f"mfotel control: error: cannot reach {job_dir} (Permission denied): uid "
                f"{OUTSIDER_UID} may not enter {ctl} (owner user root (uid 0), group gid "
                f"{OPS_GID}, mode drwxrws---). Fix: run this as a user who may (its owner, or "
                f"a member of group gid {OPS_GID}), or add {OUTSIDER_UID} to that group "
                f"(usermod -aG {OPS_GID} {OUTSIDER_UID}, then log in again)")
    for what in (["--stop"], ["--scale-lr", "0.5"], ["--show"]):
        out = subprocess.run([*outsider, MFOTEL, "control", str(job_dir), *what],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2, out
        assert out.stderr.startswith(expected), out.stderr
        assert "Errno" not in out.stderr
    assert not (job_dir / CONTROL_FILE).exists()
    member = subprocess.run([*as_user(OPERATOR_UID, OPS_GID), MFOTEL, "control", str(job_dir),
                             "--stop"], capture_output=True, text=True, timeout=60)
    assert member.returncode == 0, member      # the group's members still may


def test_no_rank_follows_a_schedule_another_user_wrote(shared, caplog):
    """The other ranks read rank 0's decisions from schedule.json: one planted in another
    user's directory steers none of them, and rank 0's local rules are off (acting alone
    would split the job)."""
    from mfotel.actions.engine import ActionEngine
    from mfotel.config import parse_config
    pub = make(shared / "pub", 0, 0, 0o1777)
    job_dir = make(pub / "job", OPERATOR_UID, OPERATOR_UID, 0o777)
    cfg = parse_config({"actions": {"control_dir": str(pub / "{job_name}"),
                                    "plateau": {"patience": 1}}}).actions
    with caplog.at_level("WARNING", logger="mfotel"):
        ranks = [ActionEngine(cfg, "job", rank, 2) for rank in (0, 1)]
        for engine in ranks:
            engine.start()
        planted = job_dir / SCHEDULE_FILE   # after the start: not a stale one
        planted.write_text(json.dumps({"actions": [
            {"id": "planted", "action": "stop", "source": "control", "step": 2}]}))
        os.chown(planted, OPERATOR_UID, OPERATOR_UID)
        applied = [engine.step_end(step, 1.0, True) for step in range(1, 6) for engine in ranks]
    assert applied == [[]] * 10
    assert [engine.errors for engine in ranks] == [1, 1]
    refusals = [r.getMessage() for r in caplog.records if "not using" in r.getMessage()]
    assert [m.split("; ")[-1].split(" (control-file")[0] for m in refusals] == [
        "rank 0 ignores control requests and schedules for this run and its local rules are "
        "off, training goes on",
        "rank 1 ignores control requests and schedules for this run and its local rules are "
        "off, training goes on"]
