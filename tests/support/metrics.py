"""Scrape a real /metrics endpoint and read values back."""
from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.support.http import get_text
from tests.support.waiting import settle


def scrape(url: str, **options: Any) -> str:
    """The text exposition at `url` (tests.support.http.get_text options: auth, context...);
    by default bounded as a one-second answer on this machine's load."""
    options.setdefault("timeout", settle(1.0))
    return get_text(url, **options)


def samples(body: str) -> dict[tuple[str, frozenset], float]:
    """(sample name, frozenset(labels)) -> value, from a text exposition."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(body) for s in family.samples}


def value(body_samples: dict, name: str, **labels: str) -> float | None:
    """The value of the one sample named `name` whose labels include `labels`."""
    found = [v for (n, lab), v in body_samples.items() if n == name and set(labels.items()) <= lab]
    assert len(found) <= 1, f"{name}{labels} is ambiguous: {found}"
    return found[0] if found else None


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
