"""Whose is a control directory: who could write requests there, or put another one in its place.

    check_control_dir(Path("/shared/pub/llama"))   # UnsafeControlDir: path, owner, mode, fix
    raise unreachable(job_dir, exc) from None        # a writer who may not enter a parent

Whoever may write a job's control directory may stop the job or scale its learning rate, and
whoever may write a directory on its path may rename it away and put their own in its place.
So, as OpenSSH's StrictModes does for `~/.ssh`, training uses a control directory only when:

- the directory belongs to the trainer's user (or root) and others may not write it; its
  group may (the group model of mfotel.actions.control: the group's members write requests);
- every directory on its path belongs to the trainer's user or root, and may be written by
  others only with the sticky bit (as /tmp: nobody renames what is not theirs), by its group
  only with the sticky bit or when it is the job directory's own group, that may write
  requests anyway;
- every symbolic link on the path (each one followed) belongs to the trainer's user or root.

No MindSpore import here.
"""
from __future__ import annotations

import errno
import grp
import os
import pwd
import stat
from collections import deque
from collections.abc import Iterator
from pathlib import Path

#: Symbolic links followed at most while resolving a path (Linux's own limit).
MAX_LINKS = 40


class UnsafeControlDir(PermissionError):
    """Others could write the control directory or replace it: it is not used."""


def user_name(uid: int) -> str:
    """The user's name, "" when the user database does not know `uid`."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return ""


def _group(gid: int) -> str | None:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return None


def group_name(gid: int) -> str:
    """`name (gid N)`, or `gid N` for a group the database does not know."""
    name = _group(gid)
    return f"{name} (gid {gid})" if name else f"gid {gid}"


def describe_user(uid: int) -> str:
    name = user_name(uid)
    return f"user {name} (uid {uid})" if name else f"uid {uid}"


def describe(st: os.stat_result) -> str:
    """`owner ..., group ..., mode ...` of a file."""
    return (f"owner {describe_user(st.st_uid)}, group {group_name(st.st_gid)}, mode "
            f"{stat.filemode(st.st_mode)}")


def walk(path: str) -> Iterator[tuple[str, os.stat_result]]:
    """Every directory and symbolic link met while resolving the absolute `path`, from `/`,
    with its lstat(); links are followed as the kernel does. OSError as the kernel's."""
    current = "/"
    yield current, os.lstat(current)
    parts, links = deque(p for p in path.split("/") if p not in ("", ".")), 0
    while parts:
        part = parts.popleft()
        if part == "..":
            current = os.path.dirname(current)   # `current` is resolved: its parent is real
            continue
        candidate = os.path.join(current, part)
        st = os.lstat(candidate)
        yield candidate, st
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > MAX_LINKS:
                raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)
            target = os.readlink(candidate)
            current = "/" if target.startswith("/") else current
            parts.extendleft(reversed([p for p in target.split("/") if p not in ("", ".")]))
        else:
            current = candidate


def check_control_dir(job_dir: Path, uid: int | None = None) -> None:
    """Refuse (UnsafeControlDir, naming the path, owner, mode and fix) a control directory
    that others could write or replace (the module docstring); OSError when it cannot be
    examined. `uid`: the trainer's user (default: this process's effective user)."""
    uid = os.geteuid() if uid is None else uid
    trusted, trainer = {0, uid}, describe_user(uid)
    met = list(walk(os.path.abspath(job_dir)))
    here, final = met[-1]
    if not stat.S_ISDIR(final.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), here)
    if final.st_uid not in trusted:
        raise _refused(job_dir, "it", final, f"belongs to {describe_user(final.st_uid)}, not to "
                       f"the trainer, {trainer}", f"remove {here} (its owner or root can) and let "
                       "rank 0 create it, or choose another actions.control_dir")
    if final.st_mode & stat.S_IWOTH:
        raise _refused(job_dir, "it", final, "may be written by others",
                       f"chmod o-w {here} (operators share it through its group: chgrp GROUP "
                       f"{here} && chmod 2770 {here})")
    group_may_steer = bool(final.st_mode & stat.S_IWGRP)
    for path, st in met[:-1]:
        what = f"the link {path} on its path" if stat.S_ISLNK(st.st_mode) \
            else f"{path} on its path"
        if st.st_uid not in trusted:
            raise _refused(job_dir, what, st, f"belongs to {describe_user(st.st_uid)}, who could "
                           "put another directory in its place", "choose an "
                           "actions.control_dir whose every parent belongs to root or to "
                           f"{trainer}, or chown root {path}")
        if stat.S_ISLNK(st.st_mode) or st.st_mode & stat.S_ISVTX:
            continue   # a link's mode means nothing; sticky: others rename only their own
        if st.st_mode & stat.S_IWOTH:
            raise _refused(job_dir, what, st, "may be written by others, who could put another "
                           "directory in its place", f"chmod +t {path} (sticky, as /tmp: "
                           f"nobody renames what is not theirs), or chmod o-w {path}")
        if st.st_mode & stat.S_IWGRP and not (group_may_steer and st.st_gid == final.st_gid):
            raise _refused(job_dir, what, st, f"may be written by group {group_name(st.st_gid)}, "
                           "whose members could put another directory in its place but may not "
                           "write requests", f"chmod +t {path}, or chmod g-w {path}, or give the "
                           "job's directory that group (chgrp GROUP DIR && chmod 2770 DIR)")


def _refused(job_dir: Path, subject: str, st: os.stat_result, problem: str,
             fix: str) -> UnsafeControlDir:
    return UnsafeControlDir(
        f"not using the control directory {job_dir}: {subject} {problem} ({describe(st)}), "
        f"so another user could stop the job or scale its learning rate. Fix: {fix}")


def unreachable(job_dir: Path, exc: OSError) -> PermissionError:
    """The refusal for a writer who may not enter a directory on `job_dir`'s path: which one,
    its owner, group and mode, and the fix (`exc`: the error met)."""
    path, me = Path(os.path.abspath(job_dir)), os.geteuid()
    effective = os.access in os.supports_effective_ids
    for part in (*reversed(path.parents), path):
        if not os.access(part, os.X_OK, effective_ids=effective):
            break
    else:
        return PermissionError(f"cannot reach {job_dir} ({exc.strerror or exc})")
    st = os.stat(part)
    name = user_name(me) or str(me)
    return PermissionError(
        f"cannot reach {job_dir} ({exc.strerror or exc}): {describe_user(me)} may not enter "
        f"{part} ({describe(st)}). Fix: run this as a user who may (its owner, or a member of "
        f"group {group_name(st.st_gid)}), or add {name} to that group (usermod -aG "
        f"{_group(st.st_gid) or st.st_gid} {name}, then log in again): its members write the job's "
        "requests")
