"""net_outputs layouts -> StepOutputs: one table, numpy arrays, real MindSpore tensors."""
from __future__ import annotations

import math

import numpy as np
import pytest

from mfotel.extract import StepOutputs, is_finite, parse_net_outputs, to_float

F = np.float32
CASES = [
    ("bare loss", F(2.5), StepOutputs(loss=2.5)),
    ("loss array mean", np.array([1.0, 3.0], F), StepOutputs(loss=2.0)),
    ("(loss, grad_norm)", (F(2.5), F(0.75)), StepOutputs(loss=2.5, grad_norm=0.75)),
    ("(loss, overflow, scale)", (F(2.5), np.array(False), F(1024.0)),
     StepOutputs(loss=2.5, overflow=False, loss_scale=1024.0)),
    ("4-tuple with lr", (F(2.5), np.array(True), F(512.0), F(1e-4)),
     StepOutputs(loss=2.5, overflow=True, loss_scale=512.0, learning_rate=float(F(1e-4)))),
    ("mindformers 5-tuple", (F(2.5), np.array(False), F(1.0), F(1e-4), F(0.5)),
     StepOutputs(loss=2.5, overflow=False, loss_scale=1.0, learning_rate=float(F(1e-4)),
                 grad_norm=0.5)),
    ("unknown 6-tuple: loss only", tuple(F(i) for i in range(1, 7)), StepOutputs(loss=1.0)),
    ("empty", (), StepOutputs()),
    ("None", None, StepOutputs()),
]


@pytest.mark.parametrize("name, outputs, expected", CASES, ids=[c[0] for c in CASES])
def test_layouts(name, outputs, expected):
    assert parse_net_outputs(outputs) == expected


def test_mindformers_7_tuple_keeps_local_norm_raw():
    local = np.array([0.1, 0.2], F)
    out = parse_net_outputs((F(2.5), np.array(False), F(1.0), F(1e-4), F(0.5), local, F(2)))
    assert (out.loss, out.grad_norm, out.learning_rate) == (2.5, 0.5, float(F(1e-4)))
    assert out.local_norm is local


def test_nonfinite_values_pass_through():
    out = parse_net_outputs((F("nan"), F("inf")))
    assert math.isnan(out.loss) and out.grad_norm == math.inf
    assert not is_finite(out.loss) and not is_finite(out.grad_norm) and is_finite(None)


def test_real_mindspore_tensors():
    import mindspore as ms
    out = parse_net_outputs((ms.Tensor(2.5, ms.float32), ms.Tensor(False), ms.Tensor(8.0),
                             ms.Tensor(1e-3, ms.float32), ms.Tensor([0.5], ms.float32)))
    assert out.loss == 2.5 and out.overflow is False and out.loss_scale == 8.0
    assert out.learning_rate == pytest.approx(1e-3) and out.grad_norm == 0.5
    assert to_float(ms.Tensor([[1.0, 2.0], [3.0, 6.0]], ms.float32)) == 3.0
