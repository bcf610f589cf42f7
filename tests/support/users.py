"""Running commands as other users (setpriv), for the control files' permission model.

    with shared_dir() as folder:                  # every user may enter it
        done = control(job_dir, *as_user(OPERATOR_UID, OPS_GID))   # `mfotel control --stop`

Switching users needs root; the tests that do so are skipped otherwise (CI runs as root), or,
with `require_root()`, fail saying so.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

NOBODY = 65534
OPS_GID, OPERATOR_UID = 4242, 4243   # an operators' group, and an operator outside passwd
OUTSIDER_UID = 4244                   # a user in no group of the control model
MFOTEL = str(Path(sys.executable).with_name("mfotel"))
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching users (setpriv) needs "
                                "root; CI runs the suite as root")


def require_root() -> None:
    """Fail, never skip, a test that needs two real users when this is not root."""
    if os.geteuid() != 0:
        pytest.fail("this test runs processes as two real users (setpriv --reuid, chown), "
                    "which needs root: run it as root (CI does)", pytrace=False)


def as_user(uid: int, gid: int, groups: tuple[int, ...] = ()) -> list[str]:
    """The command prefix that runs a command as `uid`:`gid` with `groups` only."""
    extra = [f"--groups={','.join(map(str, groups))}"] if groups else ["--clear-groups"]
    return ["setpriv", f"--reuid={uid}", f"--regid={gid}", *extra]


@contextmanager
def shared_dir() -> Iterator[Path]:
    """A directory every user may enter (pytest's own tmp is root-only), with a `home` for
    `nobody`; removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="mfotel-ctl-"))
    try:
        path.chmod(0o755)
        (path / "home").mkdir()
        os.chown(path / "home", NOBODY, NOBODY)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def control(job_dir: Path, *user: str) -> subprocess.CompletedProcess:
    """`mfotel control JOB_DIR --stop`, as `user` (an as_user prefix) or as this user."""
    return subprocess.run([*user, MFOTEL, "control", str(job_dir), "--stop", "--reason", "test"],
                          capture_output=True, text=True, timeout=60)
