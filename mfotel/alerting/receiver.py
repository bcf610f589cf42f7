"""A tiny Alertmanager webhook receiver: one readable line per firing or resolved alert.

    mfotel alerts-receiver --port 9095 --jsonl alerts.jsonl

prints, for each alert of each notification Alertmanager posts,

    [FIRING critical] MindFormersLossNotFinite job_name=llama rank=0: Training loss is NaN or Inf.
    [RESOLVED] MindFormersLossNotFinite job_name=llama rank=0: Training loss is NaN or Inf.

With `--control-dir` it also turns allow-listed alerts into control requests that stop a job
or scale its learning rate (mfotel.actions.control); then it requires credentials (a bearer
token or basic auth, as Alertmanager's `http_config` sends them, mfotel.alerting.credentials;
or client certificates) and refuses to start without them unless `--insecure-no-auth`.

It is served by the endpoint server of the ranks (mfotel.endpoint.server), so idle or slow
clients cost no thread and cannot crowd Alertmanager out: at most `--max-connections` (16)
open connections, `--max-connections-per-client` (8) of them from one address, a request head
(the credentials) within `--header-timeout-seconds` (3) of the accept, a quarter of the places
kept for requests past their head, the whole request within `--request-timeout-seconds` (10).
Bodies up to `--max-body-bytes` (413 beyond). A bad body gets a 400 naming what is wrong
(mfotel.alerting.webhook); no request can crash it.

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
from collections.abc import Callable, Iterable
from dataclasses import asdict
from http import HTTPStatus
from pathlib import Path
from typing import Any, TextIO

from ..actions.control import AlertControl, add_alert_control_arguments, alert_control_from_args
from ..endpoint.auth import Credentials, RequireCredentials
from ..endpoint.server import Limits, Server
from ..endpoint.webconfig import TlsConfig
from ..endpoint.wsgi import Environ, StartResponse, plain
from ..subcommand import Subcommand
from .credentials import (
    MAX_SECRET_BYTES,
    AuthSetupError,
    add_auth_arguments,
    auth_from_args,
    world_readable,
)
from .webhook import PayloadError, ReceivedAlert, decode_notification, parse_notification, printable

__all__ = ["AlertsReceiver", "ReceivedAlert", "parse_notification", "InsecureReceiverError"]

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 9095
#: Alertmanager sends every alert of a group in one body (~1.5 KB each; `max_alerts` caps it).
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_MAX_CONNECTIONS = 16
#: One address (Alertmanager's, or an attacker's) holds at most this many of the places.
DEFAULT_MAX_CONNECTIONS_PER_CLIENT = 8
#: Before authentication: the TLS handshake and the request head within this of the accept.
DEFAULT_HEADER_SECONDS = 3.0
#: The kernel holds a connection until its request comes (Limits.defer_accept): idle sockets
#: on Alertmanager's address never take the place of a webhook on its way.
DEFER_ACCEPT_SECONDS = 2
DEFAULT_REQUEST_SECONDS = 10.0
#: An over-large or unauthorised body is read and dropped up to this size, so that the client
#: reads our answer instead of a reset connection; beyond it the connection is closed.
DRAIN_LIMIT_BYTES = 64 * 1024 * 1024
#: What is kept in memory for `received()` / `GET /alerts`: the newest alerts within both bounds.
KEEP_ALERTS, KEEP_CHARS = 10_000, 64 * 1024 * 1024
#: A rejected request is reported on stderr at most once per kind and interval.
REPORT_INTERVAL_SECONDS = 60.0
#: Paths anyone may GET (load balancers, `docker compose` health checks).
PUBLIC_PATHS = ("/-/healthy", "/-/ready")


class InsecureReceiverError(ValueError):
    """Acting on alerts without authentication was not explicitly allowed."""


def receiver_limits(max_connections: int = DEFAULT_MAX_CONNECTIONS,
                    per_client: int = DEFAULT_MAX_CONNECTIONS_PER_CLIENT,
                    header_seconds: float = DEFAULT_HEADER_SECONDS,
                    request_seconds: float = DEFAULT_REQUEST_SECONDS,
                    read_body_bytes: int = 0) -> Limits:
    """The endpoint limits of a receiver (mfotel.endpoint.server explains each one).
    `read_body_bytes`: bodies the server reads before the app (a receiver without
    credentials: the app would read them for anyone)."""
    return Limits(max_connections=max_connections,
                  max_connections_per_client=min(per_client, max_connections),
                  reserved=max_connections // 4,  # room for requests past their head
                  request_timeout=request_seconds, header_timeout=header_seconds,
                  max_head_bytes=2 * MAX_SECRET_BYTES,  # a bearer token fits
                  drain_bytes=DRAIN_LIMIT_BYTES, backlog=64, read_body_bytes=read_body_bytes,
                  defer_accept=DEFER_ACCEPT_SECONDS,  # Alertmanager's request comes with it
                  # failures rank whose connection is closed first, but never lock an
                  # address out: Alertmanager may share it with a misbehaving client
                  close_failing_clients=False)


class AlertsReceiver:
    """HTTP(S) server on a thread; every authorised POST body is an Alertmanager notification.

    `GET /-/healthy` answers OK to anyone; `GET /alerts` returns what was received as JSON
    (to authorised clients only when credentials are configured).
    """

    def __init__(self, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
                 jsonl_path: str | Path | None = None, out: TextIO | None = sys.stdout,
                 verbose: bool = False, control: AlertControl | None = None,
                 auth: Credentials | None = None, insecure_no_auth: bool = False,
                 tls: ssl.SSLContext | None = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 request_seconds: float = DEFAULT_REQUEST_SECONDS,
                 err: TextIO | None = sys.stderr,
                 max_connections_per_client: int = DEFAULT_MAX_CONNECTIONS_PER_CLIENT,
                 header_seconds: float = DEFAULT_HEADER_SECONDS) -> None:
        self.host, self.requested_port = host, port
        self.control = control  # allow-listed alerts -> control file (None: off)
        self.auth, self.insecure_no_auth, self.tls = auth, insecure_no_auth, tls
        self.jsonl_path = Path(jsonl_path) if jsonl_path else None
        self.out, self.err, self.verbose = out, err, verbose
        self.max_body_bytes, self.request_seconds = max_body_bytes, request_seconds
        # without credentials the app reads any client's body: the server reads it first, so
        # that a body declared and never sent holds no worker (with credentials, a refusal
        # comes before the body, and only verified clients' bodies are read by the app)
        self.limits = receiver_limits(max_connections, max_connections_per_client,
                                      header_seconds, request_seconds,
                                      max_body_bytes if auth is None else 0)
        self.alerts: deque[ReceivedAlert] = deque()
        self.notifications = 0
        self.rejected: Counter[int] = Counter()   # status code -> requests answered with it
        self._kept_chars = 0
        self._reported: dict[int, tuple[float, int]] = {}   # code -> (last report, since then)
        self._cond = threading.Condition()
        self._parsing = threading.BoundedSemaphore(2)   # bounds the memory of parallel parses
        self._server: Server | None = None
        self._stopped = threading.Event()

    # ------------------------------------------------------------ lifecycle
    @property
    def port(self) -> int:
        return self.requested_port if self._server is None else self._server.port

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

    def start(self) -> AlertsReceiver:
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
        app: Callable[[Environ, StartResponse], Iterable[bytes]] = self._app
        if self.auth is not None:
            app = RequireCredentials(app, self.auth, "mfotel-alerts-receiver", PUBLIC_PATHS,
                                     on_refused=lambda environ: self.reject(
                                         401, "missing or wrong credentials",
                                         environ.get("REMOTE_ADDR", "?")))
        self._stopped.clear()
        self._server = Server(app, self.host, self.requested_port, self.tls, self.limits,
                              name="mfotel-alerts-receiver").start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        self._server = None
        self._stopped.set()

    def __enter__(self) -> AlertsReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def serve_forever(self) -> None:
        """Blocking: start (unless started) and serve until interrupted (Ctrl-C)."""
        if self._server is None:
            self.start()
        try:
            while not self._stopped.wait(0.5):
                pass
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


    # ------------------------------------------------------------ HTTP
    def _app(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        """The WSGI app behind the credentials check: POST a notification (any path),
        GET /alerts, /-/healthy, /-/ready."""
        client = str(environ.get("REMOTE_ADDR") or "?")
        try:
            method = environ["REQUEST_METHOD"]
            if method == "POST":
                return self._post(environ, start_response, client)
            if method not in ("GET", "HEAD"):
                return plain(start_response, "405 Method Not Allowed",
                             [("Allow", "GET, HEAD, POST")])
            path = environ.get("PATH_INFO", "").rstrip("/")
            if path in PUBLIC_PATHS:
                return plain(start_response, "200 OK", text="OK")
            if path == "/alerts":
                body = (json.dumps([asdict(a) for a in self.received()], indent=1) + "\n").encode()
                start_response("200 OK", [("Content-Type", "application/json; charset=utf-8"),
                                          ("Content-Length", str(len(body)))])
                return [body]
            return plain(start_response, "404 Not Found", text="POST Alertmanager webhooks to "
                         "/alerts; GET /alerts lists them")
        except Exception as exc:  # noqa: BLE001 - a bug must not cost the connection
            return self._refuse(start_response, 500, f"internal error ({type(exc).__name__})",
                                client)

    def _post(self, environ: Environ, start_response: StartResponse, client: str
              ) -> Iterable[bytes]:
        if environ.get("HTTP_TRANSFER_ENCODING"):
            return self._refuse(start_response, 411, "send the body with a Content-Length (no "
                                "chunked encoding)", client)
        try:
            length = int(environ.get("CONTENT_LENGTH") or 0)
        except ValueError:
            length = -1
        if length <= 0:
            return self._refuse(start_response, 400, "the body is empty or has no "
                                "Content-Length: expected a JSON notification", client)
        if length > self.max_body_bytes:
            return self._refuse(start_response, 413, f"body of {length} bytes; at most "
                                f"{self.max_body_bytes} (Alertmanager: set webhook_configs[]."
                                "max_alerts)", client)
        try:
            body = environ["wsgi.input"].read(length)
        except TimeoutError:
            return self._refuse(start_response, 408, "the request was not complete within "
                                f"{self.request_seconds:g} s", client)
        except OSError:  # the client went away: nobody reads the answer
            body = b""
        if len(body) < length:
            return plain(start_response, "400 Bad Request", text="the body ended early")
        try:
            self.handle_body(body)
        except PayloadError as error:
            return self._refuse(start_response, 400, str(error), client)
        start_response("200 OK", [("Content-Type", "text/plain; charset=utf-8"),
                                  ("Content-Length", "0")])
        return [b""]

    def _refuse(self, start_response: StartResponse, code: int, why: str, client: str
                ) -> Iterable[bytes]:
        self.reject(code, why, client)
        return plain(start_response, f"{code} {HTTPStatus(code).phrase}", text=printable(why, 500))


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
    limits.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                        metavar="N",
                        help="open connections at most (a quarter kept for requests past their "
                             "head); at the cap a draining or idle one of the client holding the "
                             "most is closed first (default: %(default)s)")
    limits.add_argument("--max-connections-per-client", type=int,
                        default=DEFAULT_MAX_CONNECTIONS_PER_CLIENT, metavar="N",
                        help="open connections from one address (IPv6: one /64) at most "
                             "(default: %(default)s)")
    limits.add_argument("--header-timeout-seconds", type=float, default=DEFAULT_HEADER_SECONDS,
                        metavar="SECONDS",
                        help="time from connecting to a complete request head, TLS handshake "
                             "included, before any authentication; at most the request timeout "
                             "(default: %(default)s)")
    limits.add_argument("--request-timeout-seconds", type=float, default=DEFAULT_REQUEST_SECONDS,
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
        return TlsConfig(args.tls_cert_file, args.tls_key_file,
                         "RequireAndVerifyClientCert" if args.tls_client_ca_file else
                         "NoClientCert", args.tls_client_ca_file).context()
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"cannot load the TLS files ({args.tls_cert_file}, {args.tls_key_file}"
                         f"{', ' + args.tls_client_ca_file if args.tls_client_ca_file else ''}): "
                         f"{getattr(exc, 'strerror', None) or exc}") from None


def _limits_problem(args: argparse.Namespace) -> str | None:
    if args.max_body_bytes < 1024:
        return f"--max-body-bytes {args.max_body_bytes}: at least 1024"
    if args.max_connections < 1:
        return f"--max-connections {args.max_connections}: at least 1"
    if args.max_connections_per_client < 1:
        return f"--max-connections-per-client {args.max_connections_per_client}: at least 1"
    if not 0 < args.request_timeout_seconds <= 3600:
        return f"--request-timeout-seconds {args.request_timeout_seconds:g}: between 0 and 3600"
    if not 0 < args.header_timeout_seconds <= 3600:
        return f"--header-timeout-seconds {args.header_timeout_seconds:g}: between 0 and 3600"
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
                              request_seconds=args.request_timeout_seconds,
                              max_connections_per_client=args.max_connections_per_client,
                              header_seconds=args.header_timeout_seconds)
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


COMMAND = Subcommand("alerts-receiver", "print Alertmanager webhook notifications",
                     "mfotel alerts-receiver", add_arguments, run, __doc__)
add_alerts_receiver_command = COMMAND.register
main = COMMAND.main


if __name__ == "__main__":
    sys.exit(main())
