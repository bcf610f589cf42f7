"""The overview of all ranks on one rank's live page: where the ranks are, and their state.

    peers = rank_addresses(cfg, identity, job_name, scheme="http")  # Peers(urls, note)
    overview = Overview(peers_of=lambda: peers, own_rank=0)   # LivePage sets .local
    overview.snapshot(authorization)   # the last fan-out; a refresh starts in the background

The overview rank fetches every rank's `/api/summary` (a few hundred bytes) from a background
thread, only while someone looks at the page (asked within the last 10 s), and never more
often than its CPU cost allows:
the next refresh waits at least `cost / budget` seconds (2% of one core by default), so a
1000-rank job cannot make its rank 0 a straggler.

What rank 0 fetches, and to whom it sends the viewer's credentials (the ranks share the
web-config, so the viewer's basic auth opens every rank's page):
- only `http://` and `https://` peers at a plain `host:port`; anything else a target file
  names (`__scheme__: file`, a path or user part in the target) is refused and shown as such;
- redirects are never followed (a 3xx is shown as an error), and no proxy is used;
- the credentials go only to peers the configuration names: the node's own ports, the
  `file_sd.hosts` list, or per-rank target files that only this user could have written
  (owned by it or root, not writable by group or others, in a directory others cannot
  rename files in). Peers from other target files are fetched without credentials.
"""
from __future__ import annotations

import json
import os
import queue
import re
import ssl
import stat
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import MonitorConfig
from ..identity import RankIdentity
from ..regular_file import NotRegularFile, read_regular_file

#: Share of one core the fan-out may use (measured as the CPU time of its threads).
BUDGET = 0.02
MIN_INTERVAL_SECONDS = 2.0
#: The fan-out goes on while someone looked within this many seconds (the page asks every 2 s).
VIEWED_SECONDS = 10.0
FETCH_TIMEOUT_SECONDS = 2.0
FETCH_THREADS = 8
MAX_SUMMARY_BYTES = 64 * 1024
MAX_TARGET_FILE_BYTES = 64 * 1024
LOOPBACK = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1", "[::]": "::1"}
FETCH_SCHEMES = ("http", "https")
#: A file_sd target rank 0 may fetch: a host name or [IPv6] and a port, nothing else.
_TARGET = re.compile(r"(?:[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,252}[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\])"
                     r":[0-9]{1,5}")
_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH
#: keys of a rank's summary the overview table shows
ROW_KEYS = ("status", "status_name", "step", "loss", "loss_finite", "first_nonfinite_step",
            "learning_rate", "grad_norm", "throughput", "step_time", "last_step_timestamp",
            "nonfinite_now", "nonfinite_values")


@dataclass(frozen=True)
class Peers:
    """Base URLs (ending in "/") of the ranks by rank, and why some or all are unknown.

    `untrusted`: ranks whose address comes from a file others could have written (fetched
    without the viewer's credentials); `refused`: ranks not fetched at all, and why.
    """
    urls: dict[int, str] = field(default_factory=dict)
    note: str | None = None
    untrusted: frozenset[int] = frozenset()
    refused: dict[int, str] = field(default_factory=dict)


def _url(scheme: str, host: str, port: int) -> str:
    host = LOOPBACK.get(host, host)
    return f"{scheme}://[{host}]:{port}/" if ":" in host else f"{scheme}://{host}:{port}/"


def _only_ours(st: os.stat_result) -> bool:
    return st.st_uid in (0, os.geteuid()) and not st.st_mode & _WRITABLE_BY_OTHERS


def _written_by_us(path: Path, st: os.stat_result) -> bool:
    """Whether only this user (or root) can have written `path` (`st`): the file, and the
    directories of the path and of the file it links to (others could rename their own file
    over it there, unless the directory is sticky)."""
    try:
        directories = [os.stat(d) for d in {path.parent, Path(os.path.realpath(path)).parent}]
    except OSError:
        return False
    return _only_ours(st) and all(_only_ours(d) or (d.st_uid in (0, os.geteuid()) and bool(
        d.st_mode & stat.S_ISVTX)) for d in directories)


@dataclass(frozen=True)
class _Target:
    url: str | None        # None: refused
    problem: str = ""      # why it is refused
    trusted: bool = False  # the viewer's credentials may go there


def _from_target_file(path: Path) -> _Target | None:
    """The first target of a file_sd JSON file, None while unreadable (never blocks)."""
    try:
        st = os.stat(path)
        groups = json.loads(read_regular_file(os.fspath(path), MAX_TARGET_FILE_BYTES, st))
        group = groups[0]
        scheme, target = group.get("labels", {}).get("__scheme__", "http"), group["targets"][0]
    except (OSError, NotRegularFile, ValueError, KeyError, IndexError, TypeError, AttributeError,
            RecursionError):
        return None
    if scheme not in FETCH_SCHEMES:
        return _Target(None, f"not fetched: {path} names the scheme {str(scheme)[:20]!r} "
                             f"(only {' and '.join(FETCH_SCHEMES)} peers are)")
    if not isinstance(target, str) or not _TARGET.fullmatch(target):
        return _Target(None, f"not fetched: {path} names the target {str(target)[:60]!r}, "
                             f"not a host:port")
    return _Target(f"{scheme}://{target}/", trusted=_written_by_us(path, st))


def rank_addresses(cfg: MonitorConfig, identity: RankIdentity, job_name: str,
                   scheme: str) -> Peers:
    """Where every rank of the job serves its page, as far as this rank can know.

    One node: the bind address, port + local rank. Several nodes: `file_sd.hosts` (node-rank
    order, ranks numbered node by node as msrun does), or the per-rank target files of
    `file_sd: {mode: rank}` on a shared file system. Otherwise a note says what to set.
    """
    base, world = cfg.prometheus.port, identity.world_size
    per_node = identity.local_world_size
    sd = cfg.file_sd
    if not base:
        return Peers(note="the endpoint is off (prometheus.port: 0)")
    if sd.mode == "rank" and sd.path:
        urls, missing, untrusted, refused = {}, [], set(), {}
        for rank in range(world):
            path = sd.resolved_path(rank, job_name)  # not None: sd.path is set
            found = _from_target_file(path) if path is not None else None
            if found is None:
                missing.append(rank)
            elif found.url is None:
                refused[rank] = found.problem
            else:
                urls[rank] = found.url
                if not found.trusted:
                    untrusted.add(rank)
        notes = [f"{len(missing)} of {world} ranks have no readable target file yet "
                 f"({sd.path})"] if missing else []
        if untrusted:
            notes.append(f"{len(untrusted)} ranks' target files could have been written by "
                         f"another user (not this user's, or writable by others): fetched "
                         f"without the viewer's credentials")
        return Peers(urls, "; ".join(notes) or None, frozenset(untrusted), refused)
    if sd.hosts and per_node:
        hosts = sd.hosts
        if len(hosts) * per_node < world:
            return Peers(note=f"file_sd.hosts lists {len(hosts)} nodes of {per_node} ranks, "
                              f"fewer than the job's {world} ranks: list every node")
        return Peers({rank: _url(scheme, hosts[rank // per_node], base + rank % per_node)
                      for rank in range(world)})
    if world == 1 or (per_node and per_node >= world):
        return Peers({rank: _url(scheme, cfg.prometheus.host, base + rank)
                      for rank in range(world)})
    return Peers(note=f"rank {identity.rank} knows only its own node's address, and the job "
                      f"runs {world} ranks on several nodes (or the ranks per node are "
                      f"unknown): list the nodes in monitor_config.file_sd.hosts (node-rank "
                      f"order), or use file_sd mode: rank with a path on a shared file system")


def peer_opener(tls: ssl.SSLContext | None) -> urllib.request.OpenerDirector:
    """HTTP(S) only: no redirects, no proxies, no file:// or ftp:// (urlopen has them all);
    any status but 2xx raises HTTPError."""
    opener = urllib.request.OpenerDirector()
    for handler in (urllib.request.HTTPHandler(), urllib.request.HTTPSHandler(context=tls),
                    urllib.request.HTTPDefaultErrorHandler(), urllib.request.HTTPErrorProcessor()):
        opener.add_handler(handler)
    return opener


class Overview:
    """Every rank's summary, fetched in the background within a CPU budget."""

    def __init__(self, peers_of: Callable[[], Peers], own_rank: int,
                 tls: ssl.SSLContext | None = None, budget: float = BUDGET,
                 min_interval: float = MIN_INTERVAL_SECONDS,
                 timeout: float = FETCH_TIMEOUT_SECONDS) -> None:
        self.peers_of, self.own_rank = peers_of, own_rank
        #: this rank's own summary (set by its LivePage): never fetched over HTTP
        self.local: Callable[[], dict[str, Any]] = dict
        self.tls, self.budget, self.min_interval, self.timeout = tls, budget, min_interval, timeout
        self._opener = peer_opener(tls)
        self._lock = threading.Lock()
        self._rows: dict[int, dict[str, Any]] = {}
        self._note: str | None = None
        self._refreshed: float | None = None   # unix time of the last completed fan-out
        self._cost = 0.0                       # CPU seconds of the last fan-out
        self._due = 0.0                        # monotonic time the next fan-out may start
        self._running = False                  # the fan-out thread is alive
        self._viewed = 0.0                     # monotonic time of the last look
        self._authorization: str | None = None  # the last viewer's credentials (for the ranks)

    def snapshot(self, authorization: str | None = None) -> dict[str, Any]:
        """The last fan-out's rows (this rank's always current). The first look starts a
        thread that fans out whenever due, until nobody has looked for VIEWED_SECONDS."""
        now = time.monotonic()
        with self._lock:
            self._viewed, self._authorization = now, authorization
            if not self._running:
                self._running = True
                threading.Thread(target=self._loop, name="mfotel-ui-overview",
                                 daemon=True).start()
            rows = dict(self._rows)
            data: dict[str, Any] = {"note": self._note, "refreshed": self._refreshed,
                                    "cost_seconds": self._cost,
                                    "next_refresh_seconds": max(self._due - now, 0.0)}
        rows[self.own_rank] = {**self._row(self.local()), "rank": self.own_rank,
                               "url": rows.get(self.own_rank, {}).get("url")}
        data["ranks"] = [rows[rank] for rank in sorted(rows)]
        return data

    def _loop(self) -> None:
        while True:
            with self._lock:
                now = time.monotonic()
                if now - self._viewed > VIEWED_SECONDS:
                    self._running = False
                    return
                wait, authorization = self._due - now, self._authorization
            if wait > 0:
                time.sleep(min(wait, VIEWED_SECONDS))
                continue
            try:
                self._refresh(authorization)
            except Exception as exc:  # noqa: BLE001 - the page says so; the loop goes on
                with self._lock:
                    self._note = f"the overview failed: {type(exc).__name__}: {exc}"

    def _refresh(self, authorization: str | None) -> None:
        try:
            peers = self.peers_of()
            jobs: queue.SimpleQueue = queue.SimpleQueue()
            for rank, url in peers.urls.items():
                jobs.put((rank, url))
            rows: dict[int, dict[str, Any]] = {}
            cpu = [0.0]

            def work() -> None:
                started = time.thread_time()
                while True:
                    try:
                        rank, url = jobs.get_nowait()
                    except queue.Empty:
                        break
                    credentials = None if rank in peers.untrusted else authorization
                    row = ({} if rank == self.own_rank else self._fetch(url, credentials))
                    rows[rank] = {**row, "rank": rank, "url": url}
                spent = time.thread_time() - started
                with self._lock:
                    cpu[0] += spent
            threads = [threading.Thread(target=work, name="mfotel-ui-fetch", daemon=True)
                       for _ in range(min(FETCH_THREADS, len(peers.urls)))]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            rows.update({rank: {"error": problem, "rank": rank, "url": None}
                         for rank, problem in peers.refused.items()})
            with self._lock:
                self._rows, self._note, self._cost = rows, peers.note, cpu[0]
                self._refreshed = time.time()
        finally:
            with self._lock:
                self._due = time.monotonic() + max(self.min_interval, self._cost / self.budget)

    def _fetch(self, base_url: str, authorization: str | None) -> dict[str, Any]:
        request = urllib.request.Request(base_url + "api/summary")
        if authorization:
            request.add_header("Authorization", authorization)
        deadline = time.monotonic() + 2 * self.timeout  # a peer trickling bytes is cut off too
        try:
            with self._opener.open(request, timeout=self.timeout) as reply:
                body = b""
                while len(body) < MAX_SUMMARY_BYTES:
                    if time.monotonic() > deadline:
                        return {"error": "too slow (no summary within "
                                         f"{2 * self.timeout:.0f} s)"}
                    chunk = reply.read1(MAX_SUMMARY_BYTES - len(body))
                    if not chunk:
                        break
                    body += chunk
                return self._row(json.loads(body))
        except urllib.error.HTTPError as exc:
            moved = " (redirects are not followed)" if 300 <= exc.code < 400 else ""
            return {"error": f"HTTP {exc.code} {exc.reason}{moved}"}
        except (OSError, ValueError) as exc:
            reason = getattr(exc, "reason", None) or exc
            return {"error": f"unreachable ({reason})"}

    @staticmethod
    def _row(summary: Any) -> dict[str, Any]:
        if not isinstance(summary, dict):
            return {"error": "not a summary"}
        return {key: summary.get(key) for key in ROW_KEYS}
