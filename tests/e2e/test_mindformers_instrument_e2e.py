"""`mfotel-instrument` with the real mindformers: importing it registers OTelMonitor (and the CPU
wrapper), and so does mindformers' own REGISTER_PATH + auto_register route; importing
mfotel.integrations.mindformers alone registers nothing. The bootstrap without mindformers:
tests/unit/test_mindformers_instrument.py."""
from __future__ import annotations

import importlib.util
import sys

import pytest

from tests.support.cli import INSTRUMENT, instrument_env, run
from tests.support.paths import ROOT

PYTHON = sys.executable


@pytest.fixture
def env(tmp_path, monkeypatch):
    return instrument_env(tmp_path, monkeypatch)


def need_mindformers() -> None:
    """Fail without mindformers (a test dependency); never imported here (it writes ./output)."""
    assert importlib.util.find_spec("mindformers") is not None, \
        'mindformers is not installed: pip install -e ".[mindformers]" (make test does)'


@pytest.mark.slow
def test_importing_mindformers_registers_otel_monitor(env, tmp_path):
    need_mindformers()
    code = ("import mindformers\n"
            "from mindformers.tools.register import MindFormerRegister as R\n"
            "from mindformers.tools.register import MindFormerModuleType as T\n"
            "print(R.get_cls(T.CALLBACK, 'OTelMonitor').__name__, "
            "R.get_cls(T.WRAPPER, 'CPUTrainOneStepCell').__name__)\n")
    result = run([*INSTRUMENT, PYTHON, "-c", code], env, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-2:] == ["MindFormersOTelMonitor", "CPUTrainOneStepCell"]


@pytest.mark.slow
def test_mindformers_auto_register_route_registers_otel_monitor(env, tmp_path):
    """mindformers' own route: REGISTER_PATH + `auto_register` on the callback entry."""
    need_mindformers()
    examples = ROOT / "examples" / "mindformers"
    env.update(REGISTER_PATH=str(examples), OM_MODULES_CACHE=str(tmp_path / "modules"))
    code = ("from mindformers.core.callback.build_callback import build_callback\n"
            "cb, = build_callback([{'type': 'OTelMonitor', 'step_interval': 7, "
            "'auto_register': 'mfotel_register.OTelMonitor', 'prometheus': {'port': 0}}])\n"
            "print(type(cb).__name__, cb.config.step_interval)\n")
    result = run([PYTHON, "-c", code], env, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-2:] == ["MindFormersOTelMonitor", "7"]


@pytest.mark.slow
def test_importing_the_integration_registers_nothing_until_register_is_called(env, tmp_path):
    need_mindformers()
    code = ("from mindformers.tools.register import MindFormerRegister as R\n"
            "from mindformers.tools.register import MindFormerModuleType as T\n"
            "from mfotel.integrations import mindformers\n"
            "def registered():\n"
            "    return 'OTelMonitor' in R.registry.get(T.CALLBACK, {})\n"
            "print(registered())\n"
            "mindformers.register()\n"
            "print(registered(), R.get_cls(T.CALLBACK, 'OTelMonitor').__name__)\n")
    result = run([PYTHON, "-c", code], env, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-3:] == ["False", "True", "MindFormersOTelMonitor"]
