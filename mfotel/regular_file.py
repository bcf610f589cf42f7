"""Reading a file that must be a regular file, never blocking.

A FIFO, device or socket put where mfotel expects a small file (the control file, a run-state
file, a secret) would block `open()`/`read()` on the training thread for ever; a huge file would
take its memory. `read_regular_file` refuses both before reading.
"""
from __future__ import annotations

import os
import stat

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"))


class NotRegularFile(ValueError):
    """A path that must hold a regular file holds something else (or too much)."""


def _check_regular(path: str, mode: int) -> None:
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
        raise NotRegularFile(f"{path} is {kind}, not a regular file: not read. Fix: remove it; "
                             f"mfotel and `mfotel control` write regular files there")


def read_regular_file(path: str, limit: int, st: os.stat_result | None = None) -> bytes:
    """The bytes of the regular file at `path` (symlinks followed), never blocking.

    FileNotFoundError when missing, NotRegularFile for a FIFO, device, socket or directory (or
    more than `limit` bytes), OSError otherwise. `st`: a stat of `path` the caller already has.
    """
    _check_regular(path, (os.stat(path) if st is None else st).st_mode)  # devices: never opened
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    try:
        _check_regular(path, os.fstat(fd).st_mode)  # replaced between the stat and the open
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(1 << 16, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    if size > limit:
        raise NotRegularFile(f"{path} is larger than {limit} bytes: not read. Fix: remove it")
    return b"".join(chunks)
