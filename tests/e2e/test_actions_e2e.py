"""Actions on real tiny MindSpore trainings (CPU), read back through the real /metrics.

Expected steps are computed from the run's own ground truth (`DemoResult.losses`) by a
restatement of the rule, so the noisy toy loss needs no hand-picked numbers.
"""
from __future__ import annotations

import json
import logging
import math
from typing import Any

import numpy as np
import pytest

from mfotel.actions import control
from mfotel.demo.training import run_demo
from tests.support.metrics import step_scraper, value
from tests.support.training import at_step

pytestmark = pytest.mark.slow
J = {"job_name": "mfotel-demo", "rank": "0"}
PLATEAU = {"patience": 4, "min_delta": 0.5}


def plateau_fires(losses: dict[int, float], patience: int, min_delta: float) -> list[int]:
    """Steps (one record per step) after which the plateau rule fires."""
    best, waited, fired = math.inf, 0, []
    for step in sorted(losses):
        if losses[step] < best - min_delta:
            best, waited = losses[step], 0
        else:
            waited += 1
            if waited == patience:
                fired.append(step)
                waited = 0
    return fired


def lr_used(schedule: str, step: int, steps: int, base: float = 0.01) -> float:
    """The unscaled learning rate of demo.learning_rate(schedule) at 1-based `step`."""
    if schedule == "constant":
        return base
    if schedule == "list":
        return base * 0.9 ** ((step - 1) // 5)
    low = base / 100
    return low + 0.5 * (base - low) * (1 + math.cos(math.pi * min(step - 1, steps) / steps))


def weight_recorder() -> Any:
    """A callback keeping the first layer's weights after every step, and the optimizer."""
    from mindspore.train import Callback

    class Weights(Callback):
        def __init__(self) -> None:
            super().__init__()
            self.after: dict[int, np.ndarray] = {}
            self.optimizer: Any = None

        def on_train_step_end(self, run_context: Any) -> None:
            cb = run_context.original_args()
            param = cb.train_network.network.trainable_params()[0]
            self.optimizer = cb.train_network.optimizer
            self.after[int(cb.cur_step_num)] = param.asnumpy().copy()  # a view on CPU: copy
    return Weights()




def test_plateau_stops_the_run_early(port, in_tmp, caplog):
    scraper = step_scraper(f"http://127.0.0.1:{port}/metrics")
    with caplog.at_level(logging.WARNING, logger="mfotel"):
        result = run_demo(steps=60, port=port, lr_schedule="constant", extra_callbacks=(scraper,),
                          output={"console": False}, actions={"plateau": PLATEAU})
    fired = plateau_fires(result.losses, **PLATEAU)
    stop = fired[0]
    assert max(result.losses) == stop < 60          # no step ran after the stop
    bodies = scraper.bodies
    assert value(bodies[stop - 1], "mindformers_train_actions_total", action="stop",
                 source="plateau") == 0
    assert value(bodies[stop], "mindformers_train_actions_total", action="stop",
                 source="plateau") == 1
    assert result.monitor.instruments.state.status == 3  # stopped
    lines = [r.getMessage() for r in caplog.records if "stop (source plateau" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith(f"mfotel: step {stop}: ")


@pytest.mark.parametrize("schedule", ["constant", "list", "cosine"])
def test_plateau_scales_the_lr_in_the_compiled_graph(port, in_tmp, schedule):
    factor, steps = 0.001, 30
    scraper = step_scraper(f"http://127.0.0.1:{port}/metrics")
    weights = weight_recorder()
    result = run_demo(steps=steps, port=port, lr_schedule=schedule, output={"console": False},
                      extra_callbacks=(scraper, weights),
                      actions={"plateau": {**PLATEAU, "action": "scale_lr", "factor": factor}})
    assert len(result.losses) == steps
    fired = plateau_fires(result.losses, **PLATEAU)
    assert fired, "the loss never plateaued: pick another PLATEAU"
    s = fired[0]
    # exported lr: step s still used the old rate, step s+1 the scaled one
    for step in range(1, steps + 1):
        scale = factor ** sum(f < step for f in fired)
        assert value(scraper.bodies[step], "mindformers_train_learning_rate", **J) == \
            pytest.approx(lr_used(schedule, step, steps) * scale, rel=1e-4), step
    assert value(scraper.bodies[steps], "mindformers_train_actions_total", action="scale_lr",
                 source="plateau") == len(fired)
    # the optimizer holds the scaled rate
    opt = weights.optimizer
    total = factor ** len(fired)
    if schedule == "constant":
        assert float(opt.learning_rate.asnumpy()) == pytest.approx(0.01 * total, rel=1e-5)
    elif schedule == "list":
        table = opt.learning_rate.learning_rate.asnumpy()
        assert table[steps - 1] == pytest.approx(lr_used("list", steps, steps) * total, rel=1e-5)
    else:
        assert type(opt.learning_rate).__name__ == "ScaledSchedule"
        assert float(opt.learning_rate.scale.asnumpy()) == pytest.approx(total, rel=1e-5)
    # ... and the compiled graph uses it: the first scaled step moves the weights ~1000x less
    moved = {t: float(np.abs(weights.after[t] - weights.after[t - 1]).sum()) for t in (s, s + 1)}
    assert moved[s + 1] < 0.01 * moved[s], moved


@pytest.mark.parametrize("request_args, k", [(["--stop"], 6), (["--scale-lr", "0.5"], 6)])
def test_control_file_written_mid_run_acts_at_the_next_record(port, in_tmp, request_args, k):
    control_dir = in_tmp / "ctl" / "mfotel-demo"
    scraper = step_scraper(f"http://127.0.0.1:{port}/metrics")
    write = at_step(k, lambda: control.main([str(control_dir), *request_args, "--reason", "test"]))
    result = run_demo(steps=20, port=port, lr_schedule="list", extra_callbacks=(write, scraper),
                      output={"console": False},
                      actions={"control_dir": str(in_tmp / "ctl" / "{job_name}")})
    action = "stop" if "--stop" in request_args else "scale_lr"

    def count(step: int) -> float | None:
        return value(scraper.bodies[step], "mindformers_train_actions_total", action=action,
                     source="control")

    assert count(k) == 0 and count(k + 1) == 1
    (scheduled,) = json.loads((control_dir / control.SCHEDULE_FILE).read_text())["actions"]
    assert scheduled["step"] == k + 1 and scheduled["reason"] == "test"
    if action == "stop":
        assert max(result.losses) == k + 1
        assert result.monitor.instruments.state.status == 3
    else:
        assert max(result.losses) == 20
        lr = {s: value(scraper.bodies[s], "mindformers_train_learning_rate")
              for s in (k + 1, k + 2)}
        assert lr[k + 1] == pytest.approx(lr_used("list", k + 1, 20), rel=1e-5)
        assert lr[k + 2] == pytest.approx(lr_used("list", k + 2, 20) * 0.5, rel=1e-5)


def test_request_left_from_an_earlier_run_is_ignored(port, in_tmp, caplog):
    control_dir = in_tmp / "ctl" / "mfotel-demo"
    control_dir.mkdir(parents=True)
    assert control.main([str(control_dir), "--stop"]) == 0
    with caplog.at_level(logging.WARNING, logger="mfotel"):
        result = run_demo(steps=8, port=port, output={"console": False},
                          actions={"control_dir": str(in_tmp / "ctl" / "{job_name}")})
    assert max(result.losses) == 8 and result.monitor.instruments.state.status == 2
    assert "written before this run started" in caplog.text


def test_dense_early_interval_shows_in_exports_and_lines(port, in_tmp, capsys):
    scraper = step_scraper(f"http://127.0.0.1:{port}/metrics")
    result = run_demo(steps=25, port=port, step_interval=10, early_steps=3,
                      early_step_interval=1, metrics=["loss"], extra_callbacks=(scraper,))
    recorded = [1, 2, 3, 10, 20]
    lines = [x.rpartition(", time: ")[0] for x in capsys.readouterr().out.splitlines()
             if x.startswith("[Monitor]")]           # each line ends with its time field
    assert lines == [f"[Monitor] step: {s}, loss: {result.losses[s]:.6g}" for s in recorded]
    for step in range(1, 26):
        last_record = max(s for s in recorded if s <= step)
        body = scraper.bodies[step]
        assert value(body, "mindformers_train_step", **J) == step
        assert value(body, "mindformers_train_steps_total", **J) == step
        assert value(body, "mindformers_train_loss", **J) == result.losses[last_record], step
