"""A tiny Alertmanager webhook receiver: one readable line per firing or resolved alert.

    mfotel alerts-receiver --port 9095 --jsonl alerts.jsonl

prints, for each alert of each notification Alertmanager posts,

    [FIRING critical] MindFormersLossNotFinite job_name=llama rank=0: Training loss is NaN or Inf.
    [RESOLVED] MindFormersLossNotFinite job_name=llama rank=0: Training loss is NaN or Inf.

With `--control-dir` it also turns allow-listed alerts into control requests that stop a job
or scale its learning rate (mfotel.actions.control); then it requires credentials
(mfotel.alerting.auth: a bearer token or basic auth, as Alertmanager's `http_config` sends them;
or client certificates) and refuses to start without them unless `--insecure-no-auth`.

Limits (mfotel.alerting.httpserver): bodies up to `--max-body-bytes` (413 beyond), at most
`--max-connections` at once (503 beyond), `--request-timeout-seconds` per connection. A bad
body gets a 400 naming what is wrong (mfotel.alerting.webhook); no request can crash it.

In Python (tests, demos) the received alerts are kept in memory:

    with AlertsReceiver(port=0) as receiver:      # port 0: any free port
        ...                                       # point Alertmanager at receiver.url
        alert = receiver.wait_for(lambda a: a.alertname == "MindFormersLossNotFinite")
"""
from __future__ import annotations

import argparse
import json
import ssl
import sys
import threading
import time
from collections import Counter, deque
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Sequence, TextIO

from ..actions.control import AlertControl, add_alert_control_arguments, alert_control_from_args
from .auth import (AuthSetupError, WebhookAuth, add_auth_arguments, auth_from_args,
                   world_readable)
from .httpserver import BoundedHTTPServer, BoundedRequestHandler, tls_context
from .webhook import (PayloadError, ReceivedAlert, decode_notification, parse_notification,
                      printable)

__all__ = ["AlertsReceiver", "ReceivedAlert", "parse_notification", "InsecureReceiverError"]

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 9095
#: Alertmanager sends every alert of a group in one body (~1.5 KB each; `max_alerts` caps it).
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
#: An over-large or unauthorised body is read and dropped up to this size, so that the client
#: reads our answer instead of a reset connection; beyond it the connection is closed.
DRAIN_LIMIT_BYTES = 64 * 1024 * 1024
#: What is kept in memory for `received()` / `GET /alerts`: the newest alerts within both bounds.
KEEP_ALERTS, KEEP_CHARS = 10_000, 64 * 1024 * 1024
#: A rejected request is reported on stderr at most once per kind and interval.
REPORT_INTERVAL_SECONDS = 60.0


class InsecureReceiverError(ValueError):
    """Acting on alerts without authentication was not explicitly allowed."""


class AlertsReceiver:
    """HTTP(S) server on a thread; every authorised POST body is an Alertmanager notification.

    `GET /-/healthy` answers OK to anyone; `GET /alerts` returns what was received as JSON
    (to authorised clients only when credentials are configured).
    """

    def __init__(self, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
                 jsonl_path: str | Path | None = None, out: TextIO | None = sys.stdout,
                 verbose: bool = False, control: AlertControl | None = None,
                 auth: WebhookAuth | None = None, insecure_no_auth: bool = False,
                 tls: ssl.SSLContext | None = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_connections: int = 16,
                 request_seconds: float = 10.0, err: TextIO | None = sys.stderr) -> None:
        self.host, self.requested_port = host, port
        self.control = control  # mfotel.actions.control: allow-listed alerts -> control file; None = off
        self.auth, self.insecure_no_auth, self.tls = auth, insecure_no_auth, tls
        self.jsonl_path = Path(jsonl_path) if jsonl_path else None
        self.out, self.err, self.verbose = out, err, verbose
        self.max_body_bytes, self.max_connections, self.request_seconds = \
            max_body_bytes, max_connections, request_seconds
        self.alerts: deque[ReceivedAlert] = deque()
        self.notifications = 0
        self.rejected: Counter[str] = Counter()   # status code -> requests answered with it
        self._kept_chars = 0
        self._reported: dict[int, tuple[float, int]] = {}   # code -> (last report, since then)
        self._cond = threading.Condition()
        self._parsing = threading.BoundedSemaphore(2)   # bounds the memory of parallel parses
        self._server: BoundedHTTPServer | None = None
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
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}/alerts"

    @property
    def client_certificates_required(self) -> bool:
        return self.tls is not None and self.tls.verify_mode == ssl.CERT_REQUIRED

    @property
    def authenticated(self) -> bool:
        return self.auth is not None or self.client_certificates_required

    def start(self) -> "AlertsReceiver":
        """Bind and serve on a thread; InsecureReceiverError for actions without credentials."""
        if self.control is not None and not self.authenticated and not self.insecure_no_auth:
            raise InsecureReceiverError(
                "refusing to act on alerts without authentication: with --control-dir anyone "
                f"who can reach {self.host}:{self.requested_port} could stop your jobs or scale "
                "their learning rate. Fix: --bearer-token-file FILE (Alertmanager: "
                "http_config.authorization.credentials_file: FILE) or --basic-auth-username "
                "and --basic-auth-password-file (http_config.basic_auth), or "
                "--tls-client-ca-file; or --insecure-no-auth on a network you fully trust")
        if self.jsonl_path is not None:
            self.jsonl_path.parent.mkdir(parents=True, exist_ok=True)
            self.jsonl_path.touch()   # fail now, not at the first page, if it is not writable
        self._server = BoundedHTTPServer(
            (self.host, self.requested_port), _handler(self), tls=self.tls,
            max_connections=self.max_connections, request_seconds=self.request_seconds)
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
    def authorized(self, header: str | None) -> bool:
        """Whether a request with this `Authorization` header may post or read alerts."""
        return self.auth is None or self.auth.allows(header)

    def handle_body(self, body: bytes) -> list[ReceivedAlert]:
        """Parse, record and print one raw notification; PayloadError if malformed."""
        with self._parsing:
            alerts = decode_notification(body)
        return self._record(alerts)

    def handle(self, payload: dict[str, Any]) -> list[ReceivedAlert]:
        """Record and print the alerts of one parsed notification (also usable without HTTP)."""
        return self._record(parse_notification(payload))

    def _record(self, alerts: list[ReceivedAlert]) -> list[ReceivedAlert]:
        lines = []
        for alert in alerts:
            line = alert.line()
            if self.verbose and alert.annotations.get("description"):
                line += f"\n    {printable(alert.annotations['description'])}"
            lines.append(line)
        with self._cond:
            self._keep(alerts)
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

    def _keep(self, alerts: list[ReceivedAlert]) -> None:
        for alert in alerts:
            self.alerts.append(alert)
            self._kept_chars += alert.size()
        while self.alerts and (len(self.alerts) > KEEP_ALERTS or self._kept_chars > KEEP_CHARS):
            self._kept_chars -= self.alerts.popleft().size()

    def reject(self, code: int, why: str, client: str = "?") -> None:
        """Count a refused request; say so on stderr at most once per code and minute."""
        now = time.monotonic()
        with self._cond:
            self.rejected[code] += 1
            last, since = self._reported.get(code, (-REPORT_INTERVAL_SECONDS, 0))
            if now - last < REPORT_INTERVAL_SECONDS:
                self._reported[code] = (last, since + 1)
                return
            self._reported[code] = (now, 0)
        if self.err is not None:
            more = f" (and {since} more since the last report)" if since else ""
            self.err.write(f"mfotel alerts-receiver: refused a request with {code} from "
                           f"{client}: {printable(why, 200)}{more}\n")
            self.err.flush()

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


def _handler(receiver: AlertsReceiver) -> type[BoundedRequestHandler]:
    class Handler(BoundedRequestHandler):
        server_version = "mfotel-alerts-receiver"

        def do_POST(self) -> None:  # noqa: N802 (http.server naming)
            try:
                self._post()
            except TimeoutError:
                self._refuse(408, f"the request was not complete within "
                                  f"{receiver.request_seconds:g} s")
            except OSError:
                pass   # the client went away: nobody to answer
            except Exception as exc:  # noqa: BLE001 - a bug must not cost the connection
                self._refuse(500, f"internal error ({type(exc).__name__})")

        def _post(self) -> None:
            if not receiver.authorized(self.headers.get("Authorization")):
                self._drain()
                self._refuse(401, "missing or wrong credentials")
                return
            if self.headers.get("Transfer-Encoding"):
                self._drain_chunked()
                self._refuse(411, "send the body with a Content-Length (no chunked encoding)")
                return
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = -1
            if length <= 0:
                self._refuse(400, "the body is empty or has no Content-Length: expected a "
                                  "JSON notification")
                return
            if length > receiver.max_body_bytes:
                self._drain()
                self._refuse(413, f"body of {length} bytes; at most {receiver.max_body_bytes} "
                                  f"(Alertmanager: set webhook_configs[].max_alerts)")
                return
            body = self.rfile.read(length)
            if len(body) < length:
                return   # the client closed before sending its body
            try:
                receiver.handle_body(body)
            except PayloadError as error:
                self._refuse(400, str(error))
                return
            self._reply(200, "")

        def do_GET(self) -> None:  # noqa: N802
            path = self.path.split("?", 1)[0].rstrip("/")
            if path in ("/-/healthy", "/-/ready"):
                self._reply(200, "OK\n")
            elif path == "/alerts":
                if not receiver.authorized(self.headers.get("Authorization")):
                    self._refuse(401, "missing or wrong credentials")
                    return
                body = json.dumps([asdict(a) for a in receiver.received()], indent=1)
                self._reply(200, body + "\n", "application/json")
            else:
                self._reply(404, "POST Alertmanager webhooks to /alerts; GET /alerts lists "
                                 "them\n")

        def _drain(self) -> None:
            """Read and drop the body (bounded), so the client gets to read our answer."""
            try:
                left = min(int(self.headers.get("Content-Length") or 0), DRAIN_LIMIT_BYTES)
            except ValueError:
                return
            while left > 0:
                chunk = self.rfile.read(min(left, 1 << 16))
                if not chunk:
                    return
                left -= len(chunk)
            self.close_connection = True

        def _drain_chunked(self) -> None:
            """Read and drop a chunked body (bounded) up to its last chunk, so that closing
            after the answer does not reset a client still sending (it would lose the 411)."""
            left = DRAIN_LIMIT_BYTES
            previous = b""
            while left > 0:
                line = self.rfile.readline(min(left, 1 << 16))
                if not line:
                    break
                left -= len(line)
                if line == b"\r\n" and previous.strip() == b"0":
                    break
                previous = line
            self.close_connection = True

        def _refuse(self, code: int, why: str) -> None:
            receiver.reject(code, why, str(self.client_address[0]))
            headers = {}
            if code == 401 and receiver.auth is not None:
                headers["WWW-Authenticate"] = ", ".join(
                    f'{scheme} realm="mfotel-alerts-receiver"' for scheme in receiver.auth.schemes)
            try:
                self._reply(code, f"{printable(why, 500)}\n", headers=headers)
            except OSError:
                pass

        def _reply(self, code: int, body: str, content_type: str = "text/plain",
                   headers: dict[str, str] | None = None) -> None:
            self.allow_writing()
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", f"{content_type}; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)

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
    add_auth_arguments(parser)
    tls = parser.add_argument_group("TLS (Alertmanager: http_config.tls_config)")
    tls.add_argument("--tls-cert-file", metavar="FILE", help="serve HTTPS with this certificate")
    tls.add_argument("--tls-key-file", metavar="FILE", help="... and this private key")
    tls.add_argument("--tls-client-ca-file", metavar="FILE",
                     help="require client certificates signed by this CA (mutual TLS; "
                          "Alertmanager: tls_config.cert_file / key_file)")
    limits = parser.add_argument_group("limits")
    limits.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        metavar="BYTES",
                        help="larger bodies get 413 (default: %(default)s)")
    limits.add_argument("--max-connections", type=int, default=16, metavar="N",
                        help="connections served at once; more get 503 (default: %(default)s)")
    limits.add_argument("--request-timeout-seconds", type=float, default=10.0,
                        metavar="SECONDS",
                        help="time a connection has for its whole request (default: "
                             "%(default)s)")
    add_alert_control_arguments(parser)
    return parser


def _tls_from_args(args: argparse.Namespace) -> ssl.SSLContext | None:
    if not (args.tls_cert_file or args.tls_key_file or args.tls_client_ca_file):
        return None
    if not (args.tls_cert_file and args.tls_key_file):
        raise ValueError("--tls-cert-file and --tls-key-file go together (and "
                         "--tls-client-ca-file needs both)")
    try:
        return tls_context(args.tls_cert_file, args.tls_key_file, args.tls_client_ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"cannot load the TLS files ({args.tls_cert_file}, {args.tls_key_file}"
                         f"{', ' + args.tls_client_ca_file if args.tls_client_ca_file else ''}): "
                         f"{getattr(exc, 'strerror', None) or exc}") from None


def _limits_problem(args: argparse.Namespace) -> str | None:
    if args.max_body_bytes < 1024:
        return f"--max-body-bytes {args.max_body_bytes}: at least 1024"
    if args.max_connections < 1:
        return f"--max-connections {args.max_connections}: at least 1"
    if not 0 < args.request_timeout_seconds <= 3600:
        return f"--request-timeout-seconds {args.request_timeout_seconds:g}: between 0 and 3600"
    return None


def _security_notes(args: argparse.Namespace, receiver: AlertsReceiver) -> list[str]:
    """What authenticates the receiver, and what deserves a warning."""
    if receiver.authenticated:
        kinds = [*(receiver.auth.schemes if receiver.auth else [])]
        if receiver.client_certificates_required:
            kinds.append("client certificates")
        notes = [f"requests must authenticate ({' or '.join(kinds)})"]
    elif receiver.control is not None:
        notes = ["WARNING: --insecure-no-auth: anyone who can reach this port can stop jobs "
                 "or scale their learning rate"]
    else:
        notes = ["no authentication: anyone who can reach this port can post alerts; it only "
                 "prints them (add --bearer-token-file to authenticate)"]
    for path in (args.bearer_token_file, args.basic_auth_password_file):
        if world_readable(path):
            notes.append(f"WARNING: {path} is readable by other users; chmod 600 it")
    if receiver.auth is not None and receiver.tls is None and args.host not in (
            "127.0.0.1", "localhost", "::1"):
        notes.append(f"WARNING: credentials cross the network in clear text on {args.host}; "
                     "add --tls-cert-file and --tls-key-file")
    return notes


def run(args: argparse.Namespace) -> int:
    def fail(message: str) -> int:
        print(f"mfotel alerts-receiver: error: {message}", file=sys.stderr)
        return 2

    problem = _limits_problem(args)
    if problem:
        return fail(problem)
    try:
        control = alert_control_from_args(args)
        auth = auth_from_args(args)
        tls = _tls_from_args(args)
    except (ValueError, AuthSetupError) as error:
        return fail(str(error))
    receiver = AlertsReceiver(args.host, args.port, jsonl_path=args.jsonl, verbose=args.verbose,
                              control=control, auth=auth, insecure_no_auth=args.insecure_no_auth,
                              tls=tls, max_body_bytes=args.max_body_bytes,
                              max_connections=args.max_connections,
                              request_seconds=args.request_timeout_seconds)
    try:
        receiver.start()
    except InsecureReceiverError as error:
        return fail(str(error))
    except OSError as error:
        return fail(f"cannot listen on {args.host}:{args.port}: {error}")
    print(f"mfotel alerts-receiver: listening on {receiver.url} (Ctrl-C to stop)",
          file=sys.stderr, flush=True)
    for note in _security_notes(args, receiver):
        print(f"mfotel alerts-receiver: {note}", file=sys.stderr, flush=True)
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
