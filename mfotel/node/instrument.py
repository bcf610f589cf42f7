"""`mfotel-instrument <command>`: run any command with mfotel registered in mindformers.

    mfotel-instrument python run_mindformer.py --config llama.yaml
    mfotel-instrument msrun --worker_num=8 ... run_mindformer.py --config llama.yaml

In the style of `opentelemetry-instrument`: a directory holding a `sitecustomize.py` goes first
on PYTHONPATH of the command. Every Python process the command starts (msrun's workers
included, they inherit the environment) runs that sitecustomize at start-up. It costs next to
nothing there (it imports nothing, it installs an import hook); when the process imports
mindformers, the hook calls `mfotel.integrations.mindformers.register()` right after, which
registers `OTelMonitor` and `CPUTrainOneStepCell` before any Trainer can build its callbacks. A
`sitecustomize` that was already on the path (Debian ships one) still runs: ours chains to it.

mfotel-instrument then stays the parent of the command (`mfotel.node.supervise`): a
cancel (SIGTERM, SIGINT, SIGHUP) reaches every process of the job, msrun's workers included,
so each rank reports "cancelled" instead of paging as dead; it exits as the command did.
As the job's node agent (`mfotel.node.service`) it serves one node endpoint
(`prometheus.node_port`, default 9463) with what no rank can say about itself: each rank's
process state, how it ended (exit code, signal, OOM kill), whether its /metrics still
answers, its CPU and memory. The ranks tell it who they are: the command's environment names a
directory private to the job (`MFOTEL_NODE_DIR`, mode 0700, removed when mfotel-instrument
exits) where each rank under mfotel announces itself at train begin. `--exec` replaces this
process by the command instead, as earlier versions did: signals are then the command's
business, and there is no node agent.

The directory is written once per user (MFOTEL_INSTRUMENT_DIR overrides where).
"""
from __future__ import annotations

import math
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from mfotel.closed_pipe import quiet_on_closed_pipe
from mfotel.node import supervise
from mfotel.node.agent import DEFAULT_PROBE_INTERVAL, DEFAULT_PROBE_TIMEOUT
from mfotel.node.service import (
    NODE_LINGER_SECONDS,
    NodeService,
    training_config_or_exit,
    with_node_port,
)

USAGE = f"""usage: mfotel-instrument [--stop-timeout SECONDS] [--config YAML] [--node-port PORT]
                         [--node-linger SECONDS] [--node-probe-interval SECONDS] [--exec]
                         [--] COMMAND [ARGS...]

Runs COMMAND with mfotel registered in every mindformers process it starts, so that a
mindformers YAML can list `{{type: OTelMonitor, ...}}` under `callbacks:` without code changes.

SIGTERM, SIGINT (Ctrl-C) and SIGHUP reach every process COMMAND started, msrun's workers
included, so that each rank reports "cancelled" and lingers for its final scrape; processes
still running --stop-timeout seconds later are killed. The exit status is COMMAND's (killed
by the signal after a cancel).

Once a rank starts, the node endpoint serves each rank's process state, exit cause (exit
code, signal, OOM kill), liveness of its /metrics, CPU and memory, with the ranks' bind
address, web-config (TLS, basic auth) and limits. Once scraped, it stays up --node-linger
seconds after the job ended, so that every Prometheus sees how each rank ended; a second
SIGTERM / SIGINT ends it at once.

options:
  --stop-timeout SECONDS  after a cancel, SIGKILL what still runs this much later (default
                          {supervise.DEFAULT_STOP_TIMEOUT:g}); keep it above the monitor's
                          prometheus.linger_seconds
  --config YAML           the ranks' training YAML (monitor_config block or mindformers
                          OTelMonitor entry); default: COMMAND's --config YAML when it holds
                          mfotel settings
  --node-port PORT        node endpoint port (default: prometheus.node_port, else
                          prometheus.port - 1 = 9463); 0 turns the node endpoint off
  --node-linger SECONDS   serve the ranks' final facts this long after the job ended, once
                          scraped (default {NODE_LINGER_SECONDS:g}: a scrape, an evaluation and
                          Alertmanager's group_wait)
  --node-probe-interval SECONDS
                          how often each rank's /metrics is probed for liveness (default
                          {DEFAULT_PROBE_INTERVAL:g}; {DEFAULT_PROBE_TIMEOUT:g} s time-out)
  --exec                  replace this process by COMMAND, passing no signal on (as before;
                          no node endpoint)

examples:
  mfotel-instrument python run_mindformer.py --config finetune.yaml
  mfotel-instrument msrun --worker_num=8 --local_worker_num=8 run_mindformer.py --config x.yaml
"""

#: Set in the environment of the command, so that processes (and tests) can tell.
ENV_FLAG = "MFOTEL_INSTRUMENTED"
ENV_DIR = "MFOTEL_INSTRUMENT_DIR"

SITECUSTOMIZE = '''\
"""Written by mfotel-instrument (safe to delete): registers mfotel when mindformers is imported.

Self-contained on purpose: a process that never imports mindformers imports nothing more.
"""
import importlib.abc as _abc
import importlib.machinery as _machinery
import importlib.util as _util
import os as _os
import sys as _sys


def _mfotel_register():
    """Register OTelMonitor and CPUTrainOneStepCell in mindformers."""
    from mfotel.integrations import mindformers

    mindformers.register()


class _MfotelPostImportHook(_abc.MetaPathFinder):
    """Registers mfotel in mindformers right after mindformers finished importing (one shot)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "mindformers":
            return None
        _sys.meta_path.remove(self)
        spec = _util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            try:
                _mfotel_register()
            except Exception as exc:  # never break the user's import
                _sys.stderr.write("mfotel-instrument: registering mfotel in mindformers failed "
                                  f"({type(exc).__name__}: {exc})\\n")

        spec.loader.exec_module = exec_then_register
        return spec


def _mfotel_chain_sitecustomize():
    """Run the sitecustomize this one shadows (e.g. Debian's), as site would have."""
    own = _os.path.dirname(_os.path.abspath(__file__))
    rest = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != own]
    spec = _machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    try:
        spec.loader.exec_module(_util.module_from_spec(spec))
    except Exception as exc:  # site ignores a failing sitecustomize too
        _sys.stderr.write(f"mfotel-instrument: {spec.origin} failed "
                          f"({type(exc).__name__}: {exc})\\n")


if "mindformers" in _sys.modules:
    _mfotel_register()
elif not any(type(f).__name__ == "_MfotelPostImportHook" for f in _sys.meta_path):
    _sys.meta_path.insert(0, _MfotelPostImportHook())
_mfotel_chain_sitecustomize()
'''


def bootstrap_dir() -> Path:
    """The directory holding mfotel's sitecustomize.py (created if needed)."""
    configured = os.environ.get(ENV_DIR)
    candidates = [configured] if configured else []
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    candidates += [os.path.join(cache, "mfotel", "instrument"),
                   os.path.join(tempfile.gettempdir(), f"mfotel-{os.getuid()}", "instrument")]
    errors = []
    for candidate in candidates:
        path = Path(candidate)
        try:
            _write_if_changed(path / "sitecustomize.py", SITECUSTOMIZE)
            return path
        except OSError as exc:
            errors.append(f"{path}: {exc.strerror or exc}")
    raise SystemExit("mfotel-instrument: cannot write sitecustomize.py (" + "; ".join(errors)
                     + f"). Fix: set {ENV_DIR} to a writable directory")


def _write_if_changed(path: Path, text: str) -> None:
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)  # atomic: concurrent launches on one node never see half a file


def instrumented_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) with the bootstrap directory first on PYTHONPATH."""
    env = dict(os.environ if env is None else env)
    directory = str(bootstrap_dir())
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != directory]
    env["PYTHONPATH"] = os.pathsep.join([directory, *paths])
    env[ENV_FLAG] = "1"
    return env


@dataclass(frozen=True)
class Options:
    command: list[str]
    stop_timeout: float = supervise.DEFAULT_STOP_TIMEOUT
    exec_: bool = False
    config: str | None = None
    node_port: int | None = None
    node_linger: float | None = None
    node_probe_interval: float = DEFAULT_PROBE_INTERVAL


_VALUED = ("--stop-timeout", "--config", "--node-port", "--node-linger", "--node-probe-interval")


def parse_args(args: Sequence[str]) -> Options:
    """Options go before the command; SystemExit(2) with the fix for a bad one."""
    args = list(args)
    values: dict[str, Any] = {}
    while args and args[0].startswith("-"):
        option = args.pop(0)
        if option == "--":
            break
        if option in ("-h", "--help"):
            print(USAGE, end="")
            raise SystemExit(0)
        name = option.split("=", 1)[0]
        if option == "--exec":
            values["exec_"] = True
        elif name in _VALUED:
            value = option.split("=", 1)[1] if "=" in option else (args.pop(0) if args else "")
            values[name[2:].replace("-", "_")] = _value(name, value)
        else:
            _usage_error(f"unknown option {option} (options go before the command: "
                         f"{', '.join(_VALUED)}, --exec)")
    if not args:
        print(USAGE, end="")
        raise SystemExit(2)
    return Options(args, **values)


def _value(option: str, value: str) -> Any:
    if option == "--node-port":
        return _port(value)
    if option == "--config":
        if not value:
            _usage_error("--config needs the path of the ranks' training YAML")
        return value
    return _seconds(value, option, zero=option == "--node-linger")


def _seconds(value: str, option: str, zero: bool) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    high = supervise.MAX_STOP_TIMEOUT
    if not (0 <= seconds <= high and (zero or seconds > 0)):
        _usage_error(f"{option} needs seconds in {'[' if zero else '('}0, {high:g}], got "
                     f"{value!r}; e.g. {option} 60")
    return seconds


def _port(value: str) -> int:
    if not (value.isascii() and value.isdigit() and int(value) <= 65535):
        _usage_error(f"--node-port needs a port in 0..65535 (0 turns the node endpoint off), "
                     f"got {value!r}; e.g. --node-port 9463")
    return int(value)


def _usage_error(message: str) -> NoReturn:
    sys.stderr.write(f"mfotel-instrument: {message}\n")
    raise SystemExit(2)


def node_service(options: Options) -> NodeService | None:
    """The node agent of the job, None when its endpoint is off (SystemExit(2) on a bad
    training config: the ranks would refuse it too)."""
    cfg = with_node_port(training_config_or_exit(options.command, options.config),
                         options.node_port)
    service = NodeService(cfg, options.node_linger, options.node_probe_interval)
    return service if service.port else None


@quiet_on_closed_pipe
def main(argv: Sequence[str] | None = None) -> None:
    options = parse_args(sys.argv[1:] if argv is None else argv)
    command, env = options.command, instrumented_env()
    try:
        if options.exec_:
            os.execvpe(command[0], command, env)
        service = node_service(options)
        if service is not None:  # the ranks announce themselves to its agent
            env = service.rendezvous(env)
        try:
            supervise.run(command, env, options.stop_timeout, service)
        finally:  # reached when the command could not start: run() ends this process
            if service is not None:
                service.close()
    except FileNotFoundError:
        sys.stderr.write(f"mfotel-instrument: command not found: {command[0]}\n")
        raise SystemExit(127) from None
    except PermissionError:
        sys.stderr.write(f"mfotel-instrument: not executable: {command[0]}\n")
        raise SystemExit(126) from None


if __name__ == "__main__":
    main()
