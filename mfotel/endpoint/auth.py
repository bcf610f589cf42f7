"""Who may use an endpoint: WSGI middleware for HTTP credentials, and the mutual-TLS peer check.

- `BasicAuth`: exporter-toolkit's `basic_auth_users` (bcrypt hashes), with a cache of verified
  credentials and a rate limit on failed logins (`FailureLimit`);
- `RequireCredentials`: fixed secrets, as Alertmanager's webhook `http_config` sends them
  (`Credentials`: a bearer token and/or a basic-auth user and password), compared in constant
  time;
- `AllowedSans`: exporter-toolkit's `client_allowed_sans`, checked on the verified client
  certificate right after the TLS handshake (the server's `accept_peer`).

    app = BasicAuth(app, {"prometheus": b"$2y$10$..."}, failures_per_second=1.0)
    app = RequireCredentials(app, Credentials(bearer_token=b"s3cret"), realm="receiver")
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .ratelimit import Buckets, TokenBucket, client_key, retry_after
from .wsgi import AUTHENTICATED, Environ, StartResponse, WsgiApp, plain


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


def _cost(hashed: bytes) -> int:
    """The cost of a bcrypt hash (`$2y$10$...`: 10), so the dummy hash costs the same."""
    try:
        return int(hashed.split(b"$")[2])
    except (IndexError, ValueError):
        return 10


def basic_credentials(header: str) -> tuple[str, str] | None:
    """(user, password) of an `Authorization: Basic ...` header, None if it is not one."""
    if not header.startswith("Basic "):
        return None
    try:
        decoded = base64.b64decode(header[6:], validate=True).decode()
    except (ValueError, UnicodeDecodeError):
        return None
    user, colon, password = decoded.partition(":")
    return (user, password) if colon else None


# ---------------------------------------------------------------- basic auth with bcrypt
class FailureLimit:
    """Token buckets of failed logins, per client and for all clients together."""

    BURST = 5

    def __init__(self, per_second: float) -> None:
        self.by_client = Buckets(per_second, self.BURST)
        self.everyone = TokenBucket(2 * per_second, 2 * self.BURST)

    def reserve(self, address: str) -> bool:
        """Take one failure from both buckets, or neither; False when either is empty."""
        mine = self.by_client[client_key(address)]
        if not mine.take():
            return False
        if not self.everyone.take():
            mine.give_back()
            return False
        return True

    def refund(self, address: str) -> None:
        """The attempt succeeded: it was no failure."""
        self.by_client[client_key(address)].give_back()
        self.everyone.give_back()

    def seconds_to_retry(self, address: str) -> float:
        mine = self.by_client[client_key(address)]
        return max(mine.seconds_to_token(), self.everyone.seconds_to_token())


class BasicAuth:
    """WSGI middleware: HTTP basic auth against bcrypt hashes, as exporter-toolkit does it.

    Unknown users are checked against a dummy hash of the same cost (no user enumeration by
    timing). Outcomes are cached by a salted digest of (user, hash, password), so a scraper pays
    bcrypt once; verified credentials are kept apart from failures, which cannot evict them.
    A bcrypt check needs a token of `FailureLimit` (refunded on success): once a client (or all
    clients together) ran out, it gets 429 without bcrypt running. One bcrypt at a time.
    """

    CACHE = 100

    def __init__(self, app: WsgiApp, users: Mapping[str, bytes],
                 failures_per_second: float = 1.0) -> None:
        import bcrypt  # only needed when basic auth is configured
        self.app, self.users, self._bcrypt = app, dict(users), bcrypt
        cost = max(_cost(hashed) for hashed in users.values())
        self._dummy: bytes = bcrypt.hashpw(os.urandom(16).hex().encode(),
                                           bcrypt.gensalt(rounds=cost))
        self._salt = os.urandom(16)
        self._verified: OrderedDict[bytes, None] = OrderedDict()
        self._refused: OrderedDict[bytes, None] = OrderedDict()
        self._lock, self._bcrypt_lock = threading.Lock(), threading.Lock()
        self.failures = FailureLimit(failures_per_second)

    def _remember(self, cache: OrderedDict[bytes, None], key: bytes) -> None:
        with self._lock:
            cache[key] = None
            while len(cache) > self.CACHE:
                cache.popitem(last=False)

    def check(self, user: str, password: str, address: str) -> bool | None:
        """True / False for the credentials; None when failures are rate-limited (429)."""
        hashed = self.users.get(user, self._dummy)
        key = _digest(b"\0".join((self._salt, user.encode(), hashed, password.encode())))
        with self._lock:
            if key in self._verified:
                return True
            if key in self._refused:
                return False
        if not self.failures.reserve(address):
            return None
        with self._bcrypt_lock:
            try:
                ok = bool(self._bcrypt.checkpw(password.encode(), hashed)) and user in self.users
            except ValueError:  # bcrypt 5 refuses passwords over 72 bytes
                ok = False
        if ok:
            self.failures.refund(address)
        self._remember(self._verified if ok else self._refused, key)
        return ok

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        given = basic_credentials(environ.get("HTTP_AUTHORIZATION", ""))
        address = environ.get("REMOTE_ADDR", "")
        ok = self.check(*given, address) if given else False
        if ok:
            environ[AUTHENTICATED] = True
            return self.app(environ, start_response)
        if ok is None:
            wait = retry_after(self.failures.seconds_to_retry(address))
            return plain(start_response, "429 Too Many Requests", [("Retry-After", wait)])
        return plain(start_response, "401 Unauthorized",
                     [("WWW-Authenticate", 'Basic realm="mfotel"')])


# ---------------------------------------------------------------- fixed credentials
@dataclass(frozen=True, repr=False)
class Credentials:
    """Accepted credentials; `allows(authorization_header)` checks a request in constant time
    (SHA-256 digests compared with hmac.compare_digest, so lengths do not leak either)."""

    bearer_token: bytes | None = None
    username: str | None = None
    password: bytes | None = None

    def __post_init__(self) -> None:
        if self.bearer_token is None and self.password is None:
            raise ValueError("no credentials: give a bearer token or a basic-auth password")
        if (self.username is None) != (self.password is None):
            raise ValueError("basic auth needs both a username and a password")

    def __repr__(self) -> str:  # never show the secrets (tracebacks, debuggers, logs)
        return f"Credentials({'+'.join(self.schemes).lower()})"

    @property
    def schemes(self) -> list[str]:
        """`Bearer` and/or `Basic`, for the WWW-Authenticate header and messages."""
        return [s for s, v in (("Bearer", self.bearer_token), ("Basic", self.password)) if v]

    def allows(self, header: str | None) -> bool:
        """Whether an `Authorization` header carries the configured credentials."""
        scheme, _, value = (header or "").strip().partition(" ")
        given = value.strip().encode("utf-8", "surrogateescape")
        ok = False
        if self.bearer_token is not None:
            ok |= scheme.lower() == "bearer" and hmac.compare_digest(
                _digest(given), _digest(self.bearer_token))
        if self.password is not None and self.username is not None:
            try:
                user, _, password = base64.b64decode(given, validate=True).partition(b":")
            except (binascii.Error, ValueError):
                user, password = b"", b""
            user_ok = hmac.compare_digest(_digest(user), _digest(self.username.encode()))
            password_ok = hmac.compare_digest(_digest(password), _digest(self.password))
            ok |= scheme.lower() == "basic" and user_ok and password_ok
        return ok


class RequireCredentials:
    """WSGI middleware: requests without `credentials` get 401 (`public` paths excepted).

    `on_refused(environ)` is told of every refusal (to count or report it).
    """

    def __init__(self, app: WsgiApp, credentials: Credentials, realm: str,
                 public: Collection[str] = (),
                 on_refused: Callable[[Environ], None] = lambda environ: None) -> None:
        self.app, self.credentials, self.public = app, credentials, public
        self.on_refused = on_refused
        self.challenge = ", ".join(f'{scheme} realm="{realm}"' for scheme in credentials.schemes)

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        if self.credentials.allows(environ.get("HTTP_AUTHORIZATION")):
            environ[AUTHENTICATED] = True
            return self.app(environ, start_response)
        if environ.get("PATH_INFO", "").rstrip("/") in self.public:
            return self.app(environ, start_response)
        self.on_refused(environ)
        return plain(start_response, "401 Unauthorized",
                     [("WWW-Authenticate", self.challenge)], "missing or wrong credentials")


# ---------------------------------------------------------------- mutual TLS
class AllowedSans:
    """exporter-toolkit's `client_allowed_sans`: a verified client certificate must name one
    of them (DNS name, IP address, e-mail or URI); IP addresses compare by value."""

    def __init__(self, sans: Iterable[str]) -> None:
        self.allowed = {_canonical(san) for san in sans}

    def __call__(self, cert: Mapping[str, Any] | None) -> bool:
        names = (cert or {}).get("subjectAltName", ())
        return any(_canonical(value) in self.allowed for kind, value in names
                   if kind in ("DNS", "IP Address", "email", "URI"))


def _canonical(san: str) -> str:
    """IP addresses compare by value (OpenSSL prints IPv6 uncompressed)."""
    try:
        return ipaddress.ip_address(san.strip()).compressed
    except ValueError:
        return san

