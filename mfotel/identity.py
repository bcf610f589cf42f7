"""Who this process is in the job: rank, local rank, world size, node, device (pure).

    ident = identity_from_env()                      # launcher variables, before init()
    ident = ident.with_communication(rank=1, local_rank=1, world_size=2, local_world_size=2)
    port = rank_port(9464, ident)                    # 9465, or ConfigError on a collision
"""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import ConfigError, RunConfig
from .regular_file import read_regular_file

MAX_PORT = 65535
RANK_VARS = ("RANK_ID", "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
WORLD_VARS = ("RANK_SIZE", "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
LOCAL_RANK_VARS = ("LOCAL_RANK", "MS_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")
LOCAL_WORLD_VARS = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE",
                    "MPI_LOCALNRANKS")
NODE_RANK_VARS = ("NODE_RANK", "MS_NODE_RANK", "GROUP_RANK")
#: Kubernetes downward API (env: POD_NAME from metadata.name, POD_NAMESPACE from metadata.namespace)
POD_VARS = ("POD_NAME", "MY_POD_NAME")
NAMESPACE_VARS = ("POD_NAMESPACE", "MY_POD_NAMESPACE", "NAMESPACE")
#: Visible-device lists: the process's device i is the i-th listed physical device, which is
#: the index device exporters report (NPU-Exporter `id`, dcgm-exporter `gpu`).
VISIBLE_DEVICE_VARS = ("ASCEND_RT_VISIBLE_DEVICES", "ASCEND_VISIBLE_DEVICES",
                       "CUDA_VISIBLE_DEVICES")


@dataclass(frozen=True)
class RankIdentity:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    node: str = ""          # host name of the node
    device_id: str = ""     # accelerator index on the node (DEVICE_ID), "" when unknown
    local_world_size: int = 0  # ranks on this node; 0 = unknown
    node_rank: int = 0
    pod_name: str = ""      # Kubernetes pod, for joins with NPU-Exporter's pod_name
    namespace: str = ""
    local_rank_source: str = "default"  # where local_rank came from: init, env:NAME, default
    node_rank_from_env: bool = False    # NODE_RANK-style variable given (else derived)

    def labels(self) -> dict[str, str]:
        """Identity labels of `mindformers_train_rank_info` (joins with device exporters).

        `pod_name` and `namespace` are present only in Kubernetes (NPU-Exporter's join keys).
        """
        labels = {"local_rank": str(self.local_rank), "node": self.node,
                  "device_id": self.device_id, "host": self.node,
                  "world_size": str(self.world_size)}
        if self.pod_name:
            labels["pod_name"] = self.pod_name
        if self.namespace:
            labels["namespace"] = self.namespace
        return labels

    def resource_attributes(self) -> dict[str, str]:
        """Extra OTel resource attributes (exposed on `target_info`)."""
        attributes = {"mfotel.node_rank": str(self.node_rank)}
        if self.local_world_size:
            attributes["mfotel.local_world_size"] = str(self.local_world_size)
        if self.pod_name:
            attributes["k8s.pod.name"] = self.pod_name
        if self.namespace:
            attributes["k8s.namespace.name"] = self.namespace
        return attributes

    def with_communication(self, rank: int, local_rank: int, world_size: int,
                           local_world_size: int = 0) -> RankIdentity:
        """The identity as MindSpore's communication layer reports it after `init()`."""
        local_world = local_world_size or self.local_world_size
        node_rank = self.node_rank
        if not self.node_rank_from_env and local_world:
            node_rank = rank // local_world  # msrun numbers ranks node by node
        return dataclasses.replace(self, rank=rank, local_rank=local_rank,
                                   world_size=max(world_size, 1), local_world_size=local_world,
                                   node_rank=node_rank, local_rank_source="init")


#: Ranks of one job: far above any real job, and a bound on what a variable may claim.
MAX_WORLD_SIZE = 1_000_000
#: Ranks on one node: each serves its own port (base + local rank), so at most 65535.
MAX_LOCAL_RANKS = MAX_PORT
ENV_SOURCE = "the launcher's environment"


def _env_int(env: Mapping[str, str], names: tuple[str, ...], low: int, high: int,
             what: str) -> tuple[int | None, str | None]:
    """(value, variable) of the first of `names` that is set, (None, None) if none is.

    ConfigError naming the variable for anything but ASCII digits in low..high (a "-1", a
    23-digit number, an Arabic-Indic "٣" that int() would read as 3).
    """
    for name in names:
        text = env.get(name, "").strip()
        if not text:
            continue
        digits = text.isascii() and text.isdigit()
        if digits and len(text) <= len(str(high)) and low <= int(text) <= high:
            return int(text), name
        shown = repr(text[:24]) + ("..." if len(text) > 24 else "")
        raise ConfigError(ENV_SOURCE, name, f"{name}={shown} is not a valid {what} (ASCII digits, "
                          f"{low} to {high})", f"set {name} to this process's {what} as the "
                          f"launcher does (msrun, torchrun and mpirun set it), or unset it")
    return None, None


def _first_str(env: Mapping[str, str], names: tuple[str, ...]) -> str:
    return next((env[n].strip() for n in names if env.get(n, "").strip()), "")


def physical_device(device: str, env: Mapping[str, str]) -> str:
    """The physical index of logical device `device` under a visible-devices list."""
    visible = _first_str(env, VISIBLE_DEVICE_VARS)
    items = [v.strip() for v in visible.split(",")] if visible else []
    index = items[int(device)] if device.isdigit() and int(device) < len(items) else ""
    if index.isascii() and index.isdigit():  # "GPU-<uuid>" entries are not indexes
        return index
    return device


def identity_from_env(env: Mapping[str, str] | None = None) -> RankIdentity:
    """Identity from launcher variables (msrun / mpirun / torchrun style names).

    msrun sets RANK_ID, RANK_SIZE and DEVICE_ID (the local device index, which is the local
    rank on CPU); the true local rank is known only after `init()` (with_communication).
    ConfigError naming the variable for a value that is not a bounded whole number, or a rank
    not below the world size given beside it.
    """
    env = os.environ if env is None else env
    rank, rank_var = _env_int(env, RANK_VARS, 0, MAX_WORLD_SIZE - 1, "rank")
    world, world_var = _env_int(env, WORLD_VARS, 1, MAX_WORLD_SIZE, "world size")
    local, local_var = _env_int(env, LOCAL_RANK_VARS, 0, MAX_LOCAL_RANKS - 1, "local rank")
    local_world, local_world_var = _env_int(env, LOCAL_WORLD_VARS, 1, MAX_LOCAL_RANKS,
                                            "number of ranks on this node")
    device_id, _ = _env_int(env, ("DEVICE_ID",), 0, MAX_LOCAL_RANKS - 1, "device index")
    node_rank, node_var = _env_int(env, NODE_RANK_VARS, 0, MAX_WORLD_SIZE - 1, "node rank")
    _below(rank, rank_var, world, world_var, "ranks count from 0 to the world size - 1")
    _below(local, local_var, local_world, local_world_var,
           "local ranks count from 0 to the ranks on the node - 1")
    _below(node_rank, node_var, world, world_var, "a job has fewer nodes than ranks")
    rank, world, local_world = rank or 0, world or 1, local_world or 0
    source = f"env:{local_var}" if local_var else "default"
    if local is None:
        if device_id is not None:
            local, source = device_id, "env:DEVICE_ID"
        elif local_world:
            local, source = rank % local_world, "env:rank%local_world_size"
        else:
            local = 0
    if node_var is None:
        node_rank = rank // local_world if local_world else 0
    device = "" if device_id is None else str(device_id)
    return RankIdentity(rank=rank, local_rank=local, world_size=world,
                        node=socket.gethostname(), device_id=physical_device(device, env),
                        local_world_size=local_world, node_rank=node_rank or 0,
                        pod_name=_first_str(env, POD_VARS),
                        namespace=_first_str(env, NAMESPACE_VARS), local_rank_source=source,
                        node_rank_from_env=node_var is not None)


def _below(value: int | None, name: str | None, bound: int | None, bound_name: str | None,
           rule: str) -> None:
    if value is not None and bound is not None and value >= bound:
        raise ConfigError(ENV_SOURCE, name, f"{name}={value} is not below {bound_name}={bound} "
                          f"({rule})", f"correct {name} or {bound_name}: the launcher sets both "
                          f"(a job started by hand must set them consistently)")


def rank_port(base: int, identity: RankIdentity, source: str = "<kwargs>",
              key: str = "monitor_config.prometheus.port") -> int:
    """This rank's /metrics port: `base + local rank` (0 when `base` is 0 = endpoint off).

    Raises ConfigError, before anything binds, when the ranks of one node cannot all get
    distinct valid ports: the node's port range runs past 65535, or the local rank is not
    below the node's rank count (two ranks would compute the same port).
    """
    if not base:
        return 0
    local, local_world = identity.local_rank, identity.local_world_size
    who = f"rank {identity.rank} (local rank {local}"
    who += f" of {local_world} on this node)" if local_world else ")"
    if local < 0 or (local_world and local >= local_world):
        raise ConfigError(source, key, f"{who}: the local rank is outside the node's ranks, so "
                          f"two ranks on this node would serve the same port",
                          "launch with msrun/torchrun (they set the local rank) or set "
                          "LOCAL_RANK correctly; or set prometheus.port: 0")
    ranks = max(local_world, local + 1)
    last = base + ranks - 1
    if last > MAX_PORT:
        highest = MAX_PORT - ranks + 1
        variable = identity.local_rank_source.removeprefix("env:")
        fix = f"use a base port of at most {highest}" if highest >= 1024 else (
            f"{ranks} ranks on one node cannot each serve a port: check the local rank "
            f"{local} (from {variable}) and the ranks on the node, or set prometheus.port: 0")
        raise ConfigError(source, key, f"{who}: the node's ports {base}..{last} (port + local "
                          f"rank) run past {MAX_PORT}", fix)
    return base + local


# ---------------------------------------------------------------- run identity across restarts
RUN_ID_VARS = ("MFOTEL_RUN_ID", "TORCHELASTIC_RUN_ID")


@dataclass(frozen=True)
class RunIdentity:
    """The training run this process belongs to, and which attempt at it (1 = first start).

    `configured` runs (an id or a state file given) put `run_id` and `attempt` on
    `mindformers_train_rank_info`; every run puts them on `target_info`.
    """
    run_id: str
    attempt: int = 1
    configured: bool = False

    @property
    def restarts(self) -> int:
        return self.attempt - 1

    def labels(self) -> dict[str, str]:
        return {"run_id": self.run_id, "attempt": str(self.attempt)} if self.configured else {}

    def resource_attributes(self) -> dict[str, str]:
        return {"mfotel.run_id": self.run_id, "mfotel.attempt": str(self.attempt)}


STATE_MAX_BYTES = 64 * 1024


def _read_state(path: Path) -> dict[str, Any]:
    """The run-state file's object; {} when missing or unusable (a FIFO there never blocks)."""
    try:
        data = json.loads(read_regular_file(str(path), STATE_MAX_BYTES).decode("utf-8"))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError, RecursionError):
        return {}


def _write_state(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data), encoding="utf-8")
    os.replace(tmp, path)


def run_state_path(run: RunConfig, rank: int, job_name: str) -> Path | None:
    if not run.state_file:
        return None
    return Path(run.state_file.format(rank=rank, job_name=job_name)).expanduser().absolute()


def start_run(run: RunConfig, rank: int, job_name: str, source: str = "<kwargs>",
              env: Mapping[str, str] | None = None) -> RunIdentity:
    """Resolve the run id and count this attempt (in the state file, when one is configured).

    The id is `run.id`, else $MFOTEL_RUN_ID / $TORCHELASTIC_RUN_ID, else the state file's (an
    unfinished previous attempt: this is a restart), else new. Give the id explicitly in
    multi-rank jobs, so that every rank reports the same one.
    """
    env = os.environ if env is None else env
    explicit = run.id or _first_str(env, RUN_ID_VARS)
    path = run_state_path(run, rank, job_name)
    previous = _read_state(path) if path is not None else {}
    unfinished = bool(previous) and previous.get("status") != "completed"
    same_run = unfinished and (not explicit or previous.get("run_id") == explicit)
    run_id = explicit or (previous.get("run_id") if same_run else None) or uuid.uuid4().hex[:12]
    attempt = int(previous.get("attempt", 0)) + 1 if same_run else 1
    identity = RunIdentity(run_id=str(run_id), attempt=attempt, configured=bool(explicit or path))
    if path is not None:
        try:
            _write_state(path, {"run_id": identity.run_id, "attempt": attempt,
                                "status": "running", "pid": os.getpid()})
        except OSError as exc:
            raise ConfigError(source, "monitor_config.run.state_file",
                              f"cannot write {path} ({exc.strerror or exc})",
                              "choose a writable state_file path") from None
    return identity


def finish_run(run: RunConfig, rank: int, job_name: str, identity: RunIdentity,
               step: int | None, completed: bool) -> None:
    """Record the end of this attempt; a completed run's next start is a new run."""
    path = run_state_path(run, rank, job_name)
    if path is None:
        return
    try:
        _write_state(path, {"run_id": identity.run_id, "attempt": identity.attempt,
                            "status": "completed" if completed else "failed", "step": step,
                            "pid": os.getpid()})
    except OSError:
        pass  # the end of a run must not raise; the next start counts it as a restart
