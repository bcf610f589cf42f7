"""One rank's exporter built by hand, as OTelMonitor builds it at train begin: Telemetry ->
Instruments -> serve. For tests that need a real /metrics endpoint without training.

    exporter = rank_exporter({"prometheus": {"host": "127.0.0.1", "port": port}}, job_name="x")
    exporter.state.loss = 1.25
    scrape(exporter.url)
    exporter.shutdown()

(The `rank_exporters` fixture of tests/e2e/conftest.py shuts down every exporter it made.)
It is the core's factory (`mfotel.rank_exporter`), the one the callback and
`mfotel simulate` build ranks with.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mfotel.config import MonitorConfig, parse_config
from mfotel.identity import RankIdentity
from mfotel.rank_exporter import RankExporter
from mfotel.rank_exporter import rank_exporter as build

__all__ = ["RankExporter", "rank_exporter"]


def rank_exporter(config: dict[str, Any] | MonitorConfig | None = None,
                  identity: RankIdentity | None = None, job_name: str = "test", *,
                  serve: bool = True, on_error: Callable[[str], None] | None = None
                  ) -> RankExporter:
    """A rank's exporter from `config` (a monitor_config mapping or a parsed MonitorConfig),
    labelled job_name and identity.rank; served at once unless `serve=False`. Export errors
    are counted as the callback counts them, and passed on to `on_error`."""
    cfg = config if isinstance(config, MonitorConfig) else parse_config(config or {})
    return build(cfg, identity or RankIdentity(), job_name, serve=serve, on_error=on_error)
