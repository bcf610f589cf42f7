"""The README's quick start for plain MindSpore, copied as a user copies it: its Python snippet
(with a tiny real backbone, optimizer and dataset for the names it leaves to the user) and its
`monitor_config` block as train.yaml, trained on the CPU; the port comes from
OTEL_EXPORTER_PROMETHEUS_PORT, which the copied block leaves in force. What the README says
follows: the address line, the `[Monitor]` lines every 50 steps, the file, and its `curl`.
"""
from __future__ import annotations

import re
import subprocess
from typing import Any

import numpy as np
import pytest

from mfotel.localstack.servers import free_port
from tests.support.paths import ROOT

pytestmark = pytest.mark.slow
README = (ROOT / "README.md").read_text()
QUICK_START = README.split("## Quick start: plain MindSpore", 1)[1].split("\n## ", 1)[0]
ACCOUNT = re.compile(r", account_\w+: [^,]+")   # a time account field of the file's lines
STEPS, BATCH, CLASSES = 100, 4, 3


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", QUICK_START, re.S)


def test_the_copied_quick_start_trains_and_says_what_the_readme_says(in_tmp, monkeypatch, capfd):
    import mindspore as ms
    import mindspore.dataset as ds
    from mindspore import nn
    from mindspore.train import Callback

    [snippet] = _blocks("python")
    [block] = [b for b in _blocks("yaml") if "monitor_config:" in b]
    [curl] = [line for b in _blocks("sh") for line in b.splitlines() if line.startswith("curl")]
    (in_tmp / "train.yaml").write_text(block)
    port = free_port()
    monkeypatch.setenv("OTEL_EXPORTER_PROMETHEUS_PORT", str(port))
    monkeypatch.setenv("OTEL_EXPORTER_PROMETHEUS_HOST", "127.0.0.1")   # tests bind loopback
    ms.set_device("CPU")
    ms.set_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * BATCH, 8)).astype(np.float32)
    y = rng.integers(0, CLASSES, size=STEPS * BATCH).astype(np.int32)
    backbone = nn.Dense(8, CLASSES)
    losses: dict[int, float] = {}
    curled: list[str] = []

    class Truth(Callback):   # after the monitor: the loss of each step, and the README's curl
        def on_train_step_end(self, run_context: Any) -> None:
            cb = run_context.original_args()
            losses[int(cb.cur_step_num)] = float(cb.net_outputs[0].asnumpy())
            if int(cb.cur_step_num) == 60:
                curled.append(subprocess.run(
                    ["sh", "-c", curl.replace("localhost:9464", f"localhost:{port}")],
                    capture_output=True, text=True, timeout=60, check=True).stdout)

    class Model(ms.train.Model):   # the snippet's Model, with the truth callback after its own
        def train(self, *args: Any, callbacks: list, **kwargs: Any) -> Any:
            return super().train(*args, callbacks=[*callbacks, Truth()],
                                 dataset_sink_mode=False, **kwargs)

    namespace = {"backbone": backbone, "epochs": 1,
                 "optimizer": nn.Momentum(backbone.trainable_params(), 0.01, 0.9),
                 "dataset": ds.NumpySlicesDataset((x, y), ["x", "y"], shuffle=False).batch(BATCH)}
    exec(compile(snippet.replace("from mindspore.train import Model\n", ""), "README", "exec"),
         {**namespace, "Model": Model})

    out = capfd.readouterr().out
    [where] = [line for line in out.splitlines() if line.startswith("mfotel: job train on ")]
    assert f"/metrics at http://127.0.0.1:{port}/metrics (local rank 0); the live page" in where
    monitor = [line for line in out.splitlines() if line.startswith("[Monitor]")]
    steps = [int(re.search(r"step: (\d+),", line)[1]) for line in monitor]
    assert steps == [50, 100]
    assert all(f"loss: {losses[step]:.6g}," in line
               for step, line in zip(steps, monitor, strict=True))
    written = (in_tmp / "monitor_logs" / "train_monitor_0.log").read_text().splitlines()
    # the file's lines: the console's, with the time account's fields before `time`
    assert all(", account_steps: " in line and ", account_stall: " in line for line in written)
    assert [ACCOUNT.sub("", line.split("] ", 1)[1]) for line in written] == \
        [line.split("] ", 1)[1] for line in monitor]
    lines = dict(line.rsplit(" ", 1) for line in curled[0].splitlines())
    assert float(lines['mindformers_train_loss{job_name="train",rank="0"}']) == losses[50]
    assert lines['mindformers_train_loss_finite{job_name="train",rank="0"}'] == "1.0"
