"""The evaluation loss is read from the metrics MindSpore and mindformers report."""
from __future__ import annotations

import pytest


@pytest.mark.parametrize("results, loss", [
    ({"loss": 2.0}, 2.0),                                          # MindSpore nn.Loss metric
    ({"Loss": 1.5, "mae": 0.3}, 1.5),
    ({"PerplexityMetric": {"loss": 4.9, "PPL": 133.4}}, 4.9),      # mindformers EvalCallBack
    ({"mae": 1.0}, None),
    # MindSpore 2.9's Model.fit `eval_loss` is its last batch's loss: not taken for the mean
    ({"eval_loss": 3.0, "mae": 1.0}, None),
    (None, None),
])
def test_eval_loss_is_read_from_a_loss_metric(results, loss):
    from mfotel.callback import eval_loss
    assert eval_loss(results) == loss
