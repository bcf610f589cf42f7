"""The live page's routes: the page and its scripts (package data) and three small JSON APIs.

    page = LivePage(history, instruments.state, {"job_name": "llama", "rank": 0, ...})
    routes = page.routes()   # {"/": ..., "/ui/app.js": ..., "/api/history": ..., ...}

    GET /api/summary                 this rank's current values and status
    GET /api/history?since=S&generation=G&marks=M[&format=numbers]
                                     points after step S (everything when G is not current);
                                     series as base64 float64, or JSON numbers
    GET /api/overview                every rank's summary (on the overview rank), or why not

Handlers only read what the training thread already keeps (`TrainState`, `History`): a
request never runs on, or waits for, the training thread. Every response carries a strict
Content-Security-Policy: the page loads nothing but its own files, and has no inline script.
"""
from __future__ import annotations

import base64
import hashlib
import json
import math
import sys
import threading
import time
from array import array
from collections.abc import Callable, Iterable, Mapping
from importlib import resources
from typing import Any
from urllib.parse import parse_qs

from ..contract import (
    STATUS_CANCELLED,
    STATUS_COMPLETED,
    STATUS_FAILED,
    STATUS_INITIALISING,
    STATUS_RUNNING,
)
from ..endpoint.wsgi import SECURITY_HEADERS as ENDPOINT_HEADERS
from ..endpoint.wsgi import WsgiApp, merged_headers
from ..instruments import AS_IS, TrainState
from .history import History, nonfinite_text
from .overview import Overview

#: Values of mindformers_train_status, as the page names them.
STATUS_NAMES = {STATUS_INITIALISING: "initialising", STATUS_RUNNING: "running",
                STATUS_COMPLETED: "completed", STATUS_FAILED: "failed",
                STATUS_CANCELLED: "cancelled"}
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
#: The endpoint's headers (nosniff, no framing, no referrer) with the page's own policy.
SECURITY_HEADERS = merged_headers(ENDPOINT_HEADERS, {"Content-Security-Policy": CSP})
#: route -> (file under mfotel/ui/static, content type)
STATIC = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/ui/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/ui/app.css": ("app.css", "text/css; charset=utf-8"),
    "/ui/uPlot.iife.min.js": ("vendor/uPlot.iife.min.js", "text/javascript; charset=utf-8"),
    "/ui/uPlot.min.css": ("vendor/uPlot.min.css", "text/css; charset=utf-8"),
    "/ui/LICENSE.uPlot.txt": ("vendor/LICENSE.uPlot.txt", "text/plain; charset=utf-8"),
}
MAX_QUERY_FIELDS = 8
#: Share of wall time that encoding the full history for new viewers may take.
FULL_LOAD_BUDGET = 0.02


def encode_points(data: dict[str, Any], numbers: bool = False) -> dict[str, Any]:
    """History.read() for JSON: each series as base64 of little-endian float64 (what the
    page decodes into a Float64Array: 30x cheaper to encode than JSON numbers, so a new
    viewer holds the GIL ~0.5 ms per 10k points instead of ~16 ms), or with `numbers` as
    JSON numbers, null where NaN/Inf or not recorded."""
    series: dict[str, list[float | None] | str] = {}
    for name, column in data["series"].items():
        if numbers:
            series[name] = [v if math.isfinite(v) else None for v in column]
        else:
            if sys.byteorder == "big":
                column = array(column.typecode, column)
                column.byteswap()
            series[name] = base64.b64encode(column.tobytes()).decode("ascii")
    return {**data, "series": series, "encoding": "numbers" if numbers else "float64-le-base64"}


def _finite(value: Any) -> Any:
    """JSON has no NaN: a non-finite float becomes null."""
    return value if not isinstance(value, float) or math.isfinite(value) else None


class BadRequest(ValueError):
    """A query the API cannot answer; the message is sent to the client."""


def _int_param(query: Mapping[str, list[str]], name: str) -> int | None:
    values = query.get(name)
    if not values or values[-1] == "":
        return None
    try:
        return int(values[-1])
    except ValueError:
        raise BadRequest(f"{name} must be a whole number, not {values[-1][:40]!r}") from None


class LivePage:
    """The routes of one rank's live page over its `state` and `history` (read only).

    `info`: constant facts shown on the page (job_name, rank, world_size, metrics, ...).
    `overview`: every rank's state, on the overview rank; elsewhere `overview_note` says
    where it is, or why there is none. `stacks`: where the node agent of mfotel-instrument
    serves this rank's stack captures (port, scheme, path, query), None when nowhere.
    """

    def __init__(self, history: History, state: TrainState, info: Mapping[str, Any],
                 overview: Overview | None = None, overview_note: str | None = None,
                 overview_url: str | None = None,
                 stacks: Callable[[], dict[str, Any] | None] = lambda: None) -> None:
        self.history, self.state, self.info = history, state, dict(info)
        self.stacks = stacks
        self.overview, self.overview_note, self.overview_url = overview, overview_note, overview_url
        if overview is not None:
            overview.local = self.summary
        self._files = {route: self._load(name) for route, (name, _) in STATIC.items()}
        #: the encoded full history per format (numbers?): (history version, monotonic
        #: start, seconds taken, bytes)
        self._full: dict[bool, tuple[int, float, float, bytes]] = dict.fromkeys(
            (False, True), (-1, 0.0, 0.0, b""))
        self._full_lock = threading.Lock()

    @staticmethod
    def _load(name: str) -> tuple[bytes, str]:
        body = resources.files(__package__).joinpath("static", *name.split("/")).read_bytes()
        return body, '"' + hashlib.sha256(body).hexdigest()[:32] + '"'

    def routes(self) -> dict[str, WsgiApp]:
        """Path -> WSGI app, for the endpoint's routing table."""
        routes: dict[str, WsgiApp] = {route: self._static(route) for route in STATIC}
        routes.update({"/api/summary": self._json(lambda environ, query: self.summary()),
                       "/api/history": self._json(self._history),
                       "/api/overview": self._json(self._overview)})
        return routes

    # ---------------------------------------------------------------- data
    def summary(self) -> dict[str, Any]:
        """This rank's current values: the state /metrics exports, plus the history's tail."""
        st, history = self.state, self.history
        step = st.step
        values = {key: _finite(getattr(st, key)) for key in (
            "loss", "learning_rate", "grad_norm", "throughput", "loss_scale", "progress",
            "last_step_timestamp")}
        # what /metrics shows where the value is NaN/Inf (JSON has no literal: null above)
        as_is = {key: nonfinite_text(value) for key in AS_IS
                 if (value := getattr(st, key)) is not None and not math.isfinite(value)}
        return {**self.info, **values, "nonfinite_values": as_is, "status": st.status,
                "status_name": STATUS_NAMES.get(st.status, f"status {st.status}"),
                "step": step, "steps": st.steps, "epoch": st.epoch, "now": time.time(),
                "step_time": history.latest("step_time"), "loss_finite": st.loss_finite,
                "first_nonfinite_step": st.first_nonfinite_step,
                "nonfinite_total": dict(st.nonfinite), "nonfinite_now": history.nonfinite_at(step),
                "overflow": st.overflow, "export_errors": sum(list(st.export_errors.values())),
                "stacks": self.stacks(),
                "history": {"points": history.points, "capacity": history.capacity,
                            "stride": history.stride, "bytes": history.nbytes}}

    def _history(self, environ: dict, query: Mapping[str, list[str]]) -> dict[str, Any] | bytes:
        since = _int_param(query, "since")
        generation = _int_param(query, "generation")
        marks = _int_param(query, "marks")
        numbers = query.get("format", [""])[-1] == "numbers"
        if since is not None and generation == self.history.generation:
            data = encode_points(self.history.read(since, generation, marks), numbers)
            return {**data, "current": self.summary()}
        # A full load (a new viewer, or the points were thinned) encodes the whole history
        # (~10 ms for 10k points, holding the GIL): at most once per cost / FULL_LOAD_BUDGET
        # seconds whatever the number of viewers. A viewer served an older encoding catches
        # up with its next delta, which starts at the `committed` step it was given.
        with self._full_lock:
            version, started, cost, encoded = self._full[numbers]
            if version != self.history.version and \
                    time.monotonic() - started >= cost / FULL_LOAD_BUDGET:
                version, started = self.history.version, time.monotonic()
                encoded = json.dumps(encode_points(self.history.read(), numbers),
                                     allow_nan=False).encode()
                self._full[numbers] = (version, started, time.monotonic() - started, encoded)
        current = json.dumps(self.summary(), allow_nan=False).encode()
        return encoded[:-1] + b', "current": ' + current + b"}"

    def _overview(self, environ: dict, query: Mapping[str, list[str]]) -> dict[str, Any]:
        if self.overview is None:
            return {"enabled": False, "note": self.overview_note, "url": self.overview_url}
        return {"enabled": True, **self.overview.snapshot(environ.get("HTTP_AUTHORIZATION"))}

    # ---------------------------------------------------------------- HTTP
    def _static(self, route: str) -> WsgiApp:
        body, etag = self._files[route]
        content_type = STATIC[route][1]

        def app(environ: dict, start_response: Callable) -> Iterable[bytes]:
            if not _method_allowed(environ, start_response):
                return [b""]
            headers = [*SECURITY_HEADERS, ("ETag", etag), ("Cache-Control", "no-cache")]
            if environ.get("HTTP_IF_NONE_MATCH") == etag:
                start_response("304 Not Modified", headers)
                return [b""]
            start_response("200 OK", [*headers, ("Content-Type", content_type),
                                      ("Content-Length", str(len(body)))])
            return [b"" if environ.get("REQUEST_METHOD") == "HEAD" else body]
        return app

    def _json(self, handler: Callable[[dict, Mapping[str, list[str]]], Any]) -> WsgiApp:
        def app(environ: dict, start_response: Callable) -> Iterable[bytes]:
            if not _method_allowed(environ, start_response):
                return [b""]
            status = "200 OK"
            try:
                try:
                    query = parse_qs(environ.get("QUERY_STRING", ""),
                                     max_num_fields=MAX_QUERY_FIELDS)
                except ValueError:
                    raise BadRequest(f"at most {MAX_QUERY_FIELDS} query fields") from None
                data = handler(environ, query)
                body = data if isinstance(data, bytes) else json.dumps(
                    data, allow_nan=False).encode()
            except BadRequest as exc:
                status, body = "400 Bad Request", json.dumps({"error": str(exc)}).encode()
            start_response(status, [*SECURITY_HEADERS, ("Cache-Control", "no-store"),
                                    ("Content-Type", "application/json"),
                                    ("Content-Length", str(len(body)))])
            return [b"" if environ.get("REQUEST_METHOD") == "HEAD" else body]
        return app


def _method_allowed(environ: dict, start_response: Callable) -> bool:
    if environ.get("REQUEST_METHOD", "GET") in ("GET", "HEAD"):
        return True
    start_response("405 Method Not Allowed", [*SECURITY_HEADERS, ("Allow", "GET, HEAD"),
                                              ("Content-Length", "0")])
    return False
