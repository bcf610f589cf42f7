"""A minimal OTLP/HTTP metrics receiver: protobuf in, `points()` out (tests, local checks).

No collector binary runs here; this is a real protocol peer for the OTLP exporter. It accepts
`POST /v1/metrics` (`application/x-protobuf`, optionally gzip), decodes the
`ExportMetricsServiceRequest` with opentelemetry-proto and answers as a collector does.

    with OtlpReceiver() as receiver:            # 127.0.0.1, a free port
        ... push to receiver.url ...
        for point in points(receiver.requests[-1]): print(point.name, point.attributes, point.value)

`OtlpReceiver(hang=True)` accepts requests but answers none until `release()`: a hung collector.
"""
from __future__ import annotations

import gzip
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# protobuf picks its implementation once, at its first import. MindSpore's generated *_pb2
# modules need the pure-Python one (MindSpore sets this variable when it is imported): loading
# protobuf here first with the default (upb) would make a later `import mindspore` fail.
os.environ.setdefault("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION", "python")

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)

PATH = "/v1/metrics"


@dataclass(frozen=True)
class Point:
    """One data point, flattened: metric name and kind, its attributes and the resource's."""
    name: str
    kind: str                       # gauge | sum | histogram
    unit: str
    attributes: dict[str, Any]
    resource: dict[str, Any]
    value: float | None = None      # gauge and sum
    count: int | None = None        # histogram
    sum: float | None = None
    bucket_counts: tuple[int, ...] = ()
    explicit_bounds: tuple[float, ...] = ()
    monotonic: bool = field(default=False)


def _any_value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


def _attributes(items: Any) -> dict[str, Any]:
    return {kv.key: _any_value(kv.value) for kv in items}


def _number(point: Any) -> float:
    return float(point.as_double if point.WhichOneof("value") == "as_double" else point.as_int)


def points(request: ExportMetricsServiceRequest) -> list[Point]:
    """Every data point of one export request."""
    out: list[Point] = []
    for resource_metrics in request.resource_metrics:
        resource = _attributes(resource_metrics.resource.attributes)
        for scope in resource_metrics.scope_metrics:
            for metric in scope.metrics:
                kind = metric.WhichOneof("data")
                data = getattr(metric, kind)
                for p in data.data_points:
                    common = dict(name=metric.name, kind=kind, unit=metric.unit,
                                  attributes=_attributes(p.attributes), resource=resource)
                    if kind == "histogram":
                        out.append(Point(**common, count=int(p.count), sum=float(p.sum),
                                         bucket_counts=tuple(p.bucket_counts),
                                         explicit_bounds=tuple(p.explicit_bounds)))
                    elif kind in ("gauge", "sum"):
                        out.append(Point(**common, value=_number(p),
                                         monotonic=kind == "sum" and data.is_monotonic))
    return out


def by_name(request: ExportMetricsServiceRequest) -> dict[str, list[Point]]:
    """The data points of one export request, by metric name."""
    found: dict[str, list[Point]] = {}
    for point in points(request):
        found.setdefault(point.name, []).append(point)
    return found


class OtlpReceiver:
    """OTLP/HTTP metrics endpoint on `host:port` (port 0 = a free one); keeps every request."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, hang: bool = False,
                 hang_limit_seconds: float = 120.0) -> None:
        self.requests: list[ExportMetricsServiceRequest] = []
        self.arrivals: list[tuple[str, dict[str, str]]] = []  # (path, headers) of every POST
        self.received = 0    # requests that arrived (decoded or not)
        self.answered = 0
        self.hang, self.hang_limit = hang, hang_limit_seconds
        self._released = threading.Event()
        self._changed = threading.Condition()
        self._server = ThreadingHTTPServer((host, port), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return self.base_url + PATH

    @property
    def base_url(self) -> str:
        """The collector's base URL (OTEL_EXPORTER_OTLP_ENDPOINT style, no path)."""
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:  # quiet
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                receiver._arrived(self.path, {k.lower(): v for k, v in self.headers.items()})
                if receiver.hang:
                    receiver._released.wait(receiver.hang_limit)
                if self.path != PATH:
                    return self._answer(404, b"")
                try:
                    if self.headers.get("Content-Encoding", "") == "gzip":
                        body = gzip.decompress(body)
                    request = ExportMetricsServiceRequest.FromString(body)
                except Exception:  # noqa: BLE001 - a bad payload is the client's problem
                    return self._answer(400, b"")
                receiver._store(request)
                self._answer(200, ExportMetricsServiceResponse().SerializeToString())

            def _answer(self, status: int, payload: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
                with receiver._changed:
                    receiver.answered += 1
                    receiver._changed.notify_all()
        return Handler

    def _arrived(self, path: str, headers: dict[str, str]) -> None:
        with self._changed:
            self.arrivals.append((path, headers))
            self.received += 1
            self._changed.notify_all()

    def _store(self, request: ExportMetricsServiceRequest) -> None:
        with self._changed:
            self.requests.append(request)
            self._changed.notify_all()

    def wait(self, predicate: Callable[[OtlpReceiver], bool], timeout: float) -> bool:
        """Block until `predicate(self)` holds (True) or `timeout` seconds pass (False)."""
        with self._changed:
            return self._changed.wait_for(lambda: predicate(self), timeout)

    def release(self) -> None:
        """Answer the hung requests, and every later one at once."""
        self._released.set()

    def start(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.release()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
