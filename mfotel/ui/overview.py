"""The overview of all ranks on one rank's live page: where the ranks are, and their state.

    peers = rank_addresses(cfg, identity, job_name, scheme="http")  # Peers(urls, note)
    overview = Overview(peers_of=lambda: peers, own_rank=0)   # LivePage sets .local
    overview.snapshot(authorization)   # the last fan-out; a refresh starts in the background

The overview rank fetches every rank's `/api/summary` (a few hundred bytes) from a background
thread, only while someone looks at the page (asked within the last 10 s), and never more
often than its CPU cost allows:
the next refresh waits at least `cost / budget` seconds (2% of one core by default), so a
1000-rank job cannot make its rank 0 a straggler. The credentials the viewer gave this page
are sent to the other ranks (they share the web-config), as Prometheus sends its basic auth
to every target of its file_sd files.
"""
from __future__ import annotations

import json
import queue
import ssl
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..config import MonitorConfig
from ..identity import RankIdentity

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
#: keys of a rank's summary the overview table shows
ROW_KEYS = ("status", "status_name", "step", "loss", "loss_finite", "first_nonfinite_step",
            "learning_rate", "grad_norm", "throughput", "step_time", "last_step_timestamp",
            "nonfinite_now")


@dataclass(frozen=True)
class Peers:
    """Base URLs (ending in "/") of the ranks by rank, and why some or all are unknown."""
    urls: dict[int, str] = field(default_factory=dict)
    note: str | None = None


def _url(scheme: str, host: str, port: int) -> str:
    host = LOOPBACK.get(host, host)
    return f"{scheme}://[{host}]:{port}/" if ":" in host else f"{scheme}://{host}:{port}/"


def _from_target_file(path: Path) -> tuple[str, str] | None:
    """(scheme, host:port) of the first target of a file_sd JSON file, None if unreadable."""
    try:
        if not path.is_file():  # a FIFO or a directory would block or fail: regular files only
            return None
        with path.open("rb") as handle:
            groups = json.loads(handle.read(MAX_TARGET_FILE_BYTES))
        group = groups[0]
        return group.get("labels", {}).get("__scheme__", "http"), str(group["targets"][0])
    except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None


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
        urls, missing = {}, []
        for rank in range(world):
            found = _from_target_file(sd.resolved_path(rank, job_name))
            if found is None:
                missing.append(rank)
            else:
                urls[rank] = f"{found[0]}://{found[1]}/"
        note = (f"{len(missing)} of {world} ranks have no readable target file yet "
                f"({sd.path})" if missing else None)
        return Peers(urls, note)
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
            data = {"note": self._note, "refreshed": self._refreshed,
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
                    row = ({} if rank == self.own_rank else self._fetch(url, authorization))
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
        context = self.tls if base_url.startswith("https:") else None
        deadline = time.monotonic() + 2 * self.timeout  # a peer trickling bytes is cut off too
        try:
            with urllib.request.urlopen(request, timeout=self.timeout, context=context) as reply:
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
            return {"error": f"HTTP {exc.code} {exc.reason}"}
        except (OSError, ValueError) as exc:
            reason = getattr(exc, "reason", None) or exc
            return {"error": f"unreachable ({reason})"}

    @staticmethod
    def _row(summary: Any) -> dict[str, Any]:
        if not isinstance(summary, dict):
            return {"error": "not a summary"}
        return {key: summary.get(key) for key in ROW_KEYS}
