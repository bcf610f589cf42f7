"""What a rank tells the node agent of `mfotel-instrument` about itself (no MindSpore).

The launcher makes a private directory (mode 0700) and names it in `MFOTEL_NODE_DIR` for the
whole job. A rank that finds it there, at train begin:

- announces itself: `rank-<pid>.json` (written atomically) holds its pid, job name, rank,
  local rank, world size and its endpoint (address, port, scheme), so the agent never guesses
  a rank from port windows, YAML or process names;
- keeps a step heartbeat, `progress-<pid>` (32 bytes, memory-mapped): the last completed step,
  when the current step began, when the last step ended, and when the run ended (its final
  status shown: a rank lingering after its last step is not one that stopped stepping). Two
  8-byte stores a step on the training thread; the agent reads it without the rank's GIL, so
  a rank that stopped stepping (its data loader never returns) is seen as one while its
  /metrics still answers;
- lets the agent capture its Python stacks: `faulthandler` is registered for `STACK_SIGNAL`
  (SIGURG, whose default action is to ignore it: sent to a process without the handler it does
  nothing), writing every thread's stack to `stacks-<pid>.txt`. faulthandler writes from the
  signal handler itself, in C: it dumps a rank that holds the GIL or sits in C code, and it
  stops nothing.

The agent in turn writes `node.json` there when its node endpoint opens (its port and scheme):
the rank's live page links the rank's stacks on it.

Without `MFOTEL_NODE_DIR` (no launcher) nothing of this happens.

    link = NodeLink.join(Announcement(pid=os.getpid(), job_name="llama", rank=1, ...))
    link.step_begin(time.time()); link.step_end(12, time.time())   # or, as a StepListener,
    link.close()                                                     # the step path calls it
    # the agent's side
    announcements(directory)              # [Announcement(...), ...]
    read_progress(directory / "progress-4242")   # Progress(step=12, begin=..., end=...)
    write_node_endpoint(directory, 9463, "http")  # read_node_endpoint(directory): (9463, "http")
"""
from __future__ import annotations

import faulthandler
import json
import mmap
import os
import signal
import struct
import tempfile
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import IO, Any

from .listeners import StepListener, StepSample
from .regular_file import NotRegularFile, read_regular_file

ENV_DIR = "MFOTEL_NODE_DIR"
#: Default action: ignore. A capture sent to a process that has not registered it is harmless.
STACK_SIGNAL = signal.SIGURG
ANNOUNCEMENT_LIMIT = 64 << 10
#: last completed step, step begin, last step end, run end (unix s; 0: not yet)
_PROGRESS = struct.Struct("<dddd")
_PROGRESS_SIZE = 32                 # the file's size: the struct
NODE_FILE = "node.json"             # the agent's node endpoint: {"port": ..., "scheme": ...}
_DOUBLE = struct.Struct("<d")


@dataclass(frozen=True)
class Announcement:
    """What a rank says about itself (the fields of `rank-<pid>.json`)."""

    pid: int
    job_name: str
    rank: int
    local_rank: int = 0
    world_size: int = 1
    address: str = ""          # its endpoint's bind address; "" when it serves none
    port: int = 0              # 0: no endpoint
    scheme: str = "http"
    stack_file: str = ""       # where faulthandler writes; "" when not registered
    stack_signal: int = 0      # the signal that asks for a dump; 0 when not registered
    progress_file: str = ""    # the step heartbeat; "" when none

    @classmethod
    def from_json(cls, text: bytes) -> Announcement:
        """ValueError for anything but an object with the fields' types."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in data:
                continue
            value = data[f.name]
            kind = int if f.type in ("int", int) else str
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ValueError(f"{f.name}: {value!r} is not a {kind.__name__}")
            values[f.name] = value
        if "pid" not in values or "job_name" not in values or "rank" not in values:
            raise ValueError("pid, job_name and rank are required")
        return cls(**values)


@dataclass(frozen=True)
class Progress:
    """A rank's step heartbeat: its last completed step, when the current (or last) step began
    and when the last step ended (unix seconds; 0 before the first)."""

    step: int
    begin: float
    end: float
    ended: float = 0.0   # when the run ended (its final status shown); 0 while it runs

    @property
    def in_step(self) -> bool:
        return self.begin > self.end


def node_dir(env: dict[str, str] | None = None) -> Path | None:
    """The agent's directory, when this process runs under `mfotel-instrument`."""
    value = (os.environ if env is None else env).get(ENV_DIR, "")
    return Path(value) if value and os.path.isdir(value) else None


def announcement_path(directory: Path, pid: int) -> Path:
    return directory / f"rank-{pid}.json"


def _write_atomically(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def announce(directory: Path, announcement: Announcement) -> Path:
    """Write `rank-<pid>.json` atomically (a reader never sees half of it)."""
    path = announcement_path(directory, announcement.pid)
    _write_atomically(path, json.dumps(asdict(announcement)))
    return path


def announcements(directory: Path) -> list[Announcement]:
    """Every readable announcement in `directory` (a bad or half-written file is skipped)."""
    found = []
    try:
        names = sorted(p for p in os.listdir(directory)
                       if p.startswith("rank-") and p.endswith(".json"))
    except OSError:
        return []
    for name in names:
        try:
            found.append(Announcement.from_json(
                read_regular_file(str(directory / name), ANNOUNCEMENT_LIMIT)))
        except (OSError, NotRegularFile, ValueError, TypeError):
            continue
    return found


def read_progress(path: str | Path) -> Progress | None:
    """The heartbeat at `path`; None when missing or not yet written."""
    try:
        data = read_regular_file(str(path), _PROGRESS_SIZE)
    except (OSError, NotRegularFile):
        return None
    if len(data) < _PROGRESS.size:
        return None
    step, begin, end, ended = _PROGRESS.unpack_from(data)
    return Progress(int(step), begin, end, ended)


def write_node_endpoint(directory: Path, port: int, scheme: str) -> Path:
    """The agent's side: `node.json`, where its node endpoint serves (written atomically)."""
    path = directory / NODE_FILE
    _write_atomically(path, json.dumps({"port": port, "scheme": scheme}))
    return path


def read_node_endpoint(directory: Path) -> tuple[int, str] | None:
    """(port, scheme) of the node endpoint from `node.json`; None while there is none."""
    try:
        data = json.loads(read_regular_file(str(directory / NODE_FILE), ANNOUNCEMENT_LIMIT))
    except (OSError, NotRegularFile, ValueError):
        return None
    port, scheme = (data.get("port"), data.get("scheme")) if isinstance(data, dict) else (0, "")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536 or \
            scheme not in ("http", "https"):
        return None
    return port, scheme


class NodeLink(StepListener):
    """A rank's side of the rendezvous (see the module docstring); attached to the run as a
    listener, it keeps the heartbeat at every step's begin and end."""

    def __init__(self, directory: Path, announcement: Announcement, progress: mmap.mmap | None,
                 stacks: IO[str] | None) -> None:
        self.directory, self.announcement = directory, announcement
        self._progress, self._stacks = progress, stacks

    @classmethod
    def join(cls, announcement: Announcement, directory: Path | None = None) -> NodeLink | None:
        """Register the stack dump, open the heartbeat and announce; None without an agent.
        OSError when the directory cannot be written (the caller counts it)."""
        directory = directory or node_dir()
        if directory is None:
            return None
        pid = announcement.pid
        progress_path = directory / f"progress-{pid}"
        fd = os.open(progress_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, _PROGRESS_SIZE)
            progress = mmap.mmap(fd, _PROGRESS_SIZE)
        finally:
            os.close(fd)
        stacks_path = directory / f"stacks-{pid}.txt"
        # only the job's user reads a rank's stacks (code paths, file names): 0600 as the rest
        fd = os.open(stacks_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        opened: IO[str] = os.fdopen(fd, "a", encoding="utf-8")
        stacks: IO[str] | None = opened
        try:
            # chain=False: the handler is installed with SA_RESTART (system calls interrupted
            # by the dump resume); the previous handler (SIGURG's default: ignore) is restored
            # by close()
            faulthandler.register(STACK_SIGNAL, file=opened, all_threads=True, chain=False)
        except (RuntimeError, ValueError, OSError):
            opened.close()
            stacks = None
        told = Announcement(**{**asdict(announcement), "progress_file": str(progress_path),
                               "stack_file": str(stacks_path) if stacks else "",
                               "stack_signal": int(STACK_SIGNAL) if stacks else 0})
        link = cls(directory, told, progress, stacks)
        try:
            announce(directory, told)
        except BaseException:
            link.close()
            raise
        return link

    # the training thread, every step: two stores into shared memory
    def step_begin(self, at: float) -> None:
        if self._progress is not None:
            _DOUBLE.pack_into(self._progress, 8, at)

    def step_end(self, step: int, at: float) -> None:
        if self._progress is not None:
            _DOUBLE.pack_into(self._progress, 0, step)
            _DOUBLE.pack_into(self._progress, 16, at)

    def on_step_begin(self, wall: float) -> None:
        self.step_begin(wall)

    def on_step(self, sample: StepSample) -> None:
        self.step_end(sample.step, time.time())

    def run_ended(self, at: float) -> None:
        """The run's final status is shown (it lingers, stops stepping, on purpose)."""
        if self._progress is not None:
            _DOUBLE.pack_into(self._progress, 24, at)

    def close(self) -> None:
        """Unregister the dump and unmap the heartbeat; the files stay for the agent (a rank's
        end stays reported, its last capture with it)."""
        if self._stacks is not None:
            faulthandler.unregister(STACK_SIGNAL)
            self._stacks.close()
            self._stacks = None
        if self._progress is not None:
            self._progress.close()
            self._progress = None
