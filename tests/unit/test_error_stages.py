"""Every `stage` mfotel counts in mfotel_export_errors_total is pre-created at 0, so that
`increase()` sees the very first error: each stage string the package passes to `on_error`,
`count_error` or names as an `ERROR_STAGE` is in `instruments.ERROR_STAGES`, or is created at 0
by the part that counts it when that part is attached (and only then can it count)."""
from __future__ import annotations

import ast
from pathlib import Path

from opentelemetry.sdk.metrics import MeterProvider

import mfotel
from mfotel.actions.engine import ActionEngine
from mfotel.config import parse_config
from mfotel.instruments import ERROR_STAGES, Instruments, TrainState

PACKAGE = Path(mfotel.__file__).resolve().parent
#: the calls that count an error at a stage named by their first argument
COUNTING_CALLS = ("on_error", "count_error", "_count_error")

#: Stages a part pre-creates itself when it is attached (absent where the part is off).
ATTACHED = {"control": "mfotel/actions/engine.py"}   # ActionEngine.attach: actions configured

#: Stages counted but not pre-created (none: add a stage to ERROR_STAGES, not here; an entry
#: that is pre-created fails).
NOT_YET_PRE_CREATED: dict[str, str] = {}


def counted_stages() -> dict[str, list[str]]:
    """Stage string -> where it is counted (`path:line`), from the source of mfotel/."""
    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE.parent).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            stage = None
            if isinstance(node, ast.Call) and node.args:
                func = node.func
                name = func.id if isinstance(func, ast.Name) else \
                    func.attr if isinstance(func, ast.Attribute) else ""
                first = node.args[0]
                if name in COUNTING_CALLS and isinstance(first, ast.Constant) \
                        and isinstance(first.value, str):
                    stage = first.value
            elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) \
                    and any(isinstance(t, ast.Name) and t.id == "ERROR_STAGE"
                            for t in node.targets):
                stage = str(node.value.value)
            if stage is not None:
                found.setdefault(stage, []).append(f"{where}:{node.lineno}")
    return found


def test_the_scan_finds_the_stages_of_the_server_the_callback_and_the_actions():
    found = counted_stages()
    assert any(w.startswith("mfotel/endpoint/server.py") for w in found["scrape"])
    assert any(w.startswith("mfotel/endpoint/server.py") for w in found["server"])
    assert any(w.startswith("mfotel/callback.py") for w in found["callback"])
    assert any(w.startswith("mfotel/telemetry.py") for w in found["otlp"])
    assert all(w.startswith("mfotel/actions/engine.py") for w in found["control"])


def test_scrape_and_shutdown_are_pre_created():
    assert "scrape" in ERROR_STAGES and "shutdown" in ERROR_STAGES
    assert TrainState().export_errors["scrape"] == TrainState().export_errors["shutdown"] == 0


def test_every_counted_stage_is_pre_created():
    found = counted_stages()
    missing = {stage: places for stage, places in found.items()
               if stage not in ERROR_STAGES and stage not in ATTACHED
               and stage not in NOT_YET_PRE_CREATED}
    assert not missing, ("stages counted but not in instruments.ERROR_STAGES (add them there): "
                         f"{missing}")
    fixed = sorted(set(NOT_YET_PRE_CREATED) & set(ERROR_STAGES))
    assert not fixed, f"pre-created now, delete from NOT_YET_PRE_CREATED: {fixed}"
    stale = sorted((set(ATTACHED) | set(NOT_YET_PRE_CREATED)) - set(found))
    assert not stale, f"no longer counted anywhere, delete: {stale}"


def test_the_actions_engine_pre_creates_its_stage_when_attached(tmp_path):
    instruments = Instruments(MeterProvider().get_meter("test"), {"job_name": "job", "rank": "0"},
                              ("loss",))
    errors = instruments.state.export_errors
    assert ActionEngine.ERROR_STAGE == "control" and "control" not in errors
    cfg = parse_config({"actions": {"control_dir": str(tmp_path / "{job_name}")}}).actions
    ActionEngine(cfg, "job").attach(instruments)
    assert errors["control"] == 0
    assert set(ERROR_STAGES) <= set(errors)
