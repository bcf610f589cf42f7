"""Control requests written by another user than the trainer reach it, or fail loudly.

A real training process runs as an unprivileged user (`nobody`, via setpriv) while `mfotel
control` runs as root or as a third uid in the operators' group: the request is readable by
the trainer and stops it, or the command exits non-zero naming the file, the trainer and the
fix, and writes nothing. Needs root (setpriv switches users); CI runs the suite as root.
"""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

from mfotel.actions.control import CONTROL_FILE, SCHEDULE_FILE, Trainer, trainer_of
from tests.support.users import (
    NOBODY,
    OPERATOR_UID,
    OPS_GID,
    as_user,
    control,
    needs_root,
)

pytestmark = needs_root
STEPS, STEP_SECONDS = 400, 0.05
TRAINER = """
import json, sys
from mfotel.demo.training import run_demo
result = run_demo(steps=int(sys.argv[1]), port=0, job_name="ctl-job", linger_seconds=0,
                  min_step_seconds=float(sys.argv[2]), output={"console": False},
                  actions={"control_dir": sys.argv[3]})
print(json.dumps({"steps": max(result.losses),
                  "stops": result.monitor.actions.counts[("stop", "control")]}))
"""


class Training:
    """The trainer: a real MindSpore run as `nobody`, its control root `ctl`."""

    def __init__(self, shared: Path, groups: tuple[int, ...] = ()) -> None:
        self.job_dir = shared / "ctl" / "ctl-job"
        env = {**os.environ, "HOME": str(shared / "home"), "GLOG_v": "3"}
        self.process = subprocess.Popen(
            [*as_user(NOBODY, NOBODY, groups), sys.executable, "-c", TRAINER, str(STEPS),
             str(STEP_SECONDS), str(shared / "ctl" / "{job_name}")],
            cwd=shared / "home", env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
        deadline = time.monotonic() + 120   # MindSpore's import and compilation, under load
        while not (self.job_dir / SCHEDULE_FILE).exists():
            assert self.process.poll() is None, self.process.communicate()
            assert time.monotonic() < deadline, "the trainer never prepared its control dir"
            time.sleep(0.1)

    def finish(self) -> tuple[dict, str]:
        out, err = self.process.communicate(timeout=STEPS * STEP_SECONDS + 120)
        assert self.process.returncode == 0, err[-3000:]
        return json.loads(out.strip().splitlines()[-1]), err

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.communicate()


def test_a_request_written_by_root_stops_a_trainer_running_as_another_user(shared):
    """The common case of the issue: the trainer's directory, an operator with sudo. On the
    first version control.json was root's, mode 0600: the trainer logged Permission denied,
    trained on, and the command said the stop was requested."""
    ctl = shared / "ctl"
    ctl.mkdir()
    os.chown(ctl, NOBODY, NOBODY)
    training = Training(shared)
    try:
        # the operators' group was given the job's directory, but the trainer is not in it
        os.chown(training.job_dir, NOBODY, OPS_GID)
        training.job_dir.chmod(0o2770)
        refused = control(training.job_dir, *as_user(OPERATOR_UID, OPS_GID))
        assert refused.returncode == 2, refused
        message = refused.stderr
        assert f"{training.job_dir / CONTROL_FILE} would not be readable by the trainer, " \
               f"user nobody (uid {NOBODY})" in message
        assert "nothing was written" in message and "Fix: " in message
        assert "add nobody to group gid 4242" in message
        assert not (training.job_dir / CONTROL_FILE).exists()
        assert "requested" not in refused.stdout

        written = control(training.job_dir)   # root: the file is given to the trainer
        assert written.returncode == 0, written
        st = (training.job_dir / CONTROL_FILE).stat()
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (NOBODY, OPS_GID, 0o640)
        result, log = training.finish()
    finally:
        training.kill()
    assert result["stops"] == 1 and result["steps"] < STEPS, result
    assert "Permission denied" not in log


def test_a_shared_setgid_control_root_lets_the_operators_group_steer_the_trainer(shared):
    """`chgrp ops ctl && chmod 2770 ctl`: rank 0 (umask 022) creates the job's directory
    group-writable; an operator of the group writes a request the trainer reads through the
    group (known from the trainer's record in schedule.json, not from the user database)."""
    ctl = shared / "ctl"
    ctl.mkdir()
    os.chown(ctl, 0, OPS_GID)
    ctl.chmod(0o2770)
    training = Training(shared, groups=(OPS_GID,))
    try:
        st = training.job_dir.stat()
        assert st.st_gid == OPS_GID and stat.S_IMODE(st.st_mode) & 0o2070 == 0o2070
        trainer = trainer_of(training.job_dir)
        assert trainer == Trainer(NOBODY, frozenset({NOBODY, OPS_GID}), "nobody")
        written = control(training.job_dir, *as_user(OPERATOR_UID, OPS_GID))
        assert written.returncode == 0, written
        assert "requested stop" in written.stdout
        st = (training.job_dir / CONTROL_FILE).stat()
        assert (st.st_uid, st.st_gid) == (OPERATOR_UID, OPS_GID) and st.st_mode & stat.S_IRGRP
        result, log = training.finish()
    finally:
        training.kill()
    assert result["stops"] == 1 and result["steps"] < STEPS, result
    assert "Permission denied" not in log
