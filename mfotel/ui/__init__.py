"""The live page: a rank's run in a browser, served on its /metrics port (README, Live page).

    page = live_page(cfg, identity, "llama7b", instruments.state, telemetry.cert_file)
    telemetry.extra_routes.update(page.routes())   # before telemetry.serve()
    monitor.add_listener(HistoryRecorder(page.history))   # the callback: records, NaN marks

Loaded by the callback only when `prometheus.ui` is on and the endpoint is served.
"""
from __future__ import annotations

import ssl
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from ..config import MonitorConfig
from ..identity import RankIdentity
from ..instruments import TrainState
from ..node_link import node_dir, read_node_endpoint
from .app import LivePage
from .history import History, HistoryRecorder
from .overview import Overview, rank_addresses

__all__ = ["History", "HistoryRecorder", "LivePage", "Overview", "live_page", "rank_addresses"]


def _peer_tls(cert_file: str | None) -> ssl.SSLContext | None:
    """Trust for the other ranks' HTTPS pages: the system's CAs and this rank's own
    certificate (the usual case: one certificate in the job's shared web-config)."""
    if not cert_file:
        return None
    context = ssl.create_default_context()
    try:
        context.load_verify_locations(cafile=cert_file)
    except (OSError, ssl.SSLError):
        pass  # not a CA certificate: the system's CAs may still vouch for the ranks
    return context


#: Until mfotel-instrument's node.json is there, how often the page looks for it.
NODE_LOOK_SECONDS = 5.0


def stacks_link(job_name: str, rank: int, directory: Path | None
                ) -> Callable[[], dict[str, Any] | None]:
    """Where this rank's stack captures are served, for the page to link: the node endpoint of
    mfotel-instrument (its port and scheme from `node.json` in the node directory; the page
    takes its own host name). None without the launcher, or while its endpoint is not open
    (looked for again every NODE_LOOK_SECONDS)."""
    if directory is None:
        return lambda: None
    query = urlencode({"job_name": job_name, "rank": rank})
    found: dict[str, Any] | None = None
    next_look = 0.0

    def link() -> dict[str, Any] | None:
        nonlocal found, next_look
        if found is None and time.monotonic() >= next_look:
            next_look = time.monotonic() + NODE_LOOK_SECONDS
            node = read_node_endpoint(directory)
            if node is not None:
                found = {"port": node[0], "scheme": node[1], "path": "/stacks", "query": query}
        return found
    return link


def live_page(cfg: MonitorConfig, identity: RankIdentity, job_name: str, state: TrainState,
              cert_file: str | None = None) -> LivePage:
    """The page of this rank, with the overview of all ranks on `prometheus.ui_overview_rank`.

    `cert_file`: the endpoint's TLS certificate (None: plain HTTP), which the other ranks
    are expected to share."""
    prom = cfg.prometheus
    scheme = "https" if cert_file else "http"
    history = History(prom.ui_history_points)
    info = {"job_name": job_name, "rank": identity.rank, "world_size": identity.world_size,
            "local_rank": identity.local_rank, "node": identity.node,
            "metrics": list(cfg.metrics), "step_interval": cfg.step_interval,
            "overview_rank": prom.ui_overview_rank}
    overview_rank = prom.ui_overview_rank
    stacks = stacks_link(job_name, identity.rank, node_dir())

    def peers():  # read again at every refresh: per-rank target files appear as ranks start
        return rank_addresses(cfg, identity, job_name, scheme)
    if overview_rank is None:
        return LivePage(history, state, info, overview_note="no overview of the ranks: "
                        "monitor_config.prometheus.ui_overview_rank is null", stacks=stacks)
    if overview_rank >= identity.world_size:
        return LivePage(history, state, info, overview_note=f"no overview of the ranks: "
                        f"ui_overview_rank {overview_rank} is not a rank of this job of "
                        f"{identity.world_size}", stacks=stacks)
    if identity.rank == overview_rank:
        return LivePage(history, state, info, overview=Overview(peers, identity.rank,
                                                               _peer_tls(cert_file)),
                        stacks=stacks)
    return LivePage(history, state, info,
                    overview_note=f"the overview of all ranks is on rank {overview_rank}",
                    overview_url=peers().urls.get(overview_rank), stacks=stacks)

