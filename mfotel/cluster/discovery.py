"""Where the ranks serve /metrics: Prometheus file_sd target files and `mfotel targets`.

A job's ranks serve `host:port + local rank`. Prometheus finds them through a file_sd file:

    [{"targets": ["node-1:9464", "node-1:9465"], "labels": {"cluster": "a"}}]

    groups = target_groups(["node-1", "node-2"], ranks_per_node=8, base_port=9464)
    write_target_file("targets/llama.json", groups)    # atomic: Prometheus never reads half

From the command line (the launcher knows the host list):

    mfotel targets --hosts node-1,node-2 --ranks-per-node 8 --port 9464 --out targets/llama.json
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from ..config import ConfigError, MonitorConfig
from ..config.redact import redact_named
from ..endpoint.exposition import NOT_A_SCRAPE
from ..identity import RankIdentity
from ..subcommand import Subcommand

WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")
_HOSTFILE_LINE = re.compile(r"(?P<host>[A-Za-z0-9_.-]+|\[[0-9A-Fa-f:.]+\])(?::(?P<colon>\d+))?"
                            r"(?:\s+slots\s*=\s*(?P<slots>\d+))?")


# ---------------------------------------------------------------- target lists (pure)
def host_port(host: str, port: int) -> str:
    """`host:port`, with IPv6 addresses bracketed."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def rank_targets(hosts: Sequence[str] | Mapping[str, int], ranks_per_node: int,
                 base_port: int) -> list[str]:
    """`host:port` of every rank: hosts in node order, ports base .. base + ranks - 1.

    `hosts` may map a host to its own rank count (an MPI hostfile's `slots`).
    """
    counts = hosts if isinstance(hosts, Mapping) else dict.fromkeys(hosts, ranks_per_node)
    if len(counts) != len(hosts):
        raise ValueError("a host is listed twice; each node appears once")
    targets = []
    for host, count in counts.items():
        if count < 1 or base_port + count - 1 > 65535:
            raise ValueError(f"{host}: {count} ranks from port {base_port} do not fit in 1..65535")
        targets += [host_port(host, base_port + local) for local in range(count)]
    return targets


def target_groups(hosts: Sequence[str] | Mapping[str, int], ranks_per_node: int,
                  base_port: int, labels: Mapping[str, str] | None = None,
                  scheme: str = "http") -> list[dict[str, Any]]:
    """file_sd content: one group per node, so a node's targets can be told apart by `node`.

    `scheme: https` becomes the `__scheme__` target label (TLS endpoints).
    """
    names = list(hosts)
    extra = dict(labels or {})
    if scheme != "http":
        extra["__scheme__"] = scheme
    groups = []
    for host in names:
        count = hosts[host] if isinstance(hosts, Mapping) else ranks_per_node
        groups.append({"targets": rank_targets({host: count}, ranks_per_node, base_port),
                       "labels": dict(extra)})
    return groups


def parse_hostfile(text: str, default_slots: int) -> dict[str, int]:
    """Hosts of an MPI-style hostfile (`node-1 slots=8`, `node-1:8` or `node-1`), in order."""
    hosts: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _HOSTFILE_LINE.fullmatch(line)
        if match is None:
            raise ValueError(f"hostfile line {number}: cannot read {raw!r}; write `host` or "
                             f"`host slots=N`")
        host = match["host"].strip("[]")
        if host in hosts:
            raise ValueError(f"hostfile line {number}: {host} is listed twice")
        hosts[host] = int(match["slots"] or match["colon"] or default_slots)
    if not hosts:
        raise ValueError("the hostfile lists no host")
    return hosts


def dump_targets(groups: list[dict[str, Any]], path: str | Path | None = None) -> str:
    """JSON text, or YAML when `path` ends in .yml / .yaml (both are file_sd formats).

    Values of secret-named labels (password, token, ...) are written as *** (every series of
    the targets would carry them into Prometheus): mfotel.config.redact.
    """
    groups = [{**group, "labels": redact_named(group["labels"])} if "labels" in group else group
              for group in groups]
    if path is not None and str(path).endswith((".yml", ".yaml")):
        return yaml.safe_dump(groups, sort_keys=False)
    return json.dumps(groups, indent=2) + "\n"


def write_target_file(path: str | Path, groups: list[dict[str, Any]]) -> Path:
    """Write `groups` atomically (a temporary file renamed over `path`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(dump_targets(groups, path))
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


# ---------------------------------------------------------------- the job's own file
def advertised_host(cfg: MonitorConfig, identity: RankIdentity) -> str:
    """The address Prometheus should use for this rank."""
    hosts = cfg.file_sd.hosts
    if hosts and identity.node_rank < len(hosts):
        return hosts[identity.node_rank]
    host = cfg.prometheus.host
    return identity.node if host in WILDCARD_HOSTS else host


def _scheme(cfg: MonitorConfig) -> str:
    """https when the endpoint serves TLS: from certfile or from a web-config file."""
    prom = cfg.prometheus
    if prom.certfile:
        return "https"
    if prom.web_config_file:
        from ..endpoint.webconfig import load_web_config
        return "https" if load_web_config(prom.web_config_file).tls is not None else "http"
    return "http"


class FileSdWriter:
    """Writes the job's file_sd target file at train begin; removes it after a normal end.

    mode job: rank 0 writes every rank (hosts from `file_sd.hosts`, else this node only).
    mode rank: every rank writes its own file (a `{rank}` path in a shared directory).
    After a failure the file stays, so Prometheus keeps showing the dead targets as `up == 0`.
    """

    def __init__(self, cfg: MonitorConfig, identity: RankIdentity, job_name: str,
                 scheme: str | None = None) -> None:
        self.cfg, self.identity, self.job_name = cfg, identity, job_name
        self.scheme = scheme  # http / https of the endpoint; None: from the config
        self.path = cfg.file_sd.resolved_path(identity.rank, job_name)
        self.written: Path | None = None

    def groups(self) -> list[dict[str, Any]]:
        """The target groups this rank is responsible for ([] = writes nothing)."""
        sd, ident, base = self.cfg.file_sd, self.identity, self.cfg.prometheus.port
        labels, scheme = dict(sd.labels), self.scheme or _scheme(self.cfg)
        if not base:
            return []
        if sd.mode == "rank":
            return [{"targets": [host_port(advertised_host(self.cfg, ident),
                                           base + ident.local_rank)],
                     "labels": {**labels, **({"__scheme__": scheme} if scheme != "http" else {})}}]
        if ident.rank != 0:
            return []
        per_node = ident.local_world_size or ident.world_size
        hosts = list(sd.hosts) or [advertised_host(self.cfg, ident)]
        nodes = -(-ident.world_size // per_node)
        if not sd.hosts and nodes > 1:
            raise ConfigError(self.cfg.source, "monitor_config.file_sd.hosts",
                              f"the job runs {ident.world_size} ranks on {nodes} nodes, but rank 0 "
                              f"knows only its own node's address",
                              "list the nodes in node-rank order (file_sd.hosts: [node-1, "
                              "node-2]), or use mode: rank with {rank} in a path on a shared "
                              "file system")
        if len(hosts) * per_node < ident.world_size:
            raise ConfigError(self.cfg.source, "monitor_config.file_sd.hosts",
                              f"{len(hosts)} hosts x {per_node} ranks per node is fewer than the "
                              f"{ident.world_size} ranks of the job", "list every node once")
        return target_groups(hosts, per_node, base, labels, scheme)

    def write(self) -> Path | None:
        """Write the file (if this rank writes one); the path written, or None."""
        if self.path is None:
            return None
        groups = self.groups()
        if not groups:
            return None
        self.written = write_target_file(self.path, groups)
        return self.written

    def remove(self) -> None:
        if self.written is not None:
            self.written.unlink(missing_ok=True)
            self.written = None


# ---------------------------------------------------------------- who holds a port
def probe_owner(host: str, port: int, timeout: float = 2.0) -> dict[str, str] | None:
    """`{job_name, rank, local_rank, status}` of the mfotel rank serving host:port, else None."""
    address = "127.0.0.1" if host in WILDCARD_HOSTS else host
    try:
        request = urllib.request.Request(f"http://{host_port(address, port)}/metrics",
                                         headers={NOT_A_SCRAPE: "1"})  # never ends a linger
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = response.read().decode("utf-8", "replace")
        owner: dict[str, str] = {}
        for family in text_string_to_metric_families(body):
            for sample in family.samples:
                if sample.name == "mindformers_train_rank_info":
                    owner.update({k: sample.labels.get(k, "")
                                  for k in ("job_name", "rank", "local_rank")})
                elif sample.name == "mindformers_train_status":
                    owner["status"] = str(int(sample.value))
    except Exception:  # noqa: BLE001 - not ours, TLS, or garbage: nothing to explain
        return None
    return owner if "rank" in owner else None


def check_port_collision(cfg: MonitorConfig, identity: RankIdentity, job_name: str,
                         port: int) -> None:
    """Raise ConfigError when `port` is held by another running rank of this job.

    Called after binding failed. A port held by something else (another program, a finished
    run lingering) is not a rank collision: the caller has already warned about it.
    """
    owner = probe_owner(cfg.prometheus.host, port)
    if owner is None or owner.get("job_name") != job_name or \
            owner.get("rank") == str(identity.rank):
        return
    if owner.get("status") not in (None, "0", "1"):
        return  # a previous run of the job, completed or failed, still lingering
    if identity.local_rank_source == "init":
        fix = ("each job on a node needs its own port range: give this job another "
               "monitor_config.prometheus.port (it uses port .. port + ranks per node - 1)")
    else:
        fix = (f"the local rank came from {identity.local_rank_source} before init(); call "
               f"mindspore.communication.init() before training, or set LOCAL_RANK per rank")
    raise ConfigError(cfg.source, "monitor_config.prometheus.port",
                      f"rank {identity.rank} (local rank {identity.local_rank}) and rank "
                      f"{owner['rank']} (local rank {owner.get('local_rank', '?')}) of job "
                      f"{job_name} both want port {port} on this node", fix)


# ---------------------------------------------------------------- `mfotel targets`
def _labels(items: Iterable[str]) -> dict[str, str]:
    labels = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", key):
            raise ValueError(f"--label {item!r}: expected NAME=VALUE")
        if key in ("job_name", "rank", "job", "instance"):
            raise ValueError(f"--label {key}: every series already carries job_name and rank, "
                             f"and Prometheus sets job and instance; choose another name")
        labels[key] = value
    return labels


def run_targets_command(args: argparse.Namespace) -> int:
    try:
        if args.hostfile:
            hosts: Sequence[str] | Mapping[str, int] = parse_hostfile(
                Path(args.hostfile).read_text(), args.ranks_per_node)
        else:
            hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
            if len(set(hosts)) != len(hosts):
                raise ValueError("--hosts lists a host twice")
        groups = target_groups(hosts, args.ranks_per_node, args.port, _labels(args.label),
                               args.scheme)
    except (OSError, ValueError) as error:
        print(f"mfotel targets: {error}", file=sys.stderr)
        return 2
    if args.out:
        print(f"wrote {write_target_file(args.out, groups)} "
              f"({sum(len(g['targets']) for g in groups)} targets)", file=sys.stderr)
    else:
        sys.stdout.write(dump_targets(groups))
    return 0


def add_targets_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--hosts", help="node addresses in node-rank order, comma-separated")
    where.add_argument("--hostfile", help="MPI-style hostfile: `host` or `host slots=N` per line")
    parser.add_argument("--ranks-per-node", type=int, default=8,
                        help="ranks per node (hostfile slots override it; default %(default)s)")
    parser.add_argument("--port", type=int, default=9464,
                        help="monitor_config.prometheus.port (default %(default)s)")
    parser.add_argument("--label", action="append", default=[], metavar="NAME=VALUE",
                        help="extra target label, e.g. cluster=a (repeatable)")
    parser.add_argument("--scheme", choices=("http", "https"), default="http")
    parser.add_argument("--out", help="write this file atomically (.json, or .yml for YAML); "
                                      "default: print JSON")
    return parser


COMMAND = Subcommand("targets", "write a Prometheus file_sd file for a job",
                     "python -m mfotel.cluster.discovery", add_targets_arguments,
                     run_targets_command, __doc__)
add_targets_command = COMMAND.register
main = COMMAND.main


if __name__ == "__main__":
    sys.exit(main())
