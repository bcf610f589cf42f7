"""Checks at train begin against the run (mfotel.start_checks): one table of runs and the
warnings each must get (none of them stops training)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from mfotel.config import parse_config
from mfotel.start_checks import RunShape, run_shape, start_warnings


class Dataset:
    def __init__(self, batch: int | None) -> None:
        self.batch = batch

    def get_batch_size(self) -> int:
        if self.batch is None:
            raise RuntimeError("this dataset cannot tell")
        return self.batch


def cb(epochs=2, per_epoch=10, batch: int | None = 8) -> SimpleNamespace:
    """cb_params as MindSpore fills them at train begin (the fields start_checks reads)."""
    return SimpleNamespace(epoch_num=epochs, batch_num=per_epoch, train_dataset=Dataset(batch))


def test_run_shape_reads_length_and_batch_size():
    assert run_shape(cb()) == RunShape(20, 8)
    assert run_shape(cb(batch=None)) == RunShape(20, None)          # cannot tell: no error
    assert run_shape(cb(batch=None), batch_size=4) == RunShape(20, 4)   # the config's wins
    assert run_shape(SimpleNamespace()) == RunShape(None, None)        # nothing known


#: (case, monitor_config, run shape, world size, device samples, flops per token) -> keys
CASES = [
    ("a sound run", {"metrics": ["loss", "throughput"]}, RunShape(20, 8), 1, 8.0, None, []),
    ("interval beyond the run", {"step_interval": 50}, RunShape(20, 8), 1, 8.0, None,
     ["interval"]),
    ("log_rank outside the world", {"log_rank": [4, 5]}, RunShape(20, 8), 4, 8.0, None,
     ["log_rank"]),
    ("log_rank partly inside", {"log_rank": [1, 5]}, RunShape(20, 8), 4, 8.0, None, []),
    ("throughput without a batch size", {"metrics": ["throughput"]}, RunShape(20, None), 1,
     None, None, ["batch"]),
    ("peak_flops without FLOPs per token", {"metrics": ["throughput"], "seq_length": 16,
                                            "peak_flops": 1e12}, RunShape(20, 8), 1, 8.0, None,
     ["mfu"]),
    ("peak_flops with everything", {"metrics": ["throughput"], "seq_length": 16,
                                    "peak_flops": 1e12}, RunShape(20, 8), 1, 8.0, 1e9, []),
    ("length unknown: no interval warning", {"step_interval": 50}, RunShape(None, 8), 1, 8.0,
     None, []),
]


@pytest.mark.parametrize("case, config, shape, world, samples, flops, keys", CASES,
                         ids=[c[0] for c in CASES])
def test_start_warnings(case, config, shape, world, samples, flops, keys):
    found = start_warnings(parse_config(config), shape, world, samples, flops)
    assert [key for key, _ in found] == keys
    for _, message in found:   # each names what to change
        assert "Fix:" in message or "monitor_config." in message, message


def test_messages_name_the_numbers():
    [(_, interval)] = start_warnings(parse_config({"step_interval": 50}), RunShape(20, 8), 1,
                                     8.0, None)
    assert "step_interval 50 is larger than the run's 20 steps" in interval
    [(_, mfu)] = start_warnings(parse_config({"peak_flops": 1e12}), RunShape(20, 8), 1, 8.0,
                                None)
    assert "throughput in monitor_config.metrics" in mfu and "sequence length" in mfu
