"""Who this process is in the job: rank, local rank, world size, node, device (pure)."""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True)
class RankIdentity:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    node: str = ""        # host name of the node
    device_id: str = ""   # accelerator index on the node (DEVICE_ID), "" on CPU

    def labels(self) -> dict[str, str]:
        """Identity labels of `mindformers_train_rank_info` (joins with device exporters)."""
        return {"local_rank": str(self.local_rank), "node": self.node,
                "device_id": self.device_id, "host": self.node,
                "world_size": str(self.world_size)}


def _first_int(env: Mapping[str, str], names: tuple[str, ...], default: int) -> int:
    for name in names:
        value = env.get(name, "").strip()
        if value.lstrip("-").isdigit():
            return int(value)
    return default


def identity_from_env(env: Mapping[str, str] | None = None) -> RankIdentity:
    """Identity from launcher variables (msrun / mpirun / torchrun style names)."""
    env = os.environ if env is None else env
    rank = _first_int(env, ("RANK_ID", "RANK", "OMPI_COMM_WORLD_RANK"), 0)
    world = _first_int(env, ("RANK_SIZE", "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE"), 1)
    local = _first_int(env, ("LOCAL_RANK", "MS_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"), -1)
    device = env.get("DEVICE_ID", "")
    if local < 0:
        local = int(device) if device.isdigit() else 0
    return RankIdentity(rank=rank, local_rank=local, world_size=max(world, 1),
                        node=socket.gethostname(), device_id=device)
