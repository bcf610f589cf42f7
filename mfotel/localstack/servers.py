"""The real Prometheus and Alertmanager binaries on loopback, free ports, finding binaries.

    with Prometheus(config_text, rule_files=[...]) as prom:
        prom.query("mindformers_train_loss")
"""
from __future__ import annotations

import collections
import json
import os
import random
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

PROMETHEUS_BINARIES = ("prometheus",)
ALERTMANAGER_BINARIES = ("prometheus-alertmanager", "alertmanager")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now, below the ephemeral range (as
    `free_port_block`): one the kernel handed out (bind to port 0) could be taken meanwhile as
    the source port of an outgoing connection, e.g. a Prometheus keep-alive scrape, and stay
    taken for minutes (a rank's second run on its port waited 60 s for it under load)."""
    return free_port_block(1, host)


def ephemeral_low(default: int = 32768) -> int:
    """The first port Linux hands out to outgoing connections (ip_local_port_range)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as handle:
            return int(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        return default


#: `LOW-HIGH`: the ports the local stack picks free ports from, both included (default 10000
#: up to the ephemeral range). Processes that pick ports at once give each its own range: a
#: port picked free is bound only later (by a training process, 100 s later under load), and
#: another picker could take it meanwhile (the test suite gives each of its workers a range).
PORTS_ENV = "MFOTEL_FREE_PORTS"
#: The lowest port picked without PORTS_ENV.
PORTS_LOW = 10000


def _port_range(count: int) -> tuple[int, int]:
    """The range [low, high) the first port of a block of `count` is picked from."""
    spec = os.environ.get(PORTS_ENV, "").strip()
    if not spec:
        return PORTS_LOW, max(PORTS_LOW + count + 1, min(ephemeral_low(), 65536) - count)
    try:
        low, high = (int(part) for part in spec.split("-"))
    except ValueError:
        low = high = 0
    if not 1024 <= low <= high <= 65535 or high - low + 1 < count:
        raise ValueError(f"{PORTS_ENV}={spec!r}: expected LOW-HIGH (both included), 1024 <= "
                         f"LOW <= HIGH <= 65535, room for {count} port(s), e.g. "
                         f"{PORTS_ENV}=20000-21999; unset, ports are picked from {PORTS_LOW} up to "
                         "the ephemeral range")
    return low, high - count + 2


#: The ports this process handed out lately (the newest RECENT_PORTS): free when picked, they
#: are bound only later, and one picked after them must not be one of them (msrun's master
#: port once took a rank's port picked a moment before: the rank never served /metrics).
RECENT_PORTS = 256
_handed: collections.deque[int] = collections.deque(maxlen=RECENT_PORTS)
_handing = threading.Lock()


def free_port_block(count: int, host: str | None = "127.0.0.1") -> int:
    """A first port P with P .. P + count - 1 free on `host` (None: every address), none of
    them among the ports this process handed out lately (RECENT_PORTS) while the range has
    others.

    Picked below the ephemeral range: a port in it that is free now can become the source
    port of any outgoing connection (a scrape, a test's client) before a rank binds it.
    Within PORTS_ENV's range when it is set.
    """
    rng = random.Random()
    low, high = _port_range(count)
    with _handing:
        for avoid_recent in (True, False):
            for _ in range(200):
                base = rng.randrange(low, high)
                if avoid_recent and any(p in _handed for p in range(base, base + count)):
                    continue
                if _all_free(base, count, host):
                    _handed.extend(range(base, base + count))
                    return base
    raise RuntimeError(f"no {count} consecutive free ports between {low} and {high}")


def _all_free(base: int, count: int, host: str | None) -> bool:
    try:
        for port in range(base, base + count):
            with socket.socket() as sock:
                sock.bind(("" if host in (None, "0.0.0.0") else host, port))
    except OSError:
        return False
    return True


def find_binary(names: Sequence[str]) -> str | None:
    """The first of `names` found on PATH (or in /usr/bin), else None."""
    for name in names:
        path = shutil.which(name) or shutil.which(name, path="/usr/bin")
        if path:
            return path
    return None


def required_binary(names: Sequence[str], package: str) -> str:
    """The first of `names` found (find_binary), else FileNotFoundError naming `package`."""
    binary = find_binary(names)
    if binary is None:
        raise FileNotFoundError(f"{names[-1]} not found on PATH; install it: "
                                f"apt-get install {package}")
    return binary


def instant_query(url: str, expr: str, time_: float | None = None) -> list[dict]:
    """The Prometheus query API at `url` (Prometheus, VictoriaMetrics): an instant query, now
    or at unix time `time_`; the `result` list (RuntimeError on an API error)."""
    params = {"query": expr}
    if time_ is not None:
        params["time"] = f"{time_:.3f}"
    data = http_get_json(f"{url}/api/v1/query?{urllib.parse.urlencode(params)}")
    if data.get("status") != "success":
        raise RuntimeError(f"query {expr!r} failed: {data}")
    return data["data"]["result"]


def http_get_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read().decode())


_S = TypeVar("_S", bound="_Server")


class _Server:
    """A child process with a data dir, a port and a readiness URL; stops what it starts and
    removes the data dir it made (when given none)."""

    name = "server"

    def __init__(self, workdir: str | Path | None = None, port: int | None = None) -> None:
        self._own_dir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix=f"mfotel-{self.name}-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        self.log_path = self.workdir / f"{self.name}.log"

    def command(self) -> list[str]:
        raise NotImplementedError

    def start(self: _S, timeout: float = 30.0) -> _S:
        log = open(self.log_path, "wb")
        self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                        cwd=self.workdir)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                code, log_tail = self.process.returncode, self.log_path.read_text()[-3000:]
                self.stop()
                raise RuntimeError(f"{self.name} exited with {code}:\n{log_tail}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as response:
                    if response.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.1)
        log_tail = self.log_path.read_text()[-3000:]
        self.stop()
        raise TimeoutError(f"{self.name} not ready on {self.url} after {timeout}s:\n{log_tail}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self.process = None
        if self._own_dir:  # a directory it made: its data and log go with it
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self: _S) -> _S:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Prometheus(_Server):
    """`prometheus` with the given config text (and rule files copied beside it)."""

    name = "prometheus"

    def __init__(self, config_text: str, rule_files: Sequence[str | Path] = (),
                 workdir: str | Path | None = None, port: int | None = None,
                 extra_args: Sequence[str] = ()) -> None:
        self.binary = required_binary(PROMETHEUS_BINARIES, "prometheus")
        super().__init__(workdir, port)
        for rule_file in rule_files:
            shutil.copy(rule_file, self.workdir / Path(rule_file).name)
        self.config_path = self.workdir / "prometheus.yml"
        self.config_path.write_text(config_text)
        self.extra_args = list(extra_args)

    def command(self) -> list[str]:
        return [self.binary, f"--config.file={self.config_path}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn",
                *self.extra_args]

    def query(self, expr: str, time_: float | None = None) -> list[dict]:
        """Instant query; returns the `result` list (raises on an API error)."""
        return instant_query(self.url, expr, time_)

    def targets(self) -> list[dict]:
        return http_get_json(f"{self.url}/api/v1/targets")["data"]["activeTargets"]

    def wait_for(self, expr: str, timeout: float = 60.0, interval: float = 0.25) -> list[dict]:
        """Poll `expr` until it returns data; the result, or TimeoutError."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            result = self.query(expr)
            if result:
                return result
            time.sleep(interval)
        raise TimeoutError(f"no data for {expr!r} after {timeout}s")


    def wait_for_evaluation(self, after: float, timeout: float = 60.0) -> None:
        """Poll until every rule group was evaluated after unix time `after`: within
        `timeout` seconds past `after` plus the longest group interval (the goodput group
        evaluates once a minute, the others at the global interval)."""
        deadline = time.monotonic() + max(after - time.time(), 0.0) + timeout
        longest = 0.0
        while time.monotonic() < deadline + longest:
            groups = http_get_json(f"{self.url}/api/v1/rules")["data"]["groups"]
            longest = max((float(g.get("interval") or 0) for g in groups), default=0.0)
            if groups and all(unix_seconds(g["lastEvaluation"]) > after for g in groups):
                return
            time.sleep(0.1)
        raise TimeoutError(f"rules not evaluated after {after} within {timeout}s past it and "
                           f"the longest group interval ({longest:g} s)")


def unix_seconds(rfc3339: str) -> float:
    """Unix seconds of Prometheus' RFC 3339 timestamps (nanoseconds cut to microseconds)."""
    text = re.sub(r"(\.\d{6})\d+", r"\1", rfc3339).replace("Z", "+00:00")
    return datetime.fromisoformat(text).timestamp()


class Alertmanager(_Server):
    """`prometheus-alertmanager` with the given config text, clustering off."""

    name = "alertmanager"

    def __init__(self, config_text: str, workdir: str | Path | None = None,
                 port: int | None = None) -> None:
        self.binary = required_binary(ALERTMANAGER_BINARIES, "prometheus-alertmanager")
        super().__init__(workdir, port)
        self.config_path = self.workdir / "alertmanager.yml"
        self.config_path.write_text(config_text)

    def command(self) -> list[str]:
        return [self.binary, f"--config.file={self.config_path}",
                f"--storage.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--cluster.listen-address=", "--log.level=warn"]

    def alerts(self) -> list[dict]:
        return http_get_json(f"{self.url}/api/v2/alerts")
