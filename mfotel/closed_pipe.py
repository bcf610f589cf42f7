"""Command-line entry points end quietly when their reader goes away (`mfotel check f | head -3`).

    @quiet_on_closed_pipe
    def main(argv=None) -> int: ...

Python ignores SIGPIPE, so writing to a pipe whose reader has exited raises BrokenPipeError,
and the interpreter's final flush of stdout fails once more ("Exception ignored ..."). This is
the recipe of Python's `signal` documentation ("Note on SIGPIPE"): flush while the error can
still be caught, point the closed stream at /dev/null so nothing is left to fail at exit, and
exit with the status a shell shows for a command ended by SIGPIPE, 141 (128 + 13). SIGPIPE is
not set back to its default action because the same processes serve sockets (`/metrics`, the
alerts receiver), where a client hanging up must not end the process; for the same reason a
BrokenPipeError that did not come from a closed stdout or stderr is raised as usual.
"""
from __future__ import annotations

import functools
import os
import select
import signal
import sys
from collections.abc import Callable
from typing import ParamSpec, TypeVar

EXIT_CLOSED_PIPE = 128 + signal.SIGPIPE

P = ParamSpec("P")
R = TypeVar("R")


def quiet_on_closed_pipe(main: Callable[P, R]) -> Callable[P, R | int]:
    """`main`, returning EXIT_CLOSED_PIPE without a traceback when stdout or stderr is a pipe
    whose reader has gone."""
    @functools.wraps(main)
    def run(*args: P.args, **kwargs: P.kwargs) -> R | int:
        try:
            try:
                return main(*args, **kwargs)
            finally:
                _flush()    # what is still buffered fails here, not at interpreter exit
        except BrokenPipeError:
            closed = closed_std_streams()
            if not closed:
                raise       # a socket's peer went away: not ours to hide
            devnull = os.open(os.devnull, os.O_WRONLY)
            for fd in closed:
                os.dup2(devnull, fd)
            os.close(devnull)
            return EXIT_CLOSED_PIPE
    return run


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()


def closed_std_streams() -> list[int]:
    """The descriptors of stdout and stderr whose reader has gone (poll reports POLLERR on the
    write end of a pipe without readers)."""
    closed = []
    for stream in (sys.stdout, sys.stderr):
        try:
            fd = stream.fileno() if stream is not None else -1
        except (OSError, ValueError):     # replaced by a StringIO, or closed
            continue
        if fd < 0:
            continue
        poll = select.poll()
        poll.register(fd, 0)
        if any(events & select.POLLERR for _, events in poll.poll(0)):
            closed.append(fd)
    return closed
