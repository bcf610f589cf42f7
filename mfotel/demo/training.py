"""`mfotel demo`: a tiny real MindSpore regression trained on the CPU with OTelMonitor on."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

LR_SCHEDULES = ("constant", "list", "cosine")


class SyntheticRegression:
    """Random-access dataset y = x.w + noise; the label that starts `nan_at_step` is NaN.

    A NaN label makes that step's loss NaN and poisons the weights, as a real divergence does.
    """

    def __init__(self, steps: int, batch_size: int, features: int = 16, seed: int = 0,
                 nan_at_step: int | None = None, weights: np.ndarray | None = None) -> None:
        rng = np.random.default_rng(seed)
        n = steps * batch_size
        self.x = rng.normal(size=(n, features)).astype(np.float32)
        w = rng.normal(size=(features, 1)).astype(np.float32) if weights is None else weights
        self.w = w
        self.y = (self.x @ w + 0.1 * rng.normal(size=(n, 1))).astype(np.float32)
        if nan_at_step is not None and 1 <= nan_at_step <= steps:
            self.y[(nan_at_step - 1) * batch_size, 0] = np.nan

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        return self.x[index], self.y[index]

    def __len__(self) -> int:
        return len(self.x)


def learning_rate(schedule: str, steps: int, base: float = 0.01) -> Any:
    """A float, a per-step list, or a cosine LearningRateSchedule cell."""
    from mindspore import nn
    if schedule == "constant":
        return base
    if schedule == "list":
        return [base * (0.9 ** (i // 5)) for i in range(steps)]
    if schedule == "cosine":
        return nn.CosineDecayLR(min_lr=base / 100, max_lr=base, decay_steps=max(steps, 1))
    raise ValueError(f"lr schedule {schedule!r} is not one of {', '.join(LR_SCHEDULES)}")


@dataclass
class DemoResult:
    """Ground truth of the run, step -> value, as the train cell produced it."""
    losses: dict[int, float] = field(default_factory=dict)
    grad_norms: dict[int, float] = field(default_factory=dict)
    monitor: Any = None
    seconds: float = 0.0


def _truth_callback(result: DemoResult, min_step_seconds: float) -> Any:
    from mindspore.train import Callback

    class Truth(Callback):
        def on_train_step_end(self, run_context: Any) -> None:
            cb = run_context.original_args()
            loss, norm = cb.net_outputs
            result.losses[int(cb.cur_step_num)] = float(loss.asnumpy())
            result.grad_norms[int(cb.cur_step_num)] = float(norm.asnumpy())
            if min_step_seconds:
                time.sleep(min_step_seconds)
    return Truth()


def build_model(steps: int, batch_size: int, lr_schedule: str, features: int = 16) -> Any:
    """Model(TrainOneStepWithGradNorm(MLP + MSE, Momentum)); it evaluates with the same MSE
    (`Model.fit(..., valid_dataset=...)` reports it as `eval_loss`)."""
    import mindspore as ms
    from mindspore import nn
    from mindspore.train import MAE, Model

    from ..cells import TrainOneStepWithGradNorm
    ms.set_seed(0)
    net = nn.SequentialCell([nn.Dense(features, 32), nn.ReLU(), nn.Dense(32, 1)])
    optimizer = nn.Momentum(net.trainable_params(), learning_rate(lr_schedule, steps), momentum=0.9)
    return Model(TrainOneStepWithGradNorm(nn.WithLossCell(net, nn.MSELoss()), optimizer),
                 eval_network=nn.WithEvalCell(net, nn.MSELoss()), eval_indexes=[0, 1, 2],
                 metrics={"mae": MAE()})


def checkpoint_callback(every_steps: int, directory: str, keep: int = 2) -> Any:
    """MindSpore's ModelCheckpoint saving every `every_steps` steps, keeping the last `keep`."""
    from mindspore.train import CheckpointConfig, ModelCheckpoint
    return ModelCheckpoint(prefix="demo", directory=directory, config=CheckpointConfig(
        save_checkpoint_steps=every_steps, keep_checkpoint_max=keep))


def run_demo(steps: int = 200, step_interval: int = 1, port: int = 9464,
             nan_at_step: int | None = None, job_name: str = "mfotel-demo",
             linger_seconds: float = 0.0, batch_size: int = 8, lr_schedule: str = "cosine",
             min_step_seconds: float = 0.0, extra_callbacks: tuple = (),
             checkpoint_steps: int = 0, checkpoint_dir: str = "checkpoints",
             evaluate: bool = False, **config_overrides: Any) -> DemoResult:
    """Train the demo network with OTelMonitor; returns the ground truth and the monitor.

    `checkpoint_steps` > 0 saves a checkpoint every that many steps into `checkpoint_dir`;
    `evaluate` evaluates on held-out samples after the epoch (`Model.fit`). `config_overrides`
    are further monitor_config keys (metrics, output, log_rank, ...).
    """
    import mindspore as ms
    import mindspore.dataset as ds

    from ..callback import OTelMonitor
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    source = SyntheticRegression(steps, batch_size, nan_at_step=nan_at_step)
    dataset = ds.GeneratorDataset(source, ["x", "y"], shuffle=False).batch(batch_size)
    settings: dict[str, Any] = {
        "step_interval": step_interval, "job_name": job_name,
        "metrics": ["loss", "learning_rate", "grad_norm", "throughput", "step_time"],
        **config_overrides}
    settings["prometheus"] = {"host": "127.0.0.1", "port": port, "linger_seconds": linger_seconds,
                              **settings.get("prometheus", {})}
    monitor = OTelMonitor(**settings)
    result = DemoResult(monitor=monitor)
    model = build_model(steps, batch_size, lr_schedule)
    # the checkpoint callback after the monitor: its saves stay out of the step durations
    saving = (checkpoint_callback(checkpoint_steps, checkpoint_dir),) if checkpoint_steps else ()
    valid = None
    if evaluate:
        held_out = SyntheticRegression(max(steps // 4, 1), batch_size, seed=1, weights=source.w)
        valid = ds.GeneratorDataset(held_out, ["x", "y"], shuffle=False).batch(batch_size)
    started = time.perf_counter()
    # extra callbacks run after the monitor, so at step end they see the step recorded
    model.fit(1, dataset, valid_dataset=valid, callbacks=[
        _truth_callback(result, min_step_seconds), monitor, *saving, *extra_callbacks],
        dataset_sink_mode=False, valid_dataset_sink_mode=False)
    result.seconds = time.perf_counter() - started
    return result
