"""The hung rank's stacks: captured by the node agent, kept, served by the node endpoint.

A rank under `mfotel-instrument` registered `faulthandler` for a signal (mfotel.node_link:
SIGURG, whose default action is to ignore it), writing every thread's Python stack to
`stacks-<pid>.txt`. faulthandler writes from the C signal handler: a rank holding the GIL or
blocked in C code is dumped too, and nothing is stopped. The agent shares no GIL with it.

- The capture (`dump`): the announced signal, sent only when /proc/PID/status shows a handler
  for it (SigCgt), through a pidfd opened and checked against the rank's start time (never to
  a process that reused the pid); then what the dump appended to the file since, once it has
  been unchanged for `DUMP_QUIET_SECONDS` (at most `DUMP_START_SECONDS` for it to begin,
  `DUMP_MAX_SECONDS` in all), at most `MAX_TEXT` bytes of it.
- The triggers (`StackWatcher`, a thread of the agent, every second): a rank that completed no
  step for max(`FLOOR_SECONDS`, `STEP_INTERVALS` x its mean step interval, as its heartbeat
  showed it over the last observations), inside a step or between two; a rank whose /metrics
  did not answer the liveness probe ("silent"). Once when such an episode begins, again at most
  every `RECAPTURE_SECONDS` while it lasts, never twice within `FLOOR_SECONDS` (a rank that
  answers a probe now and then starts many short episodes); never while the rank steps and
  answers, never before its first measured steps (compilation), never once its run ended.
- What is kept (`Capture`), per (job, rank): the text, pid, unix time, why, the heartbeat's
  step and whether it was inside a step; kept after the rank ended, replaced by the next
  capture of that rank (a restarted rank's too).
- What is served (`StacksApp`, on the node endpoint, behind its web-config): `GET /stacks`
  (the index; `?format=json`), `GET /stacks?job_name=J&rank=R` (one capture, text/plain);
  the series `mfotel_node_rank_stack_timestamp_seconds{scheme}` (metrics.py) says when.

    watcher = StackWatcher(agent.followed, stop)   # NodeAgent makes it
    threading.Thread(target=watcher.run).start()                  # NodeAgent.start does
    watcher.opened(endpoint)       # serves /stacks; node.json for the ranks' live pages
    watcher.captured_at("llama", 1)   # unix time of rank 1's last capture, or None
"""
from __future__ import annotations

import json
import logging
import os
import signal
import stat
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import parse_qs, urlencode

from ..endpoint.wsgi import Environ, StartResponse, plain
from ..node_link import (
    ANNOUNCEMENT_LIMIT,
    ENV_DIR,
    Announcement,
    Progress,
    announcement_path,
    read_progress,
    write_node_endpoint,
)
from ..regular_file import NotRegularFile, read_regular_file
from . import procfs

log = logging.getLogger("mfotel")

PATH = "/stacks"
#: Bytes of one dump kept (100 threads of 100 frames would be ~1 MB).
MAX_TEXT = 256 << 10
FLOOR_SECONDS = 10.0
STEP_INTERVALS = 10.0
RECAPTURE_SECONDS = 60.0
#: After an attempt that got no dump (the rank stopped, or ended meanwhile): the next one.
RETRY_SECONDS = 10.0
CHECK_SECONDS = 1.0
DUMP_START_SECONDS = 2.0
DUMP_QUIET_SECONDS = 0.1
DUMP_MAX_SECONDS = 3.0
#: Signals whose default action is to ignore them: sent to a process without its handler
#: (a race with its end, an announcement gone wrong) they do nothing. Any other is refused.
SAFE_SIGNALS = frozenset({int(signal.SIGURG), int(signal.SIGWINCH)})
#: Step observations kept per rank for its mean step interval (one a check at most).
HEARTBEATS = 32
_POLL_SECONDS = 0.01


class Followed(Protocol):
    """What the watcher reads of a rank the agent follows (agent._Rank)."""

    @property
    def pid(self) -> int: ...
    @property
    def start_ticks(self) -> int: ...
    @property
    def job_name(self) -> str: ...
    @property
    def rank(self) -> int: ...
    @property
    def announcement(self) -> Announcement | None: ...
    @property
    def answering(self) -> bool | None: ...
    @property
    def exit(self) -> object | None: ...


# ---------------------------------------------------------------------- the capture
@dataclass(frozen=True)
class Dump:
    text: str    # at most MAX_TEXT bytes of it, decoded
    size: int    # bytes the dump appended


def _open_stack_file(path: str, pid: int) -> int | None:
    """The rank's own stack file, read-only: `stacks-<pid>.txt`, a regular file of this user
    (never a link, never a FIFO)."""
    if not path or os.path.basename(path) != f"stacks-{pid}.txt":
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
        os.close(fd)
        return None
    return fd


def send(pid: int, start_ticks: int, signum: int) -> bool:
    """Send `signum` to the process `pid` started at `start_ticks` if it has a handler for it;
    whether it was sent. Through a pidfd opened before the start time is checked: it cannot
    reach a process that reused the pid. Before Linux 5.3 (no pidfd) after that check only:
    the signal's default action (SAFE_SIGNALS) makes the race harmless."""
    if signum not in SAFE_SIGNALS:
        return False
    try:
        pidfd: int | None = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    except (AttributeError, OSError):
        pidfd = None
    try:
        now = procfs.read_stat(pid)
        if now is None or now.start_ticks != start_ticks or now.ended or now.state in "Tt":
            return False   # gone, another process, or stopped (the dump would wait for SIGCONT)
        caught = procfs.caught_signals(pid)
        if caught is None or signum not in caught:
            return False   # no handler: the rank has not joined, or has left
        if pidfd is not None:
            signal.pidfd_send_signal(pidfd, signum)
        else:
            os.kill(pid, signum)
        return True
    except OSError:
        return False       # it ended meanwhile
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _wait_for_dump(fd: int, offset: int, start: float, quiet: float, most: float) -> int:
    """The file's size once the dump is written: grown past `offset` within `start` seconds,
    then unchanged for `quiet` seconds (faulthandler writes it in one go, line by line), and
    within `most` seconds in all."""
    began = time.monotonic()
    size = offset
    while size <= offset:
        if time.monotonic() - began >= start:
            return size
        time.sleep(_POLL_SECONDS)
        size = os.fstat(fd).st_size
    changed = time.monotonic()
    while True:
        time.sleep(_POLL_SECONDS)
        now, grown = time.monotonic(), os.fstat(fd).st_size
        if grown != size:
            size, changed = grown, now
        elif now - changed >= quiet or now - began >= most:
            return size


def dump(pid: int, start_ticks: int, announcement: Announcement, limit: int = MAX_TEXT,
         start: float = DUMP_START_SECONDS, quiet: float = DUMP_QUIET_SECONDS,
         most: float = DUMP_MAX_SECONDS) -> Dump | None:
    """Every thread's Python stack of the rank `pid`, as its faulthandler writes it on the
    announced signal; None when there is none to take (no handler, not this process, stopped,
    gone, nothing written in time)."""
    if announcement.pid != pid or not announcement.stack_signal:
        return None
    fd = _open_stack_file(announcement.stack_file, pid)
    if fd is None:
        return None
    try:
        offset = os.fstat(fd).st_size
        if not send(pid, start_ticks, announcement.stack_signal):
            return None
        size = _wait_for_dump(fd, offset, start, quiet, most)
        if size <= offset:
            return None
        data = os.pread(fd, min(size - offset, limit), offset)
        return Dump(data.decode("utf-8", "replace"), size - offset)
    except OSError:
        return None
    finally:
        os.close(fd)


# ---------------------------------------------------------------------- what is kept
@dataclass(frozen=True)
class Capture:
    """One capture of a rank's stacks."""

    job_name: str
    rank: int
    pid: int
    at: float               # unix time
    why: str
    step: int | None        # the heartbeat's last completed step (None: no heartbeat)
    in_step: bool | None    # inside a step (True) or between two
    text: str
    size: int               # bytes the dump had (text: at most MAX_TEXT of them)

    @property
    def path(self) -> str:
        return f"{PATH}?{urlencode({'job_name': self.job_name, 'rank': self.rank})}"

    def step_text(self) -> str:
        if self.step is None:
            return "unknown (no heartbeat)"
        return f"{self.step} ({'inside the next step' if self.in_step else 'between steps'})"

    def render(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(self.at))
        cut = f", the first {len(self.text.encode())} kept" if self.size > MAX_TEXT else ""
        return (f"job: {self.job_name}\nrank: {self.rank}\npid: {self.pid}\n"
                f"captured at: {when} UTC (unix {self.at:.3f})\nwhy: {self.why}\n"
                f"step: {self.step_text()}\n"
                f"(faulthandler's dump of every Python thread, most recent call first; "
                f"{self.size} bytes{cut})\n\n{self.text}")

    def summary(self) -> dict[str, Any]:
        info = {k: v for k, v in asdict(self).items() if k != "text"}
        return {**info, "url": self.path}


# ---------------------------------------------------------------------- the triggers
@dataclass
class _Watch:
    """The watcher's memory of one live rank process."""

    start_ticks: int
    announcement: Announcement | None = None
    directory: Path | None = None   # the node directory its environment names
    environ_read: bool = False
    beats: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=HEARTBEATS))
    since: float | None = None      # when the episode began (None: healthy)
    tried: float | None = None      # the episode's last capture or attempt
    got: bool = False               # whether that attempt got a dump
    last: float | None = None       # this process's last capture, whatever the episode


class StackWatcher:
    """Captures the stacks of the ranks `followed()` returns when they stop stepping or
    answering (see the module docstring); `stop` ends `run`."""

    def __init__(self, followed: Callable[[], Iterable[Followed]],
                 stop: threading.Event | None = None,
                 clock: Callable[[], float] = time.time, floor: float = FLOOR_SECONDS,
                 intervals: float = STEP_INTERVALS, recapture: float = RECAPTURE_SECONDS,
                 retry: float = RETRY_SECONDS, check_interval: float = CHECK_SECONDS) -> None:
        self.followed, self.stop = followed, stop or threading.Event()
        self.clock = clock
        self.floor, self.intervals, self.recapture = floor, intervals, recapture
        self.retry, self.check_interval = retry, check_interval
        self._lock = threading.Lock()
        self._captures: dict[tuple[str, int], Capture] = {}
        self._watches: dict[int, _Watch] = {}   # by pid: live ranks (the watcher's thread only)

    # ------------------------------------------------------------------ what is kept
    def captured_at(self, job_name: str, rank: int) -> float | None:
        with self._lock:
            capture = self._captures.get((job_name, rank))
        return capture.at if capture is not None else None

    def capture_of(self, job_name: str, rank: int) -> Capture | None:
        with self._lock:
            return self._captures.get((job_name, rank))

    def captures(self) -> list[Capture]:
        """Every capture kept, newest first."""
        with self._lock:
            return sorted(self._captures.values(), key=lambda c: -c.at)

    # ------------------------------------------------------------------ the node endpoint
    def opened(self, endpoint: Any) -> None:
        """The node endpoint opened: serve /stacks on it, and tell the ranks' live pages
        where it is (node.json in the node directory their environment names: the command's,
        not necessarily this process's)."""
        endpoint.route(PATH, StacksApp(self))
        directory = next(
            (d for d in (self._environ_dir(r.pid) for r in self.followed()) if d), None)
        if directory is None:
            return
        try:
            write_node_endpoint(directory, endpoint.port, endpoint.scheme)
        except OSError as exc:
            log.warning("mfotel-instrument: cannot write %s/node.json (%s); the ranks' live "
                        "pages will not link their stacks", directory, exc.strerror or exc)

    # ------------------------------------------------------------------ the triggers
    def run(self) -> None:
        while not self.stop.wait(self.check_interval):
            try:
                self.check()
            except Exception as exc:  # noqa: BLE001 - the job outlives any agent bug
                log.warning("mfotel-instrument: stack watch failed (%s: %s)",
                            type(exc).__name__, exc)

    def check(self) -> list[Capture]:
        """One round over the live ranks; the captures it took."""
        taken, live = [], {}
        for rank in list(self.followed()):
            if rank.exit is not None:
                continue
            watch = self._watches.get(rank.pid)
            if watch is None or watch.start_ticks != rank.start_ticks:
                watch = _Watch(rank.start_ticks)
            live[rank.pid] = watch
            announcement = rank.announcement or self._announcement(rank.pid, watch)
            if announcement is None or announcement.pid != rank.pid:
                continue   # not joined (yet): nothing to capture with
            progress = read_progress(announcement.progress_file) \
                if announcement.progress_file else None
            now = self.clock()
            why = self.why(watch, progress, rank.answering is False, now)
            if why is None:
                watch.since, watch.tried = None, None
                continue
            if watch.since is None:
                watch.since = now
            elif watch.tried is not None and (
                    now - watch.last < self.recapture if watch.got and watch.last is not None
                    else now - watch.tried < self.retry):
                continue   # a recapture counts from the last capture's own time, as the floor
            if watch.last is not None and now - watch.last < self.floor:
                continue   # episodes in quick succession: one capture per floor at most
            watch.tried = now
            got = dump(rank.pid, rank.start_ticks, announcement)
            watch.got = got is not None
            if got is None:
                continue
            capture = Capture(rank.job_name, rank.rank, rank.pid, self.clock(), why,
                              progress.step if progress else None,
                              progress.in_step if progress else None, got.text, got.size)
            # the floor and the recapture interval count from the capture's own time (a dump
            # takes a moment): two captures' times are a floor (in an episode: a recapture
            # interval) apart at least
            watch.last = capture.at
            with self._lock:
                self._captures[(capture.job_name, capture.rank)] = capture
            taken.append(capture)
            log.warning("mfotel-instrument: rank %d (pid %d, job %s): %s; its stacks: %s on "
                        "the node endpoint", capture.rank, capture.pid, capture.job_name, why,
                        capture.path)
        self._watches = live
        return taken

    def why(self, watch: _Watch, progress: Progress | None, silent: bool,
            now: float) -> str | None:
        """Why the rank's stacks are wanted now; None while it steps and answers."""
        reasons = []
        if progress is not None and not progress.ended and progress.end > 0:
            beats = watch.beats
            if not beats or beats[-1][0] != progress.step:
                beats.append((progress.step, progress.end))
            mean = mean_interval(beats)
            quiet = now - progress.end
            if mean is not None and quiet > max(self.floor, self.intervals * mean):
                where = (f"inside the step after step {progress.step} (begun "
                         f"{now - progress.begin:.0f} s ago)" if progress.in_step
                         else f"between steps after step {progress.step}")
                reasons.append(f"no step for {quiet:.0f} s, {where}")
        if silent:
            reasons.append("its /metrics did not answer the liveness probe")
        return "; ".join(reasons) or None

    def _announcement(self, pid: int, watch: _Watch) -> Announcement | None:
        """The rank's `rank-<pid>.json`, found through the node directory its environment
        names (when the agent has not read it itself)."""
        if watch.announcement is not None:
            return watch.announcement
        if not watch.environ_read:
            watch.environ_read = True
            watch.directory = self._environ_dir(pid)
        if watch.directory is None:
            return None
        try:
            told = Announcement.from_json(read_regular_file(
                str(announcement_path(watch.directory, pid)), ANNOUNCEMENT_LIMIT))
        except (OSError, NotRegularFile, ValueError, TypeError):
            return None   # not joined yet: again at the next check
        watch.announcement = told if told.pid == pid else None
        return watch.announcement

    @staticmethod
    def _environ_dir(pid: int) -> Path | None:
        env = procfs.read_environ(pid) or {}
        value = env.get(ENV_DIR, "")
        return Path(value) if value and os.path.isdir(value) else None


def mean_interval(beats: Iterable[tuple[int, float]]) -> float | None:
    """Seconds a step over the observations (step, its end); None before two steps."""
    seen = list(beats)
    if len(seen) < 2 or seen[-1][0] <= seen[0][0]:
        return None
    return max(0.0, seen[-1][1] - seen[0][1]) / (seen[-1][0] - seen[0][0])


# ---------------------------------------------------------------------- what is served
class StacksApp:
    """`GET /stacks` (the index) and `GET /stacks?job_name=J&rank=R` (one capture)."""

    def __init__(self, watcher: StackWatcher) -> None:
        self.watcher = watcher

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        method = environ.get("REQUEST_METHOD", "GET")
        if method not in ("GET", "HEAD"):
            return plain(start_response, "405 Method Not Allowed", [("Allow", "GET, HEAD")])
        try:
            query = parse_qs(environ.get("QUERY_STRING", ""), max_num_fields=8)
        except ValueError:
            return plain(start_response, "400 Bad Request", text="at most 8 query fields")
        job, rank = query.get("job_name", [""])[-1], query.get("rank", [""])[-1]
        if not job and not rank:
            json_wanted = query.get("format", [""])[-1] == "json"
            return self._answer(environ, start_response, *self._index(json_wanted))
        if not job or not rank.isdigit():
            return plain(start_response, "400 Bad Request",
                         text="give both: /stacks?job_name=<job>&rank=<rank>")
        capture = self.watcher.capture_of(job, int(rank))
        if capture is None:
            return plain(start_response, "404 Not Found", text=(
                f"no stack capture of job {job!r} rank {rank} on this node: the node agent "
                f"captures a rank's stacks when it completes no step for "
                f"max({self.watcher.floor:g} s, {self.watcher.intervals:g} x its mean step "
                f"interval) or its /metrics does not answer; /stacks lists the captures"))
        return self._answer(environ, start_response, capture.render().encode(),
                            "text/plain; charset=utf-8")

    def _index(self, as_json: bool) -> tuple[bytes, str]:
        captures = self.watcher.captures()
        if as_json:
            return (json.dumps({"captures": [c.summary() for c in captures]}).encode(),
                    "application/json")
        lines = [f"Stack captures of the ranks of this node (mfotel-instrument), newest first "
                 f"({len(captures)}):"]
        for c in captures:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(c.at))
            lines.append(f"{c.path}  job {c.job_name} rank {c.rank} pid {c.pid}, "
                         f"{when} UTC: {c.why}")
        if not captures:
            lines.append("none: every rank steps and answers (or none has joined)")
        return ("\n".join(lines) + "\n").encode(), "text/plain; charset=utf-8"

    @staticmethod
    def _answer(environ: Environ, start_response: StartResponse, body: bytes,
                content_type: str) -> list[bytes]:
        start_response("200 OK", [("Content-Type", content_type),
                                  ("Content-Length", str(len(body))),
                                  ("Cache-Control", "no-store")])
        return [b"" if environ.get("REQUEST_METHOD") == "HEAD" else body]
