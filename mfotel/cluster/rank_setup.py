"""Multi-rank setup at train begin: explain a port another rank holds, write file_sd targets.

The callback imports this only when it is needed (its port was taken, or `file_sd.path` is
set), so a single-rank run never loads mfotel.cluster:

    file_sd = set_up_rank(cfg, identity, "llama", port=9465, served=False, scheme="http")

Raises ConfigError before the first step when the setup cannot work (two ranks of the job
want one port; the target file cannot be written).
"""
from __future__ import annotations

import logging

from ..config import ConfigError, MonitorConfig
from ..identity import RankIdentity
from .discovery import FileSdWriter, check_port_collision

log = logging.getLogger("mfotel")


def set_up_rank(cfg: MonitorConfig, identity: RankIdentity, job_name: str, port: int,
                served: bool, scheme: str) -> FileSdWriter | None:
    """Explain a taken `port` (not `served`) held by another rank of the job; write the job's
    file_sd file when configured. Returns the writer (it removes the file after a normal end)."""
    if port and not served:
        check_port_collision(cfg, identity, job_name, port)
    if not cfg.file_sd.path:
        return None
    file_sd = FileSdWriter(cfg, identity, job_name, scheme)
    try:
        written = file_sd.write()
    except OSError as exc:
        raise ConfigError(cfg.source, "monitor_config.file_sd.path",
                          f"cannot write {file_sd.path} ({exc.strerror or exc})",
                          "choose a writable path (a directory Prometheus reads)") from None
    if written is not None:
        log.info("mfotel: rank %d wrote Prometheus file_sd targets to %s", identity.rank, written)
    return file_sd
