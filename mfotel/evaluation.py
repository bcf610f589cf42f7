"""Evaluation inside training (`Model.fit(..., valid_dataset=...)`): its loss and duration.

MindSpore 2.9's own `eval_results["eval_loss"]` is the last batch's loss (its loss metric is
created anew for every batch), so the loss is a `loss` metric when the Model has one
(`extract.eval_loss`), else the mean of the eval network's scalar first output over the
batches. Pure: the callback feeds it from its evaluation hooks.

    evaluation.begin(perf_counter())
    evaluation.batch(cb_params.net_outputs)               # each evaluation step
    loss, seconds = evaluation.end(cb_params.metrics, perf_counter())
"""
from __future__ import annotations

from typing import Any

from .extract import eval_loss, to_float


class Evaluation:
    """One evaluation at a time: begin, a batch per step, end."""

    def __init__(self) -> None:
        self._begin: float | None = None
        self._losses: list[float] = []

    def begin(self, now: float) -> None:
        self._begin, self._losses = now, []

    def batch(self, outputs: Any) -> None:
        """One evaluation step's outputs; a first output that is no scalar is not averaged."""
        first = outputs[0] if isinstance(outputs, (tuple, list)) and outputs else outputs
        try:
            value = to_float(first) if getattr(first, "size", 1) == 1 else None
        except (TypeError, ValueError):
            value = None
        if value is not None:
            self._losses.append(value)

    def end(self, metrics: Any, now: float) -> tuple[float | None, float | None]:
        """(loss, seconds) of the evaluation that ends; None where unknown."""
        loss = eval_loss(metrics)
        if loss is None and self._losses:
            loss = sum(self._losses) / len(self._losses)
        seconds = now - self._begin if self._begin is not None else None
        self._begin, self._losses = None, []
        return loss, seconds
