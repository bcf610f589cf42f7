"""The ground truth the job-level tests' ranks append (tests/support/scripts/faulty_dp.py
`--truth-dir`), read back by tests/support/jobtruth.py while the ranks still write."""
from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.support.jobtruth import FaultyJob, read_truth


def _line(record: dict) -> str:
    return json.dumps(record) + "\n"


def test_a_missing_file_has_no_pid_and_no_steps(tmp_path: Path) -> None:
    assert read_truth(tmp_path / "rank_0.jsonl") == {"pid": None, "losses": {}, "grad_norms": {}}


def test_steps_are_keyed_by_their_number_and_nan_survives(tmp_path: Path) -> None:
    path = tmp_path / "rank_1.jsonl"
    path.write_text(_line({"pid": 4242})
                    + _line({"step": 1, "loss": 2.5, "grad_norm": 0.75})
                    + _line({"step": 2, "loss": float("nan"), "grad_norm": float("inf")}))
    truth = read_truth(path)
    assert truth["pid"] == 4242
    assert truth["losses"]["1"] == 2.5 and truth["grad_norms"]["1"] == 0.75
    assert math.isnan(truth["losses"]["2"]) and truth["grad_norms"]["2"] == math.inf
    assert sorted(truth["losses"]) == ["1", "2"]


def test_a_line_still_being_appended_is_left_for_the_next_read(tmp_path: Path) -> None:
    path = tmp_path / "rank_0.jsonl"
    whole = _line({"pid": 7}) + _line({"step": 1, "loss": 1.0, "grad_norm": 1.0})
    last = _line({"step": 2, "loss": 0.5, "grad_norm": 0.25})
    for cut in range(len(last)):   # every moment of the last line's write
        path.write_text(whole + last[:cut])
        assert sorted(read_truth(path)["losses"]) == ["1"], cut
    path.write_text(whole + last)
    assert read_truth(path)["losses"] == {"1": 1.0, "2": 0.5}


def _trained(path: Path, steps: int) -> None:
    path.write_text(_line({"pid": 1}) + "".join(
        _line({"step": step, "loss": 1.0, "grad_norm": 1.0}) for step in range(1, steps + 1)))


def test_a_fault_triggered_after_a_ranks_last_step_fails_at_once(tmp_path: Path) -> None:
    """FaultyJob.trigger: a job that trained all its steps first never sees the fault."""
    job = SimpleNamespace(options={"trigger": str(tmp_path / "now"), "steps": 3}, ranks=2,
                          truth_of=lambda rank: read_truth(tmp_path / f"rank_{rank}.jsonl"))
    _trained(tmp_path / "rank_0.jsonl", 2)
    _trained(tmp_path / "rank_1.jsonl", 3)
    with pytest.raises(AssertionError, match=r"trained all its 3 steps .*\{0: 2, 1: 3\}"):
        FaultyJob.trigger(job)  # type: ignore[arg-type]
    _trained(tmp_path / "rank_1.jsonl", 2)
    assert FaultyJob.trigger(job) == (tmp_path / "now").stat().st_mtime  # type: ignore[arg-type]
