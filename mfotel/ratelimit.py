"""Token buckets, alone and per client address, for the endpoint's limits.

    failures = Buckets(rate=1.0, burst=5)      # one bucket per client
    if not failures[client_key(address)].take():
        ...                                     # answer 429
"""
from __future__ import annotations

import ipaddress
import threading
import time
from collections import OrderedDict
from typing import Callable


class TokenBucket:
    """`rate` tokens per second, at most `burst` saved up; thread-safe."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst, self._clock = rate, burst, clock
        self._tokens, self._at = float(burst), clock()
        self._lock = threading.Lock()

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now

    def ready(self) -> bool:
        """Whether a token is there (none is taken)."""
        with self._lock:
            self._refill()
            return self._tokens >= 1

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
            self._tokens = max(self._tokens - 1, -self.burst)

    def give_back(self) -> None:
        with self._lock:
            self._tokens = min(self.burst, self._tokens + 1)

    def seconds_to_token(self) -> float:
        with self._lock:
            self._refill()
            return max(0.0, (1 - self._tokens) / self.rate)


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
