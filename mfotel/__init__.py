"""mfotel: MindSpore / mindformers training metrics for OpenTelemetry and Prometheus.

    from mfotel import OTelMonitor
    model.train(epochs, dataset, callbacks=[OTelMonitor.from_yaml("train.yaml")])

The core (config, contract, extraction, the listener contract for optional parts) imports
without MindSpore; `OTelMonitor` and `TrainOneStepWithGradNorm` import it on first use.
"""
from __future__ import annotations

from typing import Any

from .config import ConfigError, MonitorConfig, load_config, parse_config
from .contract import CONTRACT, MetricSpec
from .extract import StepOutputs, parse_net_outputs
from .listeners import StepListener, StepSample

__version__ = "0.1.0"
__all__ = ["CONTRACT", "ConfigError", "MetricSpec", "MonitorConfig", "OTelMonitor",
           "StepListener", "StepOutputs", "StepSample", "TrainOneStepWithGradNorm",
           "load_config", "parse_config", "parse_net_outputs"]

_LAZY = {"OTelMonitor": "callback", "TrainOneStepWithGradNorm": "cells"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from importlib import import_module
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'mfotel' has no attribute {name!r}")
