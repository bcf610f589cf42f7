"""A tiny Alertmanager webhook receiver: one readable line per firing or resolved alert.

    mfotel alerts-receiver --port 9095 --jsonl alerts.jsonl

prints, for each alert of each notification Alertmanager posts,

    [FIRING critical] MindFormersLossNotFinite job_name=llama rank=0: Training loss is NaN or Inf.
    [RESOLVED] MindFormersLossNotFinite job_name=llama rank=0: Training loss is NaN or Inf.

In Python (tests, demos) the received alerts are kept in memory:

    with AlertsReceiver(port=0) as receiver:      # port 0: any free port
        ...                                       # point Alertmanager at receiver.url
        alert = receiver.wait_for(lambda a: a.alertname == "MindFormersLossNotFinite")
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Sequence, TextIO

from ..actions.control import AlertControl, add_alert_control_arguments, alert_control_from_args

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 9095
MAX_BODY_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class ReceivedAlert:
    """One alert of one Alertmanager notification, as received."""

    status: str                      # "firing" or "resolved"
    labels: dict[str, str]
    annotations: dict[str, str]
    starts_at: str = ""
    ends_at: str = ""
    receiver: str = ""
    group_key: str = ""
    fingerprint: str = ""
    received_at: float = field(default_factory=time.time)   # unix seconds

    @property
    def alertname(self) -> str:
        return self.labels.get("alertname", "")

    @property
    def firing(self) -> bool:
        return self.status == "firing"

    def line(self) -> str:
        """`[FIRING critical] Name job_name=x rank=0: summary` / `[RESOLVED] Name ...`."""
        severity = self.labels.get("severity")
        head = (f"[FIRING {severity}]" if severity else "[FIRING]") if self.firing \
            else f"[{self.status.upper()}]"
        where = " ".join(f"{key}={self.labels[key]}" for key in ("job_name", "rank")
                         if key in self.labels)
        text = self.annotations.get("summary") or self.annotations.get("description", "")
        return f"{head} {self.alertname}{' ' + where if where else ''}: {text}"


def parse_notification(payload: dict[str, Any],
                       received_at: float | None = None) -> list[ReceivedAlert]:
    """The alerts of an Alertmanager webhook payload (version 4); ValueError if malformed."""
    if not isinstance(payload, dict) or not isinstance(payload.get("alerts"), list):
        raise ValueError("not an Alertmanager webhook payload: no 'alerts' list")
    now = time.time() if received_at is None else received_at
    alerts = []
    for raw in payload["alerts"]:
        if not isinstance(raw, dict) or not isinstance(raw.get("labels", {}), dict):
            raise ValueError(f"malformed alert in payload: {raw!r:.200}")
        alerts.append(ReceivedAlert(
            status=str(raw.get("status") or payload.get("status") or "firing"),
            labels={str(k): str(v) for k, v in raw.get("labels", {}).items()},
            annotations={str(k): str(v) for k, v in (raw.get("annotations") or {}).items()},
            starts_at=str(raw.get("startsAt", "")), ends_at=str(raw.get("endsAt", "")),
            receiver=str(payload.get("receiver", "")),
            group_key=str(payload.get("groupKey", "")),
            fingerprint=str(raw.get("fingerprint", "")), received_at=now))
    return alerts


class AlertsReceiver:
    """HTTP server on a thread; every POST body is an Alertmanager notification.

    `GET /-/healthy` answers OK; `GET /alerts` returns what was received as JSON.
    """

    def __init__(self, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
                 jsonl_path: str | Path | None = None, out: TextIO | None = sys.stdout,
                 verbose: bool = False, control: AlertControl | None = None) -> None:
        self.host, self.requested_port = host, port
        self.control = control  # mfotel.actions.control: allow-listed alerts -> control file; None = off
        self.jsonl_path = Path(jsonl_path) if jsonl_path else None
        self.out, self.verbose = out, verbose
        self.alerts: list[ReceivedAlert] = []
        self.notifications = 0
        self._cond = threading.Condition()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------ lifecycle
    @property
    def port(self) -> int:
        if self._server is None:
            return self.requested_port
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        """Webhook URL to put in alertmanager.yml."""
        return f"http://{self.host}:{self.port}/alerts"

    def start(self) -> "AlertsReceiver":
        if self.jsonl_path is not None:
            self.jsonl_path.parent.mkdir(parents=True, exist_ok=True)
            self.jsonl_path.touch()   # fail now, not at the first page, if it is not writable
        self._server = ThreadingHTTPServer((self.host, self.requested_port), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="mfotel-alerts-receiver", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server = self._thread = None

    def __enter__(self) -> "AlertsReceiver":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def serve_forever(self) -> None:
        """Blocking: start (unless started) and serve until interrupted (Ctrl-C)."""
        if self._server is None:
            self.start()
        try:
            while self._thread is not None and self._thread.is_alive():
                self._thread.join(timeout=0.5)
        except KeyboardInterrupt:
            pass
        finally:
            self.stop()

    # ------------------------------------------------------------ receiving
    def handle(self, payload: dict[str, Any]) -> list[ReceivedAlert]:
        """Record and print the alerts of one notification (also usable without HTTP)."""
        alerts = parse_notification(payload)
        lines = []
        for alert in alerts:
            line = alert.line()
            if self.verbose and alert.annotations.get("description"):
                line += f"\n    {alert.annotations['description']}"
            lines.append(line)
        with self._cond:
            self.alerts.extend(alerts)
            self.notifications += 1
            if self.out is not None and lines:
                self.out.write("\n".join(lines) + "\n")
                self.out.flush()
            if self.jsonl_path is not None:
                with open(self.jsonl_path, "a", encoding="utf-8") as file:
                    for alert in alerts:
                        file.write(json.dumps(asdict(alert), sort_keys=True) + "\n")
            if self.control is not None:
                for alert in alerts:
                    self.control.handle(alert)
            self._cond.notify_all()
        return alerts

    def received(self, predicate: Callable[[ReceivedAlert], bool] | None = None
                 ) -> list[ReceivedAlert]:
        with self._cond:
            return [a for a in self.alerts if predicate is None or predicate(a)]

    def wait_for(self, predicate: Callable[[ReceivedAlert], bool],
                 timeout: float = 60.0) -> ReceivedAlert:
        """The first received alert matching `predicate`; TimeoutError after `timeout` s."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for alert in self.alerts:
                    if predicate(alert):
                        return alert
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    names = sorted({a.alertname for a in self.alerts})
                    raise TimeoutError(f"no matching alert after {timeout}s "
                                       f"(received: {names or 'nothing'})")
                self._cond.wait(remaining)


def _handler(receiver: AlertsReceiver) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "mfotel-alerts-receiver"

        def do_POST(self) -> None:  # noqa: N802 (http.server naming)
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = -1
            if length <= 0:
                self._reply(400, "expected a JSON body with a Content-Length\n")
                return
            if length > MAX_BODY_BYTES:
                self._reply(413, f"body larger than {MAX_BODY_BYTES} bytes\n")
                return
            try:
                receiver.handle(json.loads(self.rfile.read(length)))
            except (ValueError, UnicodeDecodeError) as error:
                self._reply(400, f"{error}\n")
                return
            self._reply(200, "")

        def do_GET(self) -> None:  # noqa: N802
            if self.path.rstrip("/") in ("/-/healthy", "/-/ready"):
                self._reply(200, "OK\n")
            elif self.path.rstrip("/") == "/alerts":
                body = json.dumps([asdict(a) for a in receiver.received()], indent=1)
                self._reply(200, body + "\n", "application/json")
            else:
                self._reply(404, "POST Alertmanager webhooks here; GET /alerts lists them\n")

        def _reply(self, code: int, body: str, content_type: str = "text/plain") -> None:
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", f"{content_type}; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass   # one line per alert is the output; no access log

    return Handler


# ---------------------------------------------------------------- command line
def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--host", default=DEFAULT_HOST, help="bind address (default: %(default)s)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT,
                        help="port (default: %(default)s, as in alertmanager/alertmanager.yml)")
    parser.add_argument("--jsonl", metavar="PATH",
                        help="also append every alert as a JSON line to PATH")
    parser.add_argument("--verbose", "-v", action="store_true",
                        help="print each alert's description under its line")
    add_alert_control_arguments(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    try:
        control = alert_control_from_args(args)
    except ValueError as error:
        print(f"mfotel alerts-receiver: {error}", file=sys.stderr)
        return 2
    receiver = AlertsReceiver(args.host, args.port, jsonl_path=args.jsonl, verbose=args.verbose,
                              control=control)
    try:
        receiver.start()
    except OSError as error:
        print(f"mfotel alerts-receiver: cannot listen on {args.host}:{args.port}: {error}",
              file=sys.stderr)
        return 2
    print(f"mfotel alerts-receiver: listening on {receiver.url} (Ctrl-C to stop)",
          file=sys.stderr, flush=True)
    receiver.serve_forever()
    return 0


def add_alerts_receiver_command(subparsers: Any) -> argparse.ArgumentParser:
    """Register `alerts-receiver` on argparse subparsers; dispatch via `args.func(args)`."""
    parser = subparsers.add_parser("alerts-receiver",
                                   help="print Alertmanager webhook notifications",
                                   description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = add_arguments(argparse.ArgumentParser(prog="mfotel alerts-receiver",
                                                   description=__doc__.splitlines()[0]))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
