"""Who may read a control request: the directory's mode decides, and a writer whose request
the trainer could not read writes nothing and says why (the trainer's side, a real training
run as another user, is in tests/e2e/test_control_permissions.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from mfotel.actions.control import (
    CONTROL_FILE,
    SCHEDULE_FILE,
    file_mode,
    new_request,
    write_request,
)
from tests.support.users import (
    NOBODY,
    OPERATOR_UID,
    OPS_GID,
    as_user,
    control,
    needs_root,
)


def test_the_file_mode_follows_who_may_enter_the_directory():
    assert file_mode(0o700) == 0o600
    assert file_mode(0o2770) == 0o640
    assert file_mode(0o755) == 0o644
    assert file_mode(0o711) == 0o644   # others may enter: they may read what they can name


@needs_root
def test_a_directory_the_writer_cannot_write_is_reported_with_its_owner_and_the_fix(shared):
    job_dir = shared / "job"
    job_dir.mkdir(mode=0o755)
    os.chown(job_dir, NOBODY, NOBODY)
    written = control(job_dir, *as_user(OPERATOR_UID, OPS_GID))
    assert written.returncode == 2
    assert f"cannot write in {job_dir} (Permission denied): the directory belongs to user " \
           f"nobody (uid {NOBODY})" in written.stderr
    assert "Fix: run this as nobody" in written.stderr


@needs_root
def test_the_receivers_request_is_refused_the_same_way(shared):
    """The alerts receiver writes through write_request: it gets the same error (it prints
    it and does not act), never a file the trainer cannot read."""
    job_dir = shared / "job"
    job_dir.mkdir()
    (job_dir / SCHEDULE_FILE).write_text(json.dumps({"actions": [], "trainer": {
        "uid": NOBODY, "groups": [NOBODY], "user": "nobody"}}))
    os.chown(job_dir / SCHEDULE_FILE, NOBODY, NOBODY)
    os.chown(job_dir, NOBODY, OPS_GID)
    job_dir.chmod(0o2770)
    probe = ("import sys; from mfotel.actions.control import write_request, new_request\n"
             "try:\n write_request(sys.argv[1], new_request('stop', source='alert'))\n"
             "except PermissionError as exc:\n print(type(exc).__name__, exc)\n")
    out = subprocess.run([*as_user(OPERATOR_UID, OPS_GID), sys.executable, "-c", probe,
                          str(job_dir)], capture_output=True, text=True, timeout=60)
    assert out.stdout.startswith("NotReadableByTrainer ") and "nobody" in out.stdout, out
    assert not (job_dir / CONTROL_FILE).exists()
    # root, same directory: given to the trainer, so it goes through
    path = write_request(job_dir, new_request("stop", source="alert"))
    assert path.stat().st_uid == NOBODY
