"""Check a full mindformers YAML before a run: `mfotel check finetune.yaml`.

    problems = check_mindformers_yaml("finetune.yaml")   # [] when the file is fine
    report = mfotel.checks.check_file("finetune.yaml", document_check=document_check())

Checks, each problem one line naming the file, the key and the fix:
- the native `monitor_config` against mindformers' own key list (unknown keys raise KeyError at
  start): mfotel keys put there by mistake are pointed to the callback entry. The 1.9 list is
  kept here; mindformers itself is imported only when needed (another installed version, or
  `monitor_on: True`, whose settings TrainingStateMonitor validates), silenced (the import
  takes seconds and prints warnings; its log goes to a temporary directory unless LOG_MF_PATH
  is set);
- the `{type: OTelMonitor, ...}` callback entry through mfotel's own config; a missing or
  misspelt entry (mfotel would be off);
- known pitfalls: CPU runs with a non-empty `monitor_config.dump_path` (its default is ./dump),
  Ascend-only native metrics on CPU, MFTrainOneStepCell on CPU, Llama without `use_rope_slice`
  on CPU, `grad_norm` asked for while the train cell does not clip (so returns no norm).
"""
from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

from ..config import KNOWN_KEYS, ConfigError, did_you_mean, parse_config, read_yaml
from ..config.errors import show
from ..config.settings import NATIVE_MONITOR_KEYS
from ..config.source import callback_entries, entry_settings, missing_entry_error

#: The mindformers release whose key list NATIVE_MONITOR_KEYS copies.
NATIVE_KEYS_VERSION = "1.9."
NATIVE_DEFAULT_DUMP_PATH = "./dump"
#: Native metrics that only a TensorDump (Ascend) produces.
DUMP_ONLY_FORMATS = ("device_local_norm_format", "local_loss_format")


def check_mindformers_yaml(path: str | Path, use_mindformers: bool | None = None) -> list[str]:
    """Problems of a mindformers YAML, [] if none. `use_mindformers`: None = when installed."""
    source = str(path)
    try:
        document = read_yaml(path)
    except ConfigError as exc:
        return [str(exc)]
    if not isinstance(document, Mapping):
        return [f"{source}: -: the file is not a YAML mapping. Fix: write a mindformers config"]
    if use_mindformers is None:
        use_mindformers = _mindformers_installed()
    return mindformers_problems(source, document, use_mindformers)


def document_check(use_mindformers: bool | None = None
                   ) -> Callable[[str, Mapping[str, Any]], list[str]]:
    """`mindformers_problems` as mfotel.checks runs it on a mindformers YAML (a
    mfotel.config.check.DocumentCheck). `use_mindformers`: None = when installed."""
    def check(source: str, document: Mapping[str, Any]) -> list[str]:
        use = _mindformers_installed() if use_mindformers is None else use_mindformers
        return mindformers_problems(source, document, use)
    return check


def mindformers_problems(source: str, document: Mapping[str, Any], use_mindformers: bool
                         ) -> list[str]:
    """Problems of a parsed mindformers YAML (native monitor_config, callbacks, CPU)."""
    problems: list[str] = []
    problems += _check_monitor_config(source, document, use_mindformers)
    problems += _check_callbacks(source, document)
    problems += _check_cpu(source, document)
    return problems


# ---------------------------------------------------------------------------- monitor_config
def _check_monitor_config(source: str, document: Mapping[str, Any], use_mindformers: bool
                          ) -> list[str]:
    monitor = document.get("monitor_config")
    if monitor is None:
        return []
    if not isinstance(monitor, Mapping):
        return [f"{source}: monitor_config: {show(monitor)} is not a mapping. "
                f"Fix: indent its keys under monitor_config as key: value pairs"]
    native_keys = _native_keys(use_mindformers)
    problems = []
    for key in monitor:
        if key in native_keys:
            continue
        if key in KNOWN_KEYS:
            problems.append(
                f"{source}: monitor_config.{key}: mindformers rejects this mfotel key here "
                f"(KeyError at start). Fix: move it to the callback entry "
                f"`callbacks: [..., {{type: OTelMonitor, {key}: ...}}]`")
        else:
            problems.append(
                f"{source}: monitor_config.{key}: unknown key, mindformers raises KeyError at "
                f"start. Fix: remove it{did_you_mean(key, native_keys)}")
    if use_mindformers and not problems and monitor.get("monitor_on"):
        problems += _native_validation(source, monitor)
    return problems


def _native_validation(source: str, monitor: Mapping[str, Any]) -> list[str]:
    """mindformers' template, then TrainingStateMonitor's own checks (what Trainer runs)."""
    with _quiet_mindformers():
        from mindformers.core.callback.callback import TrainingStateMonitor
        from mindformers.tools.register import MindFormerConfig
        from mindformers.tools.register.template import MonitorConfig
        try:
            applied = MonitorConfig.apply(dict(monitor))
        except (KeyError, TypeError, ValueError) as exc:
            return [f"{source}: monitor_config: {exc}"]
        if not applied.get("monitor_on"):
            return []
        try:
            TrainingStateMonitor(origin_epochs=1, config=MindFormerConfig(**applied),
                                 step_interval=applied.get("step_interval", 1))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            return [f"{source}: monitor_config: {exc} (mindformers' TrainingStateMonitor)"]
    return []


def _native_keys(use_mindformers: bool) -> tuple[str, ...]:
    """mindformers' MonitorConfig keys: the kept 1.9 list, or the installed release's."""
    if not use_mindformers or _mindformers_version().startswith(NATIVE_KEYS_VERSION):
        return NATIVE_MONITOR_KEYS
    with _quiet_mindformers():
        from mindformers.tools.register.template import MonitorConfig
    return tuple(MonitorConfig.keys())


# ---------------------------------------------------------------------------- callbacks
def _check_callbacks(source: str, document: Mapping[str, Any]) -> list[str]:
    callbacks = document.get("callbacks")
    if callbacks is None:
        return [str(missing_entry_error(document, source))]
    if not isinstance(callbacks, list):
        return [f"{source}: callbacks: {show(callbacks)} is not a list. "
                f"Fix: write `callbacks:` followed by `- type: ...` items"]
    problems = [f"{source}: callbacks[{i}]: {show(entry)} has no `type`. "
                f"Fix: write `- type: MFLossMonitor` style items"
                for i, entry in enumerate(callbacks)
                if not isinstance(entry, Mapping) or "type" not in entry]
    entries = callback_entries(document)
    found = [i for i, _ in entries]
    if not entries:
        problems += [str(e) for e in missing_entry_error(document, source).errors]
    for i, entry in entries[:1]:
        try:
            parse_config(entry_settings(entry), source, prefix=f"callbacks[{i}]")
        except ConfigError as exc:
            problems += [str(e) for e in exc.errors]
    if len(found) > 1:
        problems.append(f"{source}: callbacks[{found[1]}]: a second OTelMonitor entry (the "
                        f"first is callbacks[{found[0]}]); both would serve the same port. "
                        f"Fix: keep one")
    return problems


# ---------------------------------------------------------------------------- CPU pitfalls
def _check_cpu(source: str, document: Mapping[str, Any]) -> list[str]:
    context = document.get("context") or {}
    target = context.get("device_target", "") if isinstance(context, Mapping) else ""
    if str(target).upper() != "CPU":
        return []
    problems = []
    monitor = document.get("monitor_config")
    wrapper = document.get("runner_wrapper") or {}
    wrapper = wrapper if isinstance(wrapper, Mapping) else {}
    if isinstance(monitor, Mapping) and monitor.get("monitor_on"):
        dump_path = monitor.get("dump_path", NATIVE_DEFAULT_DUMP_PATH)
        if dump_path:
            unset = "" if "dump_path" in monitor else " (mindformers' default when unset)"
            problems.append(
                f"{source}: monitor_config.dump_path: {show(dump_path)}{unset} makes the train "
                f"cell use TensorDump, which is Ascend-only: the CPU run fails. "
                f"Fix: set dump_path: '' on CPU")
        for key in DUMP_ONLY_FORMATS:
            if monitor.get(key):
                problems.append(f"{source}: monitor_config.{key}: produced only through "
                                f"TensorDump (Ascend); a CPU run reports nothing. "
                                f"Fix: set it to null")
        if monitor.get("local_norm_format") and not wrapper.get("local_norm"):
            problems.append(f"{source}: monitor_config.local_norm_format: on CPU local norms come "
                            f"only from the train cell. Fix: set runner_wrapper.local_norm: True")
    if wrapper.get("type") in ("MFTrainOneStepCell", "MFPipelineWithLossScaleCell"):
        problems.append(f"{source}: runner_wrapper.type: {wrapper['type']} checks overflow with "
                        f"NPUGetFloatStatusV2, which has no CPU kernel. Fix: type: "
                        f"CPUTrainOneStepCell (registered by mfotel.integrations.mindformers)")
    model = document.get("model")
    model_config = model.get("model_config") if isinstance(model, Mapping) else None
    if isinstance(model_config, Mapping) and "llama" in str(model_config.get("type", "")).lower() \
            and not model_config.get("use_rope_slice"):
        problems.append(f"{source}: model.model_config.use_rope_slice: the default rotary "
                        f"embedding path has no CPU kernel. Fix: use_rope_slice: True")
    for i, entry in callback_entries(document):
        metrics = entry.get("metrics") or []
        if isinstance(metrics, (list, str)) and "grad_norm" in metrics \
                and not wrapper.get("use_clip_grad"):
            problems.append(f"{source}: callbacks[{i}].metrics: grad_norm is asked for but "
                            f"the train cell returns a gradient norm only when it clips. "
                            f"Fix: set runner_wrapper.use_clip_grad: True")
    return problems


# ---------------------------------------------------------------------------- helpers
def _mindformers_installed() -> bool:
    from importlib.util import find_spec
    return find_spec("mindformers") is not None


def _mindformers_version() -> str:
    try:
        return metadata.version("mindformers")
    except metadata.PackageNotFoundError:
        return ""


def _log_elsewhere() -> None:
    """mindformers' log (LOG_MF_PATH, unless set) in a temporary directory of this process,
    removed at its exit: mindformers' file handlers, opened at its import, outlive any one
    check (a directory each check made and kept filled /tmp, one per `mfotel check`)."""
    if "LOG_MF_PATH" in os.environ:
        return
    path = tempfile.mkdtemp(prefix="mfotel-check-mindformers-log-")
    os.environ["LOG_MF_PATH"] = path
    atexit.register(shutil.rmtree, path, True)


@contextlib.contextmanager
def _quiet_mindformers() -> Iterator[None]:
    """Import and run mindformers without its noise: its log goes to a temporary directory
    (not ./output/log), MindSpore's C++ log is limited to errors, and what both print on
    stdout/stderr while inside is dropped unless something fails (then it is shown)."""
    _log_elsewhere()
    os.environ.setdefault("GLOG_v", "3")
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        failed = True
        try:
            yield
            failed = False
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            if failed:
                sink.seek(0)
                sys.stderr.write(sink.read()[-4000:].decode(errors="replace"))
