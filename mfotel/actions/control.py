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

No MindSpore import here: the CLI and the alerts receiver run anywhere.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence, TextIO

CONTROL_FILE = "control.json"
SCHEDULE_FILE = "schedule.json"
REQUEST_ACTIONS = ("stop", "scale_lr", "warn")
#: Values of the `source` label of mindformers_train_actions_total.
SOURCES = ("plateau", "nonfinite", "control", "alert")
_JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")


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
        what = f"scale_lr x{self.factor:g}" if self.action == "scale_lr" else self.action
        return f"{what} (source {self.source}{': ' + self.reason if self.reason else ''})"

    @classmethod
    def from_json(cls, data: Any) -> "Request":
        """Request from parsed JSON; ValueError naming what is wrong."""
        if not isinstance(data, dict):
            raise ValueError(f"a request must be a JSON object, not {type(data).__name__}")
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        if not isinstance(known.get("id"), str) or not known["id"]:
            raise ValueError("the request has no id")
        return new_request(known.get("action"), known.get("factor"), known.get("source", "control"),
                           str(known.get("reason", "")), request_id=known["id"],
                           created=float(known.get("created", 0.0)), step=known.get("step"))


def new_request(action: Any, factor: Any = None, source: str = "control", reason: str = "",
                request_id: str | None = None, created: float | None = None,
                step: Any = None) -> Request:
    """A validated Request; ValueError for an unknown action, a bad factor or source."""
    if action not in REQUEST_ACTIONS:
        raise ValueError(f"action {action!r} is not one of {', '.join(REQUEST_ACTIONS)}")
    if action == "scale_lr":
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0 \
                or factor == float("inf"):
            raise ValueError(f"scale_lr needs a positive factor, not {factor!r}")
        factor = float(factor)
    else:
        factor = None
    if source not in SOURCES:
        raise ValueError(f"source {source!r} is not one of {', '.join(SOURCES)}")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ValueError(f"step {step!r} is not a step number")
    return Request(request_id or uuid.uuid4().hex[:12], action, factor, source, reason,
                   time.time() if created is None else created, step)


# ---------------------------------------------------------------- files
def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON to a temporary file beside `path`, fsync, then rename over `path`.

    A reader sees the old or the new file, never a half-written one.
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(data, handle, indent=1, sort_keys=True)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_request(job_dir: str | Path, request: Request) -> Path:
    """Atomically replace `job_dir/control.json` with `request`; FileNotFoundError if no dir."""
    job_dir = Path(job_dir)
    if not job_dir.is_dir():
        raise FileNotFoundError(f"{job_dir} is not a control directory (rank 0 of a job with "
                                f"monitor_config.actions.control_dir creates it at train begin)")
    path = job_dir / CONTROL_FILE
    write_json_atomic(path, asdict(request))
    return path


def write_schedule(job_dir: Path, requests: Sequence[Request]) -> None:
    write_json_atomic(job_dir / SCHEDULE_FILE, {"actions": [asdict(r) for r in requests]})


def parse_schedule(data: Any) -> list[Request]:
    if not isinstance(data, dict) or not isinstance(data.get("actions"), list):
        raise ValueError("a schedule is a JSON object with an 'actions' list")
    return [Request.from_json(item) for item in data["actions"]]


class FileWatch:
    """Reads a JSON file again only when it was replaced or changed: one stat() per poll.

        watch = FileWatch(job_dir / "control.json")
        changed, data = watch.poll()   # data is None when the file is missing
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fspath = os.fspath(path)  # a str stats faster than a Path
        self._signature: tuple[int, int, int] | None = None

    def poll(self) -> tuple[bool, Any]:
        """(changed, parsed JSON or None); ValueError for a file that is not JSON."""
        try:
            st = os.stat(self._fspath)
        except FileNotFoundError:
            changed, self._signature = self._signature is not None, None
            return changed, None
        signature = (st.st_ino, st.st_mtime_ns, st.st_size)
        if signature == self._signature:
            return False, None
        self._signature = signature
        try:
            with open(self.path, encoding="utf-8") as handle:
                return True, json.load(handle)
        except FileNotFoundError:  # replaced between stat and open: the next poll reads it
            self._signature = None
            return False, None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{self.path} is not valid JSON ({exc})") from None


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


class AlertControl:
    """Turns a firing, allow-listed alert into a control request for the job in its labels.

        control = AlertControl("/shared/mfotel-control/{job_name}", ["MindFormersLossNotFinite"])
        control.handle(alert)   # an mfotel.alerts_receiver.ReceivedAlert

    One request per (job_name, alertname) until that alert is resolved, so repeated
    notifications and one alert per rank act once. Jobs without a control directory (not
    using the control channel) are left alone.
    """

    def __init__(self, control_dir: str, alert_names: Sequence[str], action: str = "stop",
                 factor: float | None = None, out: TextIO | None = sys.stdout) -> None:
        new_request(action, factor, "alert")  # validate now, not at the first page
        if not alert_names:
            raise ValueError("give at least one alert name to act on")
        self.control_dir, self.alert_names = control_dir, frozenset(alert_names)
        self.action, self.factor, self.out = action, factor, out
        self.written: list[Path] = []
        self._active: set[tuple[str, str]] = set()

    def handle(self, alert: Any) -> Path | None:
        """Write a request for `alert` when it qualifies; the control file written, or None."""
        job_name, name = alert.labels.get("job_name", ""), alert.alertname
        if name not in self.alert_names or not job_name:
            return None
        key = (job_name, name)
        if not alert.firing:
            self._active.discard(key)
            return None
        if key in self._active:
            return None
        try:
            job_dir = job_dir_for(self.control_dir, job_name)
            reason = f"alert {name} (rank {alert.labels.get('rank', '?')})"
            path = write_request(job_dir, new_request(self.action, self.factor, "alert", reason))
        except (ValueError, OSError) as exc:
            self._say(f"control: not acting on {name} for job {job_name!r}: {exc}")
            return None
        self._active.add(key)
        self.written.append(path)
        self._say(f"control: {name} -> {self.action} requested for job {job_name} ({path})")
        return path

    def _say(self, text: str) -> None:
        if self.out is not None:
            self.out.write(f"mfotel alerts-receiver: {text}\n")
            self.out.flush()


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


def alert_control_from_args(args: argparse.Namespace, out: TextIO | None = sys.stdout
                            ) -> AlertControl | None:
    if not getattr(args, "control_dir", None):
        return None
    return AlertControl(args.control_dir, args.control_alerts, args.control_action,
                        args.control_factor, out)


# ---------------------------------------------------------------- command line
def _show(job_dir: Path) -> int:
    for name in (CONTROL_FILE, SCHEDULE_FILE):
        path = job_dir / name
        print(f"# {path}")
        print(path.read_text().rstrip() if path.exists() else "(none)")
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


def add_control_command(subparsers: Any) -> argparse.ArgumentParser:
    """Register `control` on argparse subparsers; dispatch via `args.func(args)`."""
    parser = subparsers.add_parser("control", help="stop a run or scale its learning rate",
                                   description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = add_arguments(argparse.ArgumentParser(prog="mfotel control",
                                                   description=__doc__.splitlines()[0]))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
