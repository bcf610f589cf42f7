"""A real VictoriaMetrics (Debian's `victoria-metrics`) on a free loopback port, for tests.

    with VictoriaMetrics(tmp_path) as vm:
        vm.url                     # Prometheus-compatible API: /api/v1/query, /api/v1/write
"""
from __future__ import annotations

from pathlib import Path

from mfotel.localstack.servers import _Server, required_binary


class VictoriaMetrics(_Server):
    """Single-node VictoriaMetrics with its own data directory; stops what it starts.

    Queries see every sample at once (no 30 s latency offset, no cached partial results), so a
    test can compare it with the Prometheus that wrote to it."""

    name = "victoria-metrics"

    def __init__(self, workdir: str | Path, port: int | None = None) -> None:
        super().__init__(workdir, port)
        self.binary = required_binary(("victoria-metrics",), "victoria-metrics")

    @property
    def write_url(self) -> str:
        """Where Prometheus' remote_write sends."""
        return f"{self.url}/api/v1/write"

    def command(self) -> list[str]:
        return [self.binary, f"-storageDataPath={self.workdir / 'data'}",
                f"-httpListenAddr=127.0.0.1:{self.port}", "-search.latencyOffset=0s",
                "-search.disableCache", "-loggerLevel=WARN"]
