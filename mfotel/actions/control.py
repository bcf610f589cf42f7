"""The control channel: a per-job directory through which humans and alerts steer a run.

    mfotel control /shared/mfotel-control/llama7b-sft --stop
    mfotel control /shared/mfotel-control/llama7b-sft --scale-lr 0.5 --reason "loss flat"
    mfotel control /shared/mfotel-control/llama7b-sft --show

The job's directory is `monitor_config.actions.control_dir` with `{job_name}` filled in; rank 0
creates it at train begin. Two files, each with one writer, each replaced atomically:

  control.json   the latest request ({id, action, factor, source, reason, created}), written by
                 `mfotel control` or by the alerts receiver (`AlertControl`)
  schedule.json  written by rank 0 only: every request it accepted, with the global step at
                 which every rank applies it (mfotel.actions.engine)

Training reads these files after every step, so reading must never block or balloon: only
regular files are opened (a FIFO, device, socket or directory at the path is reported, never
read), without blocking (`O_NONBLOCK`, the type checked again on the open descriptor), and at
most `CONTROL_MAX_BYTES` / `SCHEDULE_MAX_BYTES` are read.

Permissions (the writer is often another user than the trainer: an operator, the receiver's
service account). The directory's mode is the access control:
- every file written there is readable by whoever may enter the directory (owner read-write,
  group-read when the directory lets its group in, others-read when it lets others in), and
  takes the directory's group; a writer running as root gives the file to the trainer's user;
- in a shared control root with the setgid bit (`chgrp mlops /shared/mfotel-control && chmod
  2770 /shared/mfotel-control`), rank 0 creates the job's directory with the root's group
  permissions, so every member of the group may write requests and the trainer reads them;
- rank 0 records who the trainer is (uid, groups) in `schedule.json` at train begin; before
  a request replaces `control.json`, the writer checks that this user can read it, and when
  it could not, writes nothing and fails naming the file, the trainer's user and the fix;
  a writer who may not enter a directory on the path is told which one, its owner, group,
  mode and the fix (mfotel.actions.ownership.unreachable);
- training uses the directory only when it is the trainer's and nobody else could write or
  replace it (mfotel.actions.ownership.check_control_dir, as OpenSSH's StrictModes).

No MindSpore import here: the CLI and the alerts receiver run anywhere.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import pwd
import re
import stat
import sys
import tempfile
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

from ..config.keys import LR_FACTOR_RANGE
from ..regular_file import NotRegularFile, read_regular_file
from ..subcommand import Subcommand
from .ownership import group_name, unreachable, user_name

CONTROL_FILE = "control.json"
SCHEDULE_FILE = "schedule.json"
REQUEST_ACTIONS = ("stop", "scale_lr", "warn")
#: Values of the `source` label of mindformers_train_actions_total.
SOURCES = ("plateau", "nonfinite", "control", "alert")
_JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
CONTROL_MAX_BYTES = 64 * 1024
SCHEDULE_MAX_BYTES = 8 * 1024 * 1024
MAX_ID_CHARS, MAX_REASON_CHARS = 64, 1000


@dataclass(frozen=True)
class Request:
    """One action for a run; `step` is set when rank 0 schedules it."""

    id: str
    action: str                 # stop | scale_lr | warn
    factor: float | None = None  # for scale_lr
    source: str = "control"      # plateau | nonfinite | control | alert
    reason: str = ""
    created: float = 0.0         # unix seconds
    step: int | None = None      # the global step after which every rank applies it

    def describe(self) -> str:
        """One line for logs (the reason may come from a file: line breaks are escaped)."""
        what = f"scale_lr x{self.factor:g}" if self.action == "scale_lr" else self.action
        reason = _one_line(self.reason)
        return f"{what} (source {self.source}{': ' + reason if reason else ''})"

    @classmethod
    def from_json(cls, data: Any) -> Request:
        """Request from parsed JSON; ValueError (only) naming what is wrong."""
        if not isinstance(data, dict):
            raise ValueError(f"a request must be a JSON object, not {_json_kind(data)}")
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        request_id = known.get("id")
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("the request has no id (a non-empty string)")
        if len(request_id) > MAX_ID_CHARS or not request_id.isprintable():
            raise ValueError(f"id {_short(request_id[:MAX_ID_CHARS])}: at most "
                             f"{MAX_ID_CHARS} printable characters")
        reason = known.get("reason", "")
        if not isinstance(reason, str):
            raise ValueError(f"reason: a string, not {_json_kind(reason)}")
        created = _finite(known.get("created", 0.0), "created (unix seconds)")
        return new_request(known.get("action"), known.get("factor"), known.get("source", "control"),
                           reason[:MAX_REASON_CHARS], request_id=request_id, created=created,
                           step=known.get("step"))


def _json_kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(value), "a number")


def _one_line(text: str) -> str:
    """`text` with line breaks and other control characters escaped (one log line)."""
    return text if text.isprintable() else "".join(
        ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text)


def _short(value: Any) -> str:
    """`repr(value)` for a message: one line, at most 40 characters, safe for huge integers."""
    try:
        text = repr(value)
    except ValueError:   # an integer too long to print (sys.get_int_max_str_digits)
        return "a number with thousands of digits"
    return _one_line(text[:40])


def _finite(value: Any, what: str) -> float:
    """`value` as a finite float; ValueError naming `what` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what}: a number, not {_json_kind(value)}")
    try:
        number = float(value)
    except OverflowError:   # an integer with hundreds of digits
        number = math.inf
    if not math.isfinite(number):
        raise ValueError(f"{what}: a finite number, not {_short(value)}")
    return number


def new_request(action: Any, factor: Any = None, source: str = "control", reason: str = "",
                request_id: str | None = None, created: float | None = None,
                step: Any = None) -> Request:
    """A validated Request; ValueError for an unknown action, a bad factor or source."""
    if not isinstance(action, str) or action not in REQUEST_ACTIONS:
        raise ValueError(f"action {_short(action)} is not one of "
                         f"{', '.join(REQUEST_ACTIONS)}")
    if action == "scale_lr":
        try:
            number = _finite(factor, "factor")
        except ValueError:
            number = -1.0
        low, high = LR_FACTOR_RANGE
        if not low <= number <= high:
            raise ValueError(f"scale_lr needs a positive factor from {low:g} to {high:g} (the "
                             f"bounds of actions.*.factor), not {_short(factor)}")
        factor = number
    else:
        factor = None
    if not isinstance(source, str) or source not in SOURCES:
        raise ValueError(f"source {_short(source)} is not one of "
                         f"{', '.join(SOURCES)}")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ValueError(f"step {_short(step)} is not a step number")
    return Request(request_id or uuid.uuid4().hex[:12], action, factor, source, reason,
                   time.time() if created is None else created, step)


# ---------------------------------------------------------------- who may read the files
@dataclass(frozen=True)
class Trainer:
    """The user rank 0 runs as (recorded in schedule.json): who must be able to read requests."""

    uid: int
    groups: frozenset[int]
    user: str = ""

    @classmethod
    def current(cls) -> Trainer:
        uid = os.geteuid()
        return cls(uid, frozenset({os.getegid(), *os.getgroups()}), user_name(uid))

    @classmethod
    def of_uid(cls, uid: int) -> Trainer:
        """From the user database (groups unknown when the user is not in it)."""
        try:
            entry = pwd.getpwuid(uid)
            return cls(uid, frozenset(os.getgrouplist(entry.pw_name, entry.pw_gid)), entry.pw_name)
        except (KeyError, OSError):
            return cls(uid, frozenset())

    def can_read(self, st: os.stat_result) -> bool:
        """Whether this user may read a file of `st`'s owner, group and mode (POSIX classes)."""
        if self.uid == 0:
            return True
        if self.uid == st.st_uid:
            return bool(st.st_mode & stat.S_IRUSR)
        if st.st_gid in self.groups:
            return bool(st.st_mode & stat.S_IRGRP)
        return bool(st.st_mode & stat.S_IROTH)

    def describe(self) -> str:
        return f"user {self.user} (uid {self.uid})" if self.user else f"uid {self.uid}"

    def record(self) -> dict[str, Any]:
        return {"uid": self.uid, "groups": sorted(self.groups), "user": self.user}


class NotReadableByTrainer(PermissionError):
    """The request would be written where the trainer cannot read it: nothing was written."""


def trainer_of(job_dir: Path) -> Trainer | None:
    """The trainer of `job_dir`: the user rank 0 recorded in (and owning) schedule.json."""
    path = job_dir / SCHEDULE_FILE
    try:
        owner = os.stat(path).st_uid
    except OSError:
        return None   # no run has started here yet
    try:
        record = json.loads(read_regular_file(os.fspath(path), SCHEDULE_MAX_BYTES)).get("trainer")
        if isinstance(record, dict) and record.get("uid") == owner:
            groups = [g for g in record.get("groups", []) if isinstance(g, int)]
            return Trainer(owner, frozenset(groups), str(record.get("user", ""))[:64])
    except (OSError, ValueError, AttributeError, RecursionError):
        pass          # not readable by this user, or an older schedule: the user database
    return Trainer.of_uid(owner)


def file_mode(dir_mode: int) -> int:
    """Owner read-write; group and others may read when the directory lets them in."""
    mode = stat.S_IRUSR | stat.S_IWUSR
    if dir_mode & stat.S_IXGRP:
        mode |= stat.S_IRGRP
    if dir_mode & stat.S_IXOTH:
        mode |= stat.S_IROTH
    return mode


def _share(fd: int, directory: os.stat_result, trainer: Trainer | None) -> None:
    """Give the new file the directory's group (root: also the trainer's user) and mode."""
    owner = -1
    if os.geteuid() == 0:
        owner = trainer.uid if trainer is not None else directory.st_uid
    try:
        os.fchown(fd, owner, directory.st_gid)
    except PermissionError:  # not a member of the directory's group: keep the writer's own
        pass
    os.fchmod(fd, file_mode(directory.st_mode))


def _not_readable(path: Path, st: os.stat_result, trainer: Trainer) -> NotReadableByTrainer:
    name = trainer.user or str(trainer.uid)
    return NotReadableByTrainer(
        f"{path} would not be readable by the trainer, {trainer.describe()}: the file would "
        f"belong to uid {st.st_uid} and group {group_name(st.st_gid)} with mode "
        f"{stat.filemode(st.st_mode)}, and the directory {path.parent} is mode "
        f"{stat.filemode(os.stat(path.parent).st_mode)}; nothing was written. Fix: run this as "
        f"{name}, or add {name} to group {group_name(st.st_gid)}, or share a control root "
        f"through a group both belong to (chgrp GROUP DIR && chmod 2770 DIR)")


# ---------------------------------------------------------------- files
def write_json_atomic(path: Path, data: Any, reader: Trainer | None = None) -> None:
    """Write JSON to a temporary file beside `path`, fsync, then rename over `path`.

    A reader sees the old or the new file, never a half-written one. The file gets the
    permissions of the module docstring; NotReadableByTrainer (nothing written) when `reader`
    could not read it.
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            _share(fd, os.stat(path.parent), reader)
            if reader is not None and not reader.can_read(os.fstat(fd)):
                raise _not_readable(path, os.fstat(fd), reader)
            json.dump(data, handle, indent=1, sort_keys=True)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def make_job_dir(job_dir: Path) -> None:
    """Create the job's control directory (rank 0, at train begin).

    In a shared control root (setgid) it gets the root's group permissions whatever the
    trainer's umask, so the group's members may write requests. Nothing it creates is
    writable by others, whatever the umask (mfotel.actions.ownership would refuse it).
    """
    created = [path for path in (job_dir, *job_dir.parents) if not os.path.lexists(path)]
    job_dir.mkdir(parents=True, exist_ok=True)
    for path in created:
        mode = stat.S_IMODE(os.stat(path).st_mode)
        if mode & stat.S_IWOTH:
            os.chmod(path, mode & ~stat.S_IWOTH)
    parent = os.stat(job_dir.parent)
    if job_dir in created and parent.st_mode & stat.S_ISGID:
        mode = stat.S_IMODE(os.stat(job_dir).st_mode)
        os.chmod(job_dir, mode | (parent.st_mode & 0o070) | stat.S_ISGID)


def write_request(job_dir: str | Path, request: Request) -> Path:
    """Atomically replace `job_dir/control.json` with `request`, readable by the trainer.

    FileNotFoundError if no dir; NotReadableByTrainer or PermissionError (both saying whose
    directory it is and the fix) when the request could not reach the trainer.
    """
    job_dir = Path(job_dir)
    try:
        is_dir = job_dir.is_dir()
    except PermissionError as exc:   # a directory on the path this user may not enter
        raise unreachable(job_dir, exc) from None
    if not is_dir:
        raise FileNotFoundError(f"{job_dir} is not a control directory (rank 0 of a job with "
                                f"monitor_config.actions.control_dir creates it at train begin)")
    path = job_dir / CONTROL_FILE
    trainer = trainer_of(job_dir)
    try:
        write_json_atomic(path, asdict(request), trainer)
    except NotReadableByTrainer:
        raise
    except PermissionError as exc:
        owner = trainer or Trainer.of_uid(job_dir.stat().st_uid)
        raise PermissionError(
            f"cannot write in {job_dir} ({exc.strerror}): the directory belongs to "
            f"{owner.describe()}, group {group_name(job_dir.stat().st_gid)}, mode "
            f"{stat.filemode(job_dir.stat().st_mode)}. Fix: run this as "
            f"{owner.user or owner.uid}, or share a control root through a group both belong "
            f"to (chgrp GROUP DIR && chmod 2770 DIR: rank 0 then creates job directories the "
            f"group may write)") from None
    return path


def write_schedule(job_dir: Path, requests: Sequence[Request]) -> None:
    """Rank 0's schedule, with who the trainer is (writers check it can read their requests)."""
    write_json_atomic(job_dir / SCHEDULE_FILE, {"actions": [asdict(r) for r in requests],
                                                "trainer": Trainer.current().record()})


def parse_schedule(data: Any) -> list[Request]:
    if not isinstance(data, dict) or not isinstance(data.get("actions"), list):
        raise ValueError("a schedule is a JSON object with an 'actions' list")
    return [Request.from_json(item) for item in data["actions"]]


def parse_json_bytes(data: bytes, path: str) -> Any:
    """Parsed JSON; ValueError naming `path` for bytes that are not (UTF-8) JSON."""
    try:
        return json.loads(data.decode("utf-8"))
    except RecursionError:
        raise ValueError(f"{path} is not valid JSON (nested too deeply)") from None
    except (ValueError, UnicodeDecodeError) as exc:  # also integers too long to convert
        raise ValueError(f"{path} is not valid JSON ({_one_line(str(exc))[:200]})") from None


class FileWatch:
    """Reads a JSON file again only when it was replaced or changed: one stat() per poll.

        watch = FileWatch(job_dir / "control.json", CONTROL_MAX_BYTES)
        changed, data = watch.poll()   # data: a dict, or None when the file is missing

    Never blocks: see read_regular_file. A problem (not a JSON object, not a regular file,
    too large, unreadable) raises ValueError once, then the file is ignored until it changes.
    """

    def __init__(self, path: Path, limit: int = CONTROL_MAX_BYTES) -> None:
        self.path, self.limit = path, limit
        self._fspath = os.fspath(path)  # a str stats faster than a Path
        self._signature: tuple[int, ...] | None = None

    def poll(self) -> tuple[bool, Any]:
        """(changed, parsed JSON object or None); ValueError (once per change) for a bad file."""
        try:
            st = os.stat(self._fspath)
        except FileNotFoundError:
            changed, self._signature = self._signature is not None, None
            return changed, None
        except OSError as exc:  # permissions, a file where the directory was, a symlink loop
            return self._failed((-1, exc.errno or 0), f"{self.path}: cannot stat "
                                f"({exc.strerror or exc})")
        signature = (st.st_ino, st.st_mtime_ns, st.st_size, st.st_mode)
        if signature == self._signature:
            return False, None
        self._signature = signature
        try:
            data = read_regular_file(self._fspath, self.limit, st)
        except FileNotFoundError:  # replaced between stat and open: the next poll reads it
            self._signature = None
            return False, None
        except NotRegularFile as exc:
            raise ValueError(str(exc)) from None
        except PermissionError as exc:
            raise ValueError(f"{self.path}: cannot read ({exc.strerror}: it belongs to uid "
                             f"{st.st_uid} with mode {stat.filemode(st.st_mode)}; `mfotel "
                             f"control` writes requests the trainer can read)") from None
        except OSError as exc:
            raise ValueError(f"{self.path}: cannot read ({exc.strerror or exc})") from None
        parsed = parse_json_bytes(data, self._fspath)
        if not isinstance(parsed, dict):  # both files hold an object; None means "no file"
            raise ValueError(f"{self.path} holds {_json_kind(parsed)}, not a JSON object")
        return True, parsed

    def _failed(self, signature: tuple[int, ...], message: str) -> tuple[bool, Any]:
        if signature == self._signature:
            return False, None
        self._signature = signature
        raise ValueError(message)


# ---------------------------------------------------------------- alerts -> control
def job_dir_for(control_dir: str, job_name: str) -> Path:
    """`control_dir` with {job_name} filled in (appended as a sub-directory when absent).

    ValueError for a job name that could escape the directory (it comes from alert labels).
    """
    if not _JOB_NAME.fullmatch(job_name) or job_name in (".", ".."):
        raise ValueError(f"job_name {job_name!r} is not a plain name ([A-Za-z0-9._-])")
    template = control_dir if "{job_name}" in control_dir \
        else os.path.join(control_dir, "{job_name}")
    return Path(template.format(job_name=job_name)).expanduser().absolute()


#: Bounds on what AlertControl remembers, so a stream of made-up alerts cannot grow it forever.
MAX_REMEMBERED = 10_000


class AlertControl:
    """Turns a firing, allow-listed alert into a control request for the job in its labels.

        control = AlertControl("/shared/mfotel-control/{job_name}", ["MindFormersLossNotFinite"])
        control.handle(alert)   # an mfotel.alerting.webhook.ReceivedAlert

    Acts at most once per episode and a few times per job and hour, so neither Alertmanager's
    repeats nor a replayed or flapping alert can compound (ten fire/resolve pairs must not
    scale the lr by 2^-10):
    - one request per (job_name, alertname) while any alert of that pair fires: one alert per
      rank, and repeated notifications, act once;
    - one request per alert episode (fingerprint, startsAt): a replayed notification of an
      episode that already acted (even after it resolved) does nothing;
    - at most `max_actions` requests per job in any `window_seconds`; further ones are
      refused and printed.
    Jobs without a control directory (not using the control channel) are left alone.
    """

    def __init__(self, control_dir: str, alert_names: Sequence[str], action: str = "stop",
                 factor: float | None = None, out: TextIO | None = sys.stdout,
                 max_actions: int = 3, window_seconds: float = 3600.0) -> None:
        new_request(action, factor, "alert")  # validate now, not at the first page
        if not alert_names:
            raise ValueError("give at least one alert name to act on")
        if max_actions < 1 or not window_seconds > 0:
            raise ValueError("--control-max-actions must be >= 1 and --control-window-seconds > 0")
        self.control_dir, self.alert_names = control_dir, frozenset(alert_names)
        self.action, self.factor, self.out = action, factor, out
        self.max_actions, self.window_seconds = max_actions, window_seconds
        self.written: list[Path] = []
        self.refused = 0   # requests not written because of the per-job bound
        self._firing: OrderedDict[tuple[str, str], set[str]] = OrderedDict()
        self._episodes: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._acted: OrderedDict[str, deque[float]] = OrderedDict()

    def handle(self, alert: Any, now: float | None = None) -> Path | None:
        """Write a request for `alert` when it qualifies; the control file written, or None."""
        job_name, name = alert.labels.get("job_name", ""), alert.alertname
        if name not in self.alert_names or not job_name:
            return None
        key, ident = (job_name, name), alert.fingerprint or _label_fingerprint(alert.labels)
        firing = self._firing.get(key, set())
        if not alert.firing:
            firing.discard(ident)
            if not firing:
                self._firing.pop(key, None)
            return None
        episode = (ident, alert.starts_at)
        if episode in self._episodes:
            return None           # a repeat, or a replay of an episode that acted
        if firing:                # another rank's alert of this episode acted already
            self._remember(key, ident, episode)
            return None
        now = time.time() if now is None else now
        recent = self._acted.get(job_name, deque())
        while recent and recent[0] <= now - self.window_seconds:
            recent.popleft()
        if len(recent) >= self.max_actions:
            self.refused += 1
            self._remember(key, ident, episode)
            self._say(f"control: not acting on {name} for job {job_name}: {len(recent)} "
                      f"actions in the last {self.window_seconds:g} s already "
                      f"(--control-max-actions {self.max_actions})")
            return None
        try:
            job_dir = job_dir_for(self.control_dir, job_name)
            reason = f"alert {name} (rank {alert.labels.get('rank', '?')})"
            path = write_request(job_dir, new_request(self.action, self.factor, "alert", reason))
        except (ValueError, OSError) as exc:
            self._say(f"control: not acting on {name} for job {job_name!r}: {exc}")
            return None
        self._remember(key, ident, episode)
        recent.append(now)
        self._acted[job_name] = recent
        _bound(self._acted)
        self.written.append(path)
        self._say(f"control: {name} -> {self.action} requested for job {job_name} ({path})")
        return path

    def _remember(self, key: tuple[str, str], ident: str, episode: tuple[str, str]) -> None:
        self._firing.setdefault(key, set()).add(ident)
        self._episodes[episode] = None
        _bound(self._firing)
        _bound(self._episodes)

    def _say(self, text: str) -> None:
        if self.out is not None:
            self.out.write(f"mfotel alerts-receiver: {_one_line(text)}\n")
            self.out.flush()


def _bound(items: OrderedDict) -> None:
    while len(items) > MAX_REMEMBERED:
        items.popitem(last=False)


def _label_fingerprint(labels: dict[str, str]) -> str:
    """A stand-in for Alertmanager's fingerprint when a sender gives none."""
    return hashlib.sha256(json.dumps(labels, sort_keys=True).encode()).hexdigest()[:16]


def add_alert_control_arguments(parser: argparse.ArgumentParser) -> None:
    """The receiver's `--control-*` options (off unless `--control-dir` is given)."""
    group = parser.add_argument_group("control actions (off unless --control-dir is given)")
    group.add_argument("--control-dir", metavar="DIR",
                       help="control directories of the jobs; {job_name} is filled in from the "
                            "alert's labels (appended as a sub-directory when absent)")
    group.add_argument("--control-alerts", metavar="NAME", nargs="+",
                       default=["MindFormersLossNotFinite"],
                       help="alert names that trigger the action (default: %(default)s)")
    group.add_argument("--control-action", choices=("stop", "scale_lr"), default="stop")
    group.add_argument("--control-factor", type=float, default=None,
                       help="learning-rate multiplier for --control-action scale_lr")
    group.add_argument("--control-max-actions", type=int, default=3, metavar="N",
                       help="at most N actions per job in any --control-window-seconds "
                            "(default: %(default)s)")
    group.add_argument("--control-window-seconds", type=float, default=3600.0, metavar="S",
                       help="the window of --control-max-actions (default: %(default)s)")


def alert_control_from_args(args: argparse.Namespace, out: TextIO | None = sys.stdout
                            ) -> AlertControl | None:
    if not getattr(args, "control_dir", None):
        return None
    return AlertControl(args.control_dir, args.control_alerts, args.control_action,
                        args.control_factor, out, args.control_max_actions,
                        args.control_window_seconds)


# ---------------------------------------------------------------- command line
def _show(job_dir: Path) -> int:
    try:
        os.stat(job_dir)
    except PermissionError as exc:
        print(f"mfotel control: error: {unreachable(job_dir, exc)}", file=sys.stderr)
        return 2
    except OSError:
        pass      # a missing directory: each file says (none)
    for name, limit in ((CONTROL_FILE, CONTROL_MAX_BYTES), (SCHEDULE_FILE, SCHEDULE_MAX_BYTES)):
        path = job_dir / name
        print(f"# {path}")
        try:
            text = read_regular_file(os.fspath(path), limit).decode("utf-8", "replace").rstrip()
        except FileNotFoundError:
            text = "(none)"
        except OSError as exc:
            text = f"(cannot read: {exc.strerror or exc})"
        except NotRegularFile as exc:
            text = f"({exc})"
        print(text)
    return 0


def run(args: argparse.Namespace) -> int:
    """`mfotel control`: write a request (or --show the files)."""
    job_dir = Path(args.job_dir)
    if args.show:
        return _show(job_dir)
    action, factor = ("stop", None) if args.stop else ("scale_lr", args.scale_lr)
    try:
        request = new_request(action, factor, "control", args.reason or "")
        path = write_request(job_dir, request)
    except (ValueError, OSError) as exc:
        print(f"mfotel control: error: {exc}", file=sys.stderr)
        return 2
    print(f"mfotel control: requested {request.describe()} as {request.id} in {path}; "
          f"rank 0 schedules it and every rank applies it at the same step")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("job_dir", metavar="JOB_DIR",
                        help="the job's control directory (actions.control_dir, with the "
                             "job name filled in)")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--stop", action="store_true", help="stop the run cleanly")
    what.add_argument("--scale-lr", type=float, metavar="FACTOR",
                      help="multiply the learning rate by FACTOR (e.g. 0.5)")
    what.add_argument("--show", action="store_true", help="print the request and the schedule")
    parser.add_argument("--reason", default="", help="free text, logged with the action")
    return parser


COMMAND = Subcommand("control", "stop a run or scale its learning rate", "mfotel control",
                     add_arguments, run, __doc__)
add_control_command = COMMAND.register
main = COMMAND.main


if __name__ == "__main__":
    sys.exit(main())
