"""Launcher variables that are not ranks stop the callback's start, before a step or a file
(the `mfotel check` side is in tests/unit/test_config_edges.py)."""
from __future__ import annotations

import pytest

from mfotel.config import ConfigError


@pytest.mark.parametrize("env, variable", [
    ({"RANK_ID": "-1"}, "RANK_ID"), ({"RANK_ID": "٣", "RANK_SIZE": "4"}, "RANK_ID"),
    ({"RANK_ID": "3", "RANK_SIZE": "2"}, "RANK_ID"), ({"LOCAL_RANK": "70000"}, "LOCAL_RANK")])
def test_the_callback_refuses_them_before_training(in_tmp, monkeypatch, env, variable):
    """The first version wrote state_ok_name_-1.json for RANK_ID=-1 and trained as rank 3 of
    2; now the callback's start raises, before a step or a file."""
    from mfotel.demo.training import run_demo
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as error:
        run_demo(steps=3, port=0, job_name="ok_name", output={"console": False},
                 run={"state_file": str(in_tmp / "state_{job_name}_{rank}.json")})
    assert error.value.key == variable
    assert list(in_tmp.glob("state_*")) == []
