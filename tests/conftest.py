"""Shared test helpers: scrape a real /metrics endpoint and read values back."""
from __future__ import annotations

import os
import urllib.request
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mfotel.demo.stack import free_port


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


def samples(body: str) -> dict[tuple[str, frozenset], float]:
    """(sample name, frozenset(labels)) -> value, from a text exposition."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(body) for s in family.samples}


def value(body_samples: dict, name: str, **labels: str) -> float | None:
    """The value of the one sample named `name` whose labels include `labels`."""
    found = [v for (n, lab), v in body_samples.items() if n == name and set(labels.items()) <= lab]
    assert len(found) <= 1, f"{name}{labels} is ambiguous: {found}"
    return found[0] if found else None


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Run in a temporary working directory (relative monitor paths land there)."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def step_scraper(url: str, steps: set[int] | None = None) -> Any:
    """A MindSpore callback that scrapes `url` at the end of each step (after the monitor)."""
    from mindspore.train import Callback

    class StepScraper(Callback):
        def __init__(self) -> None:
            super().__init__()
            self.bodies: dict[int, dict] = {}

        def on_train_step_end(self, run_context: Any) -> None:
            step = int(run_context.original_args().cur_step_num)
            if steps is None or step in steps:
                self.bodies[step] = samples(scrape(url))
    return StepScraper()


@pytest.fixture(autouse=True)
def _no_rank_env(monkeypatch):
    """Tests start as a single rank-0 process unless they set the launcher variables."""
    for name in ("RANK_ID", "RANK", "RANK_SIZE", "WORLD_SIZE", "LOCAL_RANK", "DEVICE_ID"):
        monkeypatch.delenv(name, raising=False)
    os.environ.setdefault("GLOG_v", "3")
