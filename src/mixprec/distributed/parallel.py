"""Parallel dimensions, the device mesh and process-group setup under torchrun."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mixprec.errors import UserError

logger = logging.getLogger(__name__)


def init_distributed(device: torch.device) -> tuple[int, int]:
    """(rank, world size). Under torchrun (WORLD_SIZE > 1) this joins the process group:
    nccl on CUDA, gloo on CPU. A single process needs no group."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    world_size: int

    @classmethod
    def resolve(cls, replicate: int, shard: int, tp: int, world_size: int) -> "ParallelDims":
        """Degrees from the [parallelism] table; shard -1 takes what the others leave."""
        if tp != 1:
            raise UserError(f"parallelism.tensor_parallel_degree {tp}: tensor parallelism is not available yet; "
                            "accepted: 1")
        if shard == -1:
            if world_size % replicate:
                raise UserError(f"parallelism.data_parallel_replicate_degree {replicate} does not divide the "
                                f"world size {world_size}")
            shard = world_size // replicate
        if replicate * shard != world_size:
            raise UserError(
                f"parallelism: data_parallel_replicate_degree {replicate} x data_parallel_shard_degree {shard} = "
                f"{replicate * shard}, but torchrun started {world_size} processes; accepted: degrees whose "
                f"product is {world_size} (data_parallel_shard_degree -1 takes the rest)")
        return cls(replicate, shard, world_size)

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def ddp_enabled(self) -> bool:
        return self.dp_replicate > 1 and not self.fsdp_enabled

    @property
    def dp_degree(self) -> int:
        return self.dp_replicate * self.dp_shard

    def mesh(self, device_type: str):
        from torch.distributed.device_mesh import init_device_mesh

        if self.dp_replicate > 1 and self.dp_shard > 1:  # HSDP: replicate across groups, shard within
            return init_device_mesh(device_type, (self.dp_replicate, self.dp_shard),
                                    mesh_dim_names=("dp_replicate", "dp_shard"))
        return init_device_mesh(device_type, (self.world_size,), mesh_dim_names=("dp",))
