"""The node agent: what each rank of this node cannot say about itself.

A rank's own /metrics dies with it and stalls with it. mfotel-instrument is the ancestor (child
subreaper) of every process of the job and shares no GIL with any rank; from the process tree
and /proc it tells, per rank:

- the process state: running, stopped (SIGSTOP), zombie, exited; how it ended: exit code,
  terminating signal, OOM kill (the kernel's `oom_kill` count of its memory cgroup rose as it
  died by SIGKILL, or shortly before: oom.py), or "cancelled" when it ended after
  mfotel-instrument passed a cancel on;
- whether its /metrics answered a short liveness probe (`liveness`): "alive but not
  answering" (GIL held, compiling) is told apart from "gone";
- the CPU seconds and resident memory of its process;
- the Python stacks of a rank that stopped stepping or answering (stacks.py, its own thread).

Which process is which rank. A rank under mfotel tells: at train begin it writes
`rank-<pid>.json` into the job's node directory (`settings.node_dir`, `MFOTEL_NODE_DIR` of
the command; mfotel.node_link). The announcement of a process of this job (a descendant of
`root` that was running when the file was written: not a pid reused since) is authoritative:
its job name, rank, local rank and endpoint (address, port, scheme), whatever was guessed of
that process; a process guessed as the same rank is none (a wrapper's sidecar with the
rank's environment). Once a rank that told ended, it stays reported as it ended until a new
process tells it is that rank (a new run): whatever runs after it (a wrapper's next step) is
no rank.

Processes that do not tell (no mfotel, or before their train begin) are guessed. A rank is
the topmost Python process of the job whose environment (/proc/PID/environ, as exec gave it)
carries a rank: `RANK_ID`, `RANK`, ... (the names `mfotel.identity` reads), `MS_NODE_ID`, or
msrun's `MS_ROLE=MS_WORKER`. msrun's scheduler (`MS_ROLE=MS_SCHED`) runs the training script
too, up to `init()`, and is no rank; msrun's `tail -f` helpers carry a worker's environment
but are no Python process; dataset workers forked by a rank are below it. A verdict holds for
a process (pid, start time) until it executes another program (`exec` keeps pid and start
time: a shell that becomes the rank). A job without rank variables (one `python train.py`)
has its rank found by the endpoint it opens: a port in `rank_port ..` that the process
itself listens on. Once a guessed rank's endpoint answers a GET, its
`mindformers_train_rank_info` names the job and the rank as the rank itself does (endpoints
behind basic auth or mutual TLS keep the names from the environment and the settings).

How it ended. msrun, not mfotel-instrument, is the parent of its workers and reaps them
(every second). The agent holds a pidfd of each rank and reads the exit status from the
zombie's /proc/PID/stat the moment it exits, before its parent reaps it; processes the
supervisor reaps itself (its own children, orphans it adopted) are passed in by `reaped`.

    agent = NodeAgent(os.getpid(), AgentSettings(rank_port=9464))
    agent.start()            # threads: watch (exits, new ranks), probe (liveness), stacks
    agent.views()            # [RankView(job_name="llama", rank=1, state="running", ...)]
    agent.close()
"""
from __future__ import annotations

import logging
import os
import re
import select
import signal
import socket
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..config import DEFAULT_JOB_NAME
from ..identity import RANK_VARS, identity_from_env
from ..node_link import ANNOUNCEMENT_LIMIT, Announcement
from ..regular_file import NotRegularFile, read_regular_file
from . import liveness, procfs
from .oom import OomCounts, OomLedger
from .procfs import ProcStat
from .stacks import StackWatcher

log = logging.getLogger("mfotel")

#: How long a rank that ended with no status readable yet waits for the supervisor's reap.
_PENDING_SECONDS = 1.0
#: Ports above `rank_port` searched for the endpoint of a rank whose local rank is unknown.
PORT_WINDOW = 64
#: Ranks probed at once (a node rarely has more than 8 or 16).
PROBE_THREADS = 8
DEFAULT_PROBE_INTERVAL = 5.0
DEFAULT_PROBE_TIMEOUT = 2.0
_RANK_INFO = re.compile(rb"^mindformers_train_rank_info\{(.*)\}", re.M)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_ANNOUNCEMENT = re.compile(r"rank-(\d+)\.json")
#: A process started after its announcement was written is another one (its pid reused);
#: seconds allowed for the clocks compared (file time, boot time + start ticks).
_CLOCK_SLACK = 1.0
#: Parents walked up from an announcing process to the agent's root, at most.
_MAX_DEPTH = 64


@dataclass(frozen=True)
class AgentSettings:
    rank_port: int = 9464            # the ranks' prometheus.port (a rank serves + local rank)
    rank_scheme: str = "http"        # https when the ranks serve TLS
    job_name: str = DEFAULT_JOB_NAME  # for ranks that do not tell theirs
    probe_interval: float = DEFAULT_PROBE_INTERVAL
    probe_timeout: float = DEFAULT_PROBE_TIMEOUT
    scan_interval: float = 1.0       # new processes, and exits where pidfds are missing
    node_dir: Path | None = None     # where the ranks announce themselves (mfotel.node_link)


@dataclass(frozen=True)
class Exit:
    """How a rank ended."""

    at: float                 # unix time the agent saw it end
    status: int | None        # wait status; None when its parent reaped it unseen
    oom: bool = False         # killed by SIGKILL while its memory cgroup's oom_kill count rose
    cancelled: bool = False   # ended after mfotel-instrument passed a cancel on

    @property
    def exit_code(self) -> int | None:
        return os.WEXITSTATUS(self.status) if self.status is not None and \
            os.WIFEXITED(self.status) else None

    @property
    def signal(self) -> int | None:
        return os.WTERMSIG(self.status) if self.status is not None and \
            os.WIFSIGNALED(self.status) else None

    @property
    def cause(self) -> str:
        """completed, exit_code, signal, oom, cancelled or unknown."""
        if self.cancelled:
            return "cancelled"
        if self.signal is not None:
            return "oom" if self.oom else "signal"
        if self.exit_code is not None:
            return "completed" if self.exit_code == 0 else "exit_code"
        return "unknown"

    @property
    def failed(self) -> bool:
        return self.cause in ("exit_code", "signal", "oom", "unknown")


@dataclass
class _Rank:
    """One rank process as the agent follows it."""

    pid: int
    start_ticks: int
    rank: int
    local_rank: int
    job_name: str
    stat: ProcStat
    oom: OomCounts
    identity_read: bool = False   # its endpoint told (or refused to tell) who it is
    endpoint: tuple[str, int] | None = None  # address, port
    answering: bool | None = None
    last_answer: float | None = None
    env_rank: tuple[int, int] | None = None  # (rank, local rank) its environment named
    ended_at: float | None = None  # the pidfd said it ended; status not read yet
    end_ticks: int | None = None   # when, in clock ticks since boot (as start_ticks)
    exit: Exit | None = None
    announcement: Announcement | None = None  # what the rank told (mfotel.node_link)
    stopped_at: float | None = None  # unix time it was first seen stopped, while it is


@dataclass(frozen=True)
class RankView:
    """A rank's facts at one moment (what the node endpoint exposes)."""

    job_name: str
    rank: int
    local_rank: int
    pid: int
    state: str                  # running, stopped, zombie, exited
    cpu_seconds: float
    rss_bytes: int
    endpoint_up: bool | None    # None: nothing listening (not opened yet, or closed)
    last_answer: float | None
    exit: Exit | None
    stack_at: float | None = None  # unix time of its last stack capture (stacks.py)
    stack_scheme: str = "http"     # the node endpoint's, which serves it (the ranks' web-config)
    stopped_at: float | None = None  # unix time it was first seen stopped, while it is


def state_name(stat: ProcStat | None) -> str:
    """running (R, S, D, ...), stopped (T, t), zombie (Z, X) or exited (gone)."""
    if stat is None:
        return "exited"
    if stat.state in ("T", "t"):
        return "stopped"
    return "zombie" if stat.ended else "running"


def rank_of(env: Mapping[str, str]) -> tuple[int, int] | None:
    """(rank, local rank) a process's environment gives it, None when it names no rank."""
    if env.get("MS_ROLE") == "MS_SCHED":
        return None
    named = any(env.get(name, "").strip() for name in RANK_VARS)
    node_id = env.get("MS_NODE_ID", "").strip()
    if not (named or node_id or env.get("MS_ROLE") == "MS_WORKER"):
        return None
    identity = identity_from_env(env)
    rank = identity.rank if named or not node_id.isdigit() else int(node_id)
    return rank, identity.local_rank


def rank_info(body: bytes) -> dict[str, str]:
    """The labels of `mindformers_train_rank_info` in a /metrics body ({} when absent)."""
    match = _RANK_INFO.search(body)
    if match is None:
        return {}
    text = match.group(1).decode("utf-8", "replace")
    return {name: value.encode().decode("unicode_escape") for name, value in _LABEL.findall(text)}


def _alive(rank: _Rank) -> bool:
    stat = procfs.read_stat(rank.pid)
    return stat is not None and stat.start_ticks == rank.start_ticks and not stat.ended


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # before Linux 5.3, or gone
        return None


def _key(stat: ProcStat) -> tuple[int, int, str]:
    """A process's identity for a verdict: pid, start time, and the program it runs (exec
    keeps pid and start time)."""
    return stat.pid, stat.start_ticks, stat.name


def _started_at(start_ticks: int) -> float:
    """Unix time of a start time in clock ticks since boot (0 when the uptime is unknown)."""
    uptime = procfs.uptime_ticks()
    return time.time() - (uptime - start_ticks) / procfs.CLOCK_TICKS if uptime else 0.0


class NodeAgent:
    """Follows the ranks among the descendants of `root` (see the module docstring)."""

    def __init__(self, root: int, settings: AgentSettings = AgentSettings(),
                 on_rank: Callable[[], None] = lambda: None,
                 clock: Callable[[], float] = time.time) -> None:
        self.root, self.settings, self.on_rank, self.clock = root, settings, on_rank, clock
        self.node = socket.gethostname()
        self._lock = threading.Lock()
        self._ranks: dict[int, _Rank] = {}              # by pid
        # (pid, start, command name) -> is a rank; exec changes the name
        self._verdicts: dict[tuple[int, int, str], bool] = {}
        self._told: dict[str, int] = {}                  # announcement file -> mtime read
        self._reaped: dict[int, int] = {}               # pid -> wait status (the supervisor's)
        self._oom = OomLedger()                          # OOM kills told as a rank's exit
        self._pidfds: dict[int, int] = {}               # fd -> pid
        self._poller = select.poll()
        self._cancelled_at: float | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._next_port_check = 0.0
        self._pool: ThreadPoolExecutor | None = None
        self.stacks = StackWatcher(self.followed, self._stop)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> NodeAgent:
        """Start following (call with the supervisor's signals blocked: threads inherit it)."""
        for name, target in (("watch", self._watch), ("probe", self._probe_loop),
                             ("stacks", self.stacks.run)):
            thread = threading.Thread(target=target, name=f"mfotel-node-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        for fd in list(self._pidfds):
            os.close(fd)
        self._pidfds.clear()

    def reaped(self, pid: int, status: int) -> None:
        """The supervisor reaped `pid` (its child, or an orphan it adopted)."""
        with self._lock:
            self._reaped[pid] = status

    def cancelling(self) -> None:
        """mfotel-instrument passed a cancel on: ranks that end from now on were cancelled."""
        with self._lock:
            if self._cancelled_at is None:
                self._cancelled_at = self.clock()

    def settled(self) -> bool:
        """Whether every rank whose process is gone has its exit recorded."""
        with self._lock:
            ranks = [rank for rank in self._ranks.values() if rank.exit is None]
        return all(_alive(rank) for rank in ranks)

    def followed(self) -> list[_Rank]:
        """Every rank followed, live or ended (mfotel.node.stacks reads them)."""
        with self._lock:
            return list(self._ranks.values())

    @property
    def has_ranks(self) -> bool:
        with self._lock:
            return bool(self._ranks)

    # ------------------------------------------------------------------ watching
    def _watch(self) -> None:
        next_scan = 0.0
        while not self._stop.is_set():
            if time.monotonic() >= next_scan:
                try:
                    self.scan()
                except Exception as exc:  # noqa: BLE001 - the job outlives any agent bug
                    log.warning("mfotel-instrument: node agent scan failed (%s: %s)",
                                type(exc).__name__, exc)
                next_scan = time.monotonic() + self.settings.scan_interval
            wait = max(0.0, next_scan - time.monotonic())
            for fd, _ in self._poller.poll(wait * 1000):
                pid = self._pidfds.get(fd)  # kept open: it tells the status once reaped
                self._poller.unregister(fd)
                if pid is not None:
                    self._ended(pid)

    def scan(self) -> None:
        """Find new ranks among the job's processes; settle the exits seen meanwhile."""
        self._read_announcements()
        known = {rank.pid for rank in self._ranks.values()}
        # below a rank are its helpers (dataset workers, compilers): never ranks, not walked
        job = procfs.descendants(self.root, prune=frozenset(known))
        table = {stat.pid: stat for stat in job}
        port_check = time.monotonic() >= self._next_port_check
        if port_check:
            self._next_port_check = time.monotonic() + self.settings.probe_interval
        for stat in job:
            key = _key(stat)
            if stat.ended or stat.pid in known or self._verdicts.get(key) is False:
                continue
            rank = self._classify(stat, table, port_check)
            if rank is not None:
                self._add(rank)
        for rank in list(self._ranks.values()):
            if rank.exit is None:  # a rank that told may be below another one: not walked
                self._follow(rank, table.get(rank.pid) or procfs.read_stat(rank.pid),
                             port_check)
        # forget the verdicts of processes gone (a long job runs many short ones)
        self._verdicts = {key: v for key, v in self._verdicts.items() if key[0] in table}

    def _classify(self, stat: ProcStat, table: dict[int, ProcStat],
                  port_check: bool) -> _Rank | None:
        key = _key(stat)
        env = procfs.read_environ(stat.pid)
        if env is None:
            return None  # not readable now (exec under way): again at the next scan
        if self._helper(stat, table, env):
            self._verdicts[key] = False  # a rank's helper (dataset worker): not a rank
            return None
        if not procfs.exe_name(stat.pid).startswith("python"):
            self._verdicts[key] = False
            return None
        named = rank_of(env)
        local_port = None
        if named is None:
            if env.get("MS_ROLE") == "MS_SCHED" or not port_check or self._has_env_ranks():
                if env.get("MS_ROLE") == "MS_SCHED":
                    self._verdicts[key] = False
                return None  # undecided: a single-process rank opens its endpoint later
            local_port = self._rank_port_of(stat.pid)
            if local_port is None:
                return None
        identity = identity_from_env(env)
        rank, local = named if named is not None else (identity.rank, local_port or 0)
        if self._told_rank(rank):
            self._verdicts[key] = False  # that rank told who it is: this is another process
            return None
        self._verdicts[key] = True
        job_name = env.get("OTEL_SERVICE_NAME", "").strip() or self.settings.job_name
        file = procfs.memory_cgroup_file(stat.pid)
        return _Rank(stat.pid, stat.start_ticks, rank, local, job_name, stat,
                     OomCounts(file, procfs.oom_kill_count(file)), env_rank=named)

    def _helper(self, stat: ProcStat, table: dict[int, ProcStat],
                env: Mapping[str, str]) -> bool:
        """Whether a process is of a rank's making (a dataset worker): below a live rank; or,
        orphaned when its rank died, in that rank's process group (msrun starts each rank as a
        session leader), or carrying that rank's environment and started while it lived (a
        restarted rank starts after its predecessor ended)."""
        parent = table.get(stat.ppid)
        while parent is not None and parent.pid != self.root:
            if parent.pid in self._ranks:
                return True
            parent = table.get(parent.ppid)
        named = rank_of(env)
        for known in self._ranks.values():
            if stat.pgid == known.pid:
                return True
            lived = known.start_ticks <= stat.start_ticks and (
                known.end_ticks is None or stat.start_ticks <= known.end_ticks)
            if named is not None and named == known.env_rank and lived:
                return True
        return False

    def _has_env_ranks(self) -> bool:
        return any(rank.env_rank is not None for rank in self._ranks.values())

    def _rank_port_of(self, pid: int) -> int | None:
        """The local rank of a process listening in the ranks' port range (its endpoint)."""
        base = self.settings.rank_port
        ports = [port for _, port in procfs.listening_ports(pid)
                 if base <= port < base + PORT_WINDOW]
        return ports[0] - base if ports else None

    # ------------------------------------------------------------------ what ranks told
    def _read_announcements(self) -> None:
        """Take in the announcements written (or rewritten) since the last scan."""
        directory = self.settings.node_dir
        if directory is None:
            return
        try:
            with os.scandir(directory) as entries:
                found = [entry for entry in entries if _ANNOUNCEMENT.fullmatch(entry.name)]
        except OSError:
            return
        for entry in found:
            try:
                written = entry.stat(follow_symlinks=False).st_mtime_ns
            except OSError:
                continue
            if self._told.get(entry.name) == written:
                continue
            self._told[entry.name] = written  # read once: a bad file is not read again
            try:
                told = Announcement.from_json(read_regular_file(entry.path, ANNOUNCEMENT_LIMIT))
            except (OSError, NotRegularFile, ValueError, TypeError):
                continue
            if entry.name == f"rank-{told.pid}.json":
                self._believe(told, written / 1e9)

    def _believe(self, told: Announcement, written: float) -> None:
        """Follow the process that told, as it told, once it is shown to be a process of this
        job that ran when the file was written; a guess of the same rank is dropped."""
        rank = self._ranks.get(told.pid)
        stat = procfs.read_stat(told.pid)
        if rank is not None and (stat is None or stat.start_ticks == rank.start_ticks):
            start_ticks = rank.start_ticks  # followed already: guessed, or it told before
        elif stat is not None and self._descends(stat.pid):
            rank, start_ticks = None, stat.start_ticks
        else:
            return  # gone before the agent saw it, or not of this job
        if _started_at(start_ticks) > written + _CLOCK_SLACK:
            return  # written by an earlier process of that pid
        new = rank is None
        if rank is None:
            assert stat is not None
            file = procfs.memory_cgroup_file(stat.pid)
            rank = _Rank(stat.pid, stat.start_ticks, told.rank, told.local_rank, told.job_name,
                         stat, OomCounts(file, procfs.oom_kill_count(file)),
                         env_rank=rank_of(procfs.read_environ(stat.pid) or {}))
        with self._lock:
            if rank.endpoint is not None and rank.endpoint[1] != told.port:
                rank.endpoint, rank.answering = None, None  # found by a guess elsewhere
            rank.job_name, rank.rank, rank.local_rank = told.job_name, told.rank, told.local_rank
            rank.announcement, rank.identity_read = told, True
        for other in list(self._ranks.values()):
            if other.pid != told.pid and other.rank == told.rank and (
                    other.announcement is None or  # a guess: one launcher, one job
                    (other.job_name == told.job_name and other.exit is not None)):  # a run before
                self._drop(other, told)
        if new:
            self._add(rank)
        else:
            log.info("mfotel-instrument: pid %d told it is rank %d of job %s", rank.pid,
                     rank.rank, rank.job_name)

    def _descends(self, pid: int) -> bool:
        """Whether process `pid` is below the agent's root (a process of this job)."""
        for _ in range(3):  # again when a parent ended mid-walk (its children moved up)
            up = pid
            for _ in range(_MAX_DEPTH):
                stat = procfs.read_stat(up)
                if stat is None:
                    break
                if stat.ppid == self.root:
                    return True
                if stat.ppid <= 0:
                    return False  # the top: init's parent is 0
                up = stat.ppid
            else:
                return False
            if up == pid:
                return False  # the process itself is gone
        return False

    def _told_rank(self, rank: int) -> bool:
        """Whether a process told it is rank `rank` (live, or ended: its end stays)."""
        return any(r.announcement is not None and r.rank == rank for r in self._ranks.values())

    def _drop(self, rank: _Rank, told: Announcement) -> None:
        """No longer follow `rank`, a guess that a told rank contradicts (or that rank's run
        before), nor guess it again."""
        with self._lock:
            self._ranks.pop(rank.pid, None)
        self._verdicts[_key(rank.stat)] = False
        for fd in [fd for fd, pid in self._pidfds.items() if pid == rank.pid]:
            del self._pidfds[fd]
            try:
                self._poller.unregister(fd)
            except KeyError:
                pass  # it fired already
            os.close(fd)
        if rank.exit is None:
            log.info("mfotel-instrument: pid %d is no rank: pid %d told it is rank %d of job %s",
                     rank.pid, told.pid, told.rank, told.job_name)

    def _note_stopped(self, rank: _Rank, stat: ProcStat) -> None:
        """When the rank was first seen stopped, while it is (under the lock)."""
        if stat.state in ("T", "t"):
            if rank.stopped_at is None:
                rank.stopped_at = self.clock()
        else:
            rank.stopped_at = None

    def _add(self, rank: _Rank) -> None:
        fd = _pidfd(rank.pid)
        with self._lock:
            # a restarted rank replaces the one it restarts
            for pid, old in list(self._ranks.items()):
                if (old.job_name, old.rank) == (rank.job_name, rank.rank) and old.exit:
                    del self._ranks[pid]
            self._ranks[rank.pid] = rank
        if fd is not None:
            self._pidfds[fd] = rank.pid
            self._poller.register(fd, select.POLLIN)
        log.info("mfotel-instrument: following rank %d (pid %d, job %s)", rank.rank, rank.pid,
                 rank.job_name)
        self.on_rank()

    def _follow(self, rank: _Rank, stat: ProcStat | None, slow: bool) -> None:
        """A scan's look at a live rank: its state, an exit without pidfd; every probe
        interval (`slow`) its memory cgroup's OOM-kill count, the baseline of its end."""
        if stat is not None and stat.start_ticks == rank.start_ticks and not stat.ended:
            rank.stat = stat
            with self._lock:
                self._note_stopped(rank, stat)
            if slow:  # its cgroup again: a process may be moved (a container runtime, a test)
                file = procfs.memory_cgroup_file(rank.pid) or rank.oom.file
                rank.oom.reread(file, procfs.oom_kill_count(file), self.clock())
            return
        if rank.ended_at is None:
            self._ended(rank.pid)  # no pidfd (old kernel): seen by the scan
        else:
            self._settle(rank)

    def _ended(self, pid: int) -> None:
        """The rank `pid` exited: read how, now, before its parent reaps it."""
        rank = self._ranks.get(pid)
        if rank is None or rank.exit is not None:
            return
        rank.ended_at = rank.ended_at or self.clock()
        self._settle(rank)

    def _status(self, rank: _Rank) -> int | None:
        """Its wait status: from the zombie's /proc/PID/stat while its parent has not reaped
        it, else from its pidfd (Linux 6.15+ keeps it there after the reap), else as the
        supervisor reaped it; None while none tells yet."""
        stat = procfs.read_stat(rank.pid)
        if stat is not None and stat.start_ticks == rank.start_ticks and stat.ended:
            return stat.exit_status
        fd = next((fd for fd, pid in self._pidfds.items() if pid == rank.pid), None)
        status = procfs.pidfd_exit_status(fd) if fd is not None else None
        if status is None:
            with self._lock:
                status = self._reaped.pop(rank.pid, None)
        return status

    def _settle(self, rank: _Rank) -> None:
        """Record the exit once its status is known, or once waiting for it is pointless."""
        assert rank.ended_at is not None
        status = self._status(rank)
        with self._lock:
            if status is None and self.clock() - rank.ended_at < _PENDING_SECONDS:
                return  # the supervisor may be reaping it right now
            cancelled = self._cancelled_at is not None and self._cancelled_at <= rank.ended_at
        killed = status is not None and os.WIFSIGNALED(status) and \
            os.WTERMSIG(status) == signal.SIGKILL
        oom = killed and self._oom.tell(rank.oom, procfs.oom_kill_count(rank.oom.file),
                                        rank.ended_at)
        done = Exit(rank.ended_at, status, oom, cancelled)
        with self._lock:
            rank.exit, rank.end_ticks = done, procfs.uptime_ticks()
            rank.answering, rank.stopped_at = None, None
            rank.endpoint = None
        for fd in [fd for fd, pid in self._pidfds.items() if pid == rank.pid]:
            del self._pidfds[fd]
            os.close(fd)
        log.info("mfotel-instrument: rank %d (pid %d) ended: %s", rank.rank, rank.pid, done.cause)

    # ------------------------------------------------------------------ probing
    def _probe_loop(self) -> None:
        while not self._stop.wait(self.settings.probe_interval):
            try:
                self.probe_all()
            except Exception as exc:  # noqa: BLE001 - the job outlives any agent bug
                log.warning("mfotel-instrument: node agent probe failed (%s: %s)",
                            type(exc).__name__, exc)

    def probe_all(self) -> None:
        """One round: find or re-check each live rank's endpoint, then probe them together
        (each probe bounded by the probe time-out)."""
        with self._lock:
            live = [rank for rank in self._ranks.values() if rank.exit is None]
        if self._pool is None:  # created here: its threads inherit this thread's signal mask
            self._pool = ThreadPoolExecutor(PROBE_THREADS, thread_name_prefix="mfotel-node-probe")
        list(self._pool.map(self._probe, live))

    def _locate(self, rank: _Rank) -> tuple[str, int] | None:
        """The rank's listening endpoint: base port + local rank, else one in the window.
        Once found it is kept until a probe is refused (the rank closed it)."""
        told = rank.announcement
        if told is not None:  # where it said it serves (port 0: nowhere)
            return (told.address, told.port) if told.port else None
        if rank.endpoint is not None:
            return rank.endpoint
        mine = procfs.listening_ports(rank.pid)
        base = self.settings.rank_port
        wanted = [(a, p) for a, p in mine if p == base + rank.local_rank] or \
            [(a, p) for a, p in mine if base <= p < base + PORT_WINDOW]
        return wanted[0] if wanted else None

    def _probe(self, rank: _Rank) -> None:
        endpoint = self._locate(rank)
        now = self.clock()
        if endpoint is None:
            with self._lock:
                if rank.exit is None:
                    rank.endpoint, rank.answering = None, None
            return
        address, port = endpoint
        target = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(address, address)
        scheme = rank.announcement.scheme if rank.announcement else self.settings.rank_scheme
        if rank.identity_read:  # the server's own answer: no collection, never a failure
            result = liveness.probe(target, port, scheme, self.settings.probe_timeout)
        else:  # once: the rank's own rank_info names it (a scrape of /metrics)
            result = liveness.probe(target, port, scheme, self.settings.probe_timeout,
                                    body=True)
        with self._lock:
            if rank.exit is not None:
                return
            if rank.endpoint is None:
                rank.last_answer = now  # listening since: the clock of "not answering"
            rank.endpoint = endpoint
            rank.answering = result.outcome == "answered"
            if result.outcome == "refused":
                rank.endpoint, rank.answering = None, None
            elif rank.answering:
                rank.last_answer = self.clock()
                if not rank.identity_read:
                    self._learn_identity(rank, result)

    def _learn_identity(self, rank: _Rank, result: liveness.Probe) -> None:
        """Take the job and rank from the rank's own rank_info (under the lock)."""
        if result.status != 200:
            rank.identity_read = result.status is not None  # 401 / 403: it will not tell
            return
        labels = rank_info(result.body)
        if not labels:
            return  # not training yet (no rank_info): ask again at the next probe
        rank.identity_read = True
        if labels.get("job_name"):
            rank.job_name = labels["job_name"]
        if labels.get("rank", "").isdigit():
            rank.rank = int(labels["rank"])
        if labels.get("local_rank", "").isdigit():
            rank.local_rank = int(labels["local_rank"])

    # ------------------------------------------------------------------ the facts
    def views(self) -> list[RankView]:
        """Every rank's facts now: live ranks read afresh, ended ones as they ended.

        One view per (job, rank): a restarted rank shows its newest process.
        """
        with self._lock:
            ranks = list(self._ranks.values())
        views: dict[tuple[str, int], RankView] = {}
        for rank in sorted(ranks, key=lambda r: r.start_ticks):
            current = procfs.read_stat(rank.pid)
            if current is not None and current.start_ticks != rank.start_ticks:
                current = None  # the pid was reused
            if rank.exit is None and current is not None:
                rank.stat = current
                with self._lock:
                    self._note_stopped(rank, current)
            stat = rank.stat  # an ended rank keeps its last CPU and memory figures
            state = state_name(current)
            if rank.exit is not None and state != "zombie":
                state = "exited"  # exited, or a pidfd seen before /proc shows the zombie
            with self._lock:
                up = rank.answering if rank.endpoint is not None else None
                views[(rank.job_name, rank.rank)] = RankView(
                    rank.job_name, rank.rank, rank.local_rank, rank.pid, state,
                    stat.cpu_seconds, stat.rss_bytes, up, rank.last_answer, rank.exit,
                    self.stacks.captured_at(rank.job_name, rank.rank), self.settings.rank_scheme,
                    stopped_at=rank.stopped_at)
        return list(views.values())


