"""Token buckets, alone and per client, and exporter-toolkit's `rate_limit` middleware.

    failures = Buckets(rate=1.0, burst=5)      # one bucket per client
    if not failures[client_key(address)].take():
        ...                                     # answer 429, Retry-After: retry_after(...)

Any positive rate is safe: a bucket that refills once an eon answers with the longest
Retry-After (`MAX_RETRY_AFTER`), never an overflow.
"""
from __future__ import annotations

import ipaddress
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from .wsgi import Environ, StartResponse, WsgiApp, plain

#: The longest wait a 429 asks for (seconds): a client is told to come back within the hour
#: even when the configured rate would make it wait longer.
MAX_RETRY_AFTER = 3600


class TokenBucket:
    """`rate` tokens per second, at most `burst` saved up; thread-safe."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.rate, self.burst, self._clock = rate, burst, clock
        self._tokens, self._at = float(burst), clock()
        self._lock = threading.Lock()

    def _refill(self) -> None:
        now = self._clock()
        elapsed, self._at = max(0.0, now - self._at), now
        if elapsed and self.rate > 0:  # elapsed * rate may be inf, never nan
            self._tokens = min(float(self.burst), self._tokens + elapsed * self.rate)

    def ready(self) -> bool:
        """Whether a token is there (none is taken)."""
        with self._lock:
            self._refill()
            return self._tokens >= 1

    def level(self) -> float:
        """Tokens there now (negative: in debt)."""
        with self._lock:
            self._refill()
            return self._tokens

    def take(self) -> bool:
        with self._lock:
            self._refill()
            if self._tokens < 1:
                return False
            self._tokens -= 1
            return True

    def spend(self) -> None:
        """Take a token even when none is left (the debt delays the next one)."""
        with self._lock:
            self._refill()
            self._tokens = max(self._tokens - 1, -float(self.burst))

    def give_back(self) -> None:
        with self._lock:
            self._tokens = min(float(self.burst), self._tokens + 1)

    def seconds_to_token(self) -> float:
        """Seconds until a token is there: 0.0 now, `math.inf` when the rate is too small
        for the wait to be a float."""
        with self._lock:
            self._refill()
            missing = 1 - self._tokens
        if missing <= 0:
            return 0.0
        if not self.rate > 0:
            return math.inf
        try:
            return missing / self.rate
        except OverflowError:  # e.g. 1 / 5e-324
            return math.inf


def retry_after(seconds: float) -> str:
    """A Retry-After value: whole seconds, at least 1, at most MAX_RETRY_AFTER."""
    if not seconds < MAX_RETRY_AFTER:  # inf and nan too
        return str(MAX_RETRY_AFTER)
    return str(max(1, math.ceil(seconds)))


class Buckets:
    """A TokenBucket per key; beyond `size` keys the least recently used is forgotten (it
    comes back full, which is why a limit over all clients must back these up)."""

    def __init__(self, rate: float, burst: float, size: int = 4096) -> None:
        self.rate, self.burst, self.size = rate, burst, size
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()
        self._lock = threading.Lock()

    def __getitem__(self, key: str) -> TokenBucket:
        with self._lock:
            bucket = self._buckets.pop(key, None) or TokenBucket(self.rate, self.burst)
            self._buckets[key] = bucket  # most recently used last
            while len(self._buckets) > self.size:
                self._buckets.popitem(last=False)
            return bucket


def client_key(address: str) -> str:
    """The client an address stands for: itself (IPv4), its /64 network (IPv6, where one host
    holds a whole /64 and could otherwise rotate through fresh buckets)."""
    try:
        ip = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:  # ::ffff:a.b.c.d on a dual-stack socket
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


class RateLimit:
    """exporter-toolkit's `rate_limit`: every request takes a token; none left: 429."""

    def __init__(self, app: WsgiApp, bucket: TokenBucket) -> None:
        self.app, self.bucket = app, bucket

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        if self.bucket.take():
            return self.app(environ, start_response)
        return plain(start_response, "429 Too Many Requests",
                     [("Retry-After", retry_after(self.bucket.seconds_to_token()))])
