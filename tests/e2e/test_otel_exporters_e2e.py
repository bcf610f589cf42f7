"""OTEL_METRICS_EXPORTER on a real training: the exporters it selects carry the run, the others
stay silent (a real /metrics port, scraped while it trains; the in-test OTLP receiver)."""
from __future__ import annotations

import math

import pytest

from mfotel.demo.training import SyntheticRegression, build_model
from tests.support.metrics import scrape, value
from tests.support.multirank import EndpointPoller
from tests.support.otlp_receiver import OtlpReceiver, points

JOB = "mfotel-exporters"
STEPS = 8


def train(steps: int = STEPS) -> dict[int, float]:
    """The demo network, with an OTelMonitor whose exporters only the environment chooses (no
    prometheus.port or otlp.endpoint key); the loss of each step."""
    import mindspore as ms
    import mindspore.dataset as ds
    from mindspore.train import Callback

    from mfotel.callback import OTelMonitor
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    losses: dict[int, float] = {}

    class Truth(Callback):
        def on_train_step_end(self, run_context) -> None:
            cb = run_context.original_args()
            losses[int(cb.cur_step_num)] = float(cb.net_outputs[0].asnumpy())

    dataset = ds.GeneratorDataset(SyntheticRegression(steps, 8), ["x", "y"],
                                  shuffle=False).batch(8)
    monitor = OTelMonitor(job_name=JOB, metrics=["loss"], output={"console": False},
                          prometheus={"linger_seconds": 20})
    build_model(steps, 8, "constant").train(1, dataset, callbacks=[Truth(), monitor],
                                            dataset_sink_mode=False)
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("exporters", ["otlp", "prometheus", "none"])
def test_a_training_exports_through_the_selected_exporters_only(exporters, port, in_tmp,
                                                                 monkeypatch):
    url = f"http://127.0.0.1:{port}/metrics"
    with OtlpReceiver() as receiver, EndpointPoller({"r0": url}) as poller:
        for name, text in {"OTEL_METRICS_EXPORTER": exporters,
                           "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.base_url,
                           "OTEL_METRIC_EXPORT_INTERVAL": "1000",
                           "OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1",
                           "OTEL_EXPORTER_PROMETHEUS_PORT": str(port)}.items():
            monkeypatch.setenv(name, text)
        losses = train()
    final = losses[STEPS]
    assert math.isfinite(final)
    scraped = [value(body, "mindformers_train_loss", job_name=JOB) for body in poller.bodies["r0"]]
    if exporters == "prometheus":
        assert final in scraped
    else:
        assert scraped == []
        with pytest.raises(OSError):
            scrape(url)
    if exporters == "otlp":
        assert receiver.requests, "no push arrived"
        pushed = [p.value for p in points(receiver.requests[-1])
                  if p.name == "mindformers.train.loss"]
        assert pushed == [final]
    else:
        assert receiver.arrivals == []
