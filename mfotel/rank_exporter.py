"""One rank's exporter: Telemetry -> Instruments -> serve, built the one way every rank is.

The callback builds its rank with it at train begin; `mfotel simulate` builds each simulated
rank with it; tests build a real rank in one line:

    exporter = rank_exporter(cfg, RankIdentity(rank=0), "llama")   # serving /metrics
    exporter.state.loss = 2.3; exporter.instruments.touch()
    scrape(exporter.url)
    exporter.shutdown()

    with rank_exporter(cfg, identity, "llama") as exporter: ...   # shut down at the end

`serve=False` builds without serving, so that routes can be added first (the live page):
`exporter.serve({"/": page_app})`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from types import TracebackType

from .config import MonitorConfig
from .endpoint.webconfig import WebConfig
from .endpoint.wsgi import WsgiApp
from .identity import RankIdentity, RunIdentity
from .instruments import Instruments, TrainState
from .telemetry import Telemetry


@dataclasses.dataclass
class RankExporter:
    """A rank's OTel providers and endpoint (`telemetry`) and its instruments."""

    telemetry: Telemetry
    instruments: Instruments

    @property
    def state(self) -> TrainState:
        """The values the instruments expose (assign, then `instruments.touch()`)."""
        return self.instruments.state

    @property
    def url(self) -> str | None:
        """The /metrics URL, None when not served (port 0, or the port was taken)."""
        endpoint = self.telemetry.endpoint
        return endpoint.url if endpoint is not None else None

    def serve(self, extra_routes: Mapping[str, WsgiApp] | None = None) -> RankExporter:
        """Serve /metrics (and `extra_routes`) on host:port + local rank; a taken port warns
        and counts (stage server), never raises."""
        self.telemetry.extra_routes.update(extra_routes or {})
        instruments = self.instruments
        self.telemetry.serve(lambda: instruments.version, lambda: instruments.native_version,
                             instruments.nonfinite_values)
        return self

    def shutdown(self) -> None:
        """Stop the endpoint and flush OTLP; safe to call twice."""
        self.telemetry.shutdown()

    def __enter__(self) -> RankExporter:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.shutdown()


def rank_exporter(cfg: MonitorConfig, identity: RankIdentity, job_name: str, *,
                  run: RunIdentity | None = None,
                  on_error: Callable[[str], None] | None = None,
                  web: WebConfig | None = None, serve: bool = True) -> RankExporter:
    """The exporter of rank `identity` of job `job_name`, serving unless `serve` is False.

    - `run`: the run identity (run id and attempt on target_info, and on rank_info when
      configured); a fresh one when None.
    - `on_error(stage)`: called besides counting in `mfotel_export_errors_total{stage}`.
    - `web`: the endpoint's TLS / auth when already loaded (else read from `cfg`).
    """
    run = run or RunIdentity(run_id=f"{job_name}-run")
    attributes = {**identity.resource_attributes(), **run.resource_attributes(),
                  **cfg.resource_attributes}
    counted: list[Instruments] = []

    def count(stage: str) -> None:
        for instruments in counted:
            instruments.count_error(stage)
        if on_error is not None:
            on_error(stage)

    telemetry = Telemetry(dataclasses.replace(cfg, resource_attributes=attributes), identity,
                          job_name, on_error=count, web=web)
    meter = telemetry.start()
    instruments = Instruments(meter, {"job_name": job_name, "rank": str(identity.rank)},
                              cfg.metrics, {**identity.labels(), **run.labels()},
                              telemetry.native_meter, cardinality=cfg.cardinality,
                              seed_values=cfg.exports_seed_metrics(identity.rank))
    counted.append(instruments)
    exporter = RankExporter(telemetry, instruments)
    return exporter.serve() if serve else exporter
