"""`mfotel-instrument`: the sitecustomize bootstrap and its chaining. Registration with the real
mindformers: tests/e2e/test_mindformers_instrument_e2e.py."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from mfotel.node import instrument
from tests.support.cli import INSTRUMENT, instrument_env, run

PYTHON = sys.executable


@pytest.fixture
def env(tmp_path, monkeypatch):
    return instrument_env(tmp_path, monkeypatch)


def test_env_puts_the_bootstrap_directory_first_and_keeps_the_rest(env, tmp_path):
    result = instrument.instrumented_env({**env, "PYTHONPATH": f"/a{os.pathsep}/b"})
    first, *rest = result["PYTHONPATH"].split(os.pathsep)
    assert Path(first, "sitecustomize.py").read_text() == instrument.SITECUSTOMIZE
    assert rest == ["/a", "/b"]
    assert result[instrument.ENV_FLAG] == "1"
    again = instrument.instrumented_env(result)  # nested launches do not stack the directory
    assert again["PYTHONPATH"] == result["PYTHONPATH"]


def test_usage_without_a_command(env, tmp_path):
    result = run(INSTRUMENT, env, tmp_path)
    assert result.returncode == 2 and "usage: mfotel-instrument" in result.stdout


def test_missing_command_is_a_clear_error(env, tmp_path):
    result = run([*INSTRUMENT, "no-such-command-xyz"], env, tmp_path)
    assert result.returncode != 0 and "command not found: no-such-command-xyz" in result.stderr


def test_a_process_that_never_imports_mindformers_pays_nothing(env, tmp_path):
    code = ("import sys; print(sorted(m for m in sys.modules "
            "if m.startswith(('mindformers', 'mfotel.integrations.mindformers', 'mindspore'))))")
    result = run([*INSTRUMENT, PYTHON, "-c", code], env, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
    assert not (tmp_path / "output").exists()


def test_an_existing_sitecustomize_still_runs(env, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import builtins; builtins.OTHER_SITE = 'ran'\n")
    env["PYTHONPATH"] = str(other)
    code = "import builtins, sys; print(builtins.OTHER_SITE, sys.modules['sitecustomize'].__file__)"
    result = run([*INSTRUMENT, PYTHON, "-c", code], env, tmp_path)
    assert result.returncode == 0, result.stderr
    ran, ours = result.stdout.split()
    assert ran == "ran"
    assert Path(ours).parent == tmp_path / "boot"


def test_bootstrap_chains_the_interpreters_own_sitecustomize(env, tmp_path):
    """Debian's python ships /usr/lib/python3.X/sitecustomize.py; ours must not hide it."""
    code = ("import importlib.machinery as m, sys, os; boot = os.environ['MFOTEL_INSTRUMENT_DIR']; "
            "spec = m.PathFinder.find_spec('sitecustomize', [p for p in sys.path if p != boot]); "
            "print(spec.origin if spec else None)")
    plain = run([PYTHON, "-c", code.replace("os.environ['MFOTEL_INSTRUMENT_DIR']", "''")],
                env, tmp_path)
    assert plain.returncode == 0, plain.stderr
    # whatever the interpreter would have run is what ours chains to
    result = run([*INSTRUMENT, PYTHON, "-c", code], env, tmp_path)
    assert result.stdout.strip() == plain.stdout.strip()
