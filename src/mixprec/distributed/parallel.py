"""Parallel dimensions, the device mesh and process-group setup under torchrun."""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mixprec.distributed.elastic import init_group
from mixprec.errors import UserError

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    """training.device as a device. Under torchrun every rank takes cuda:LOCAL_RANK, and a
    node needs a GPU per process (checked before any work)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if not name.startswith("cuda"):
        return torch.device(name)
    if not torch.cuda.is_available():
        raise UserError(f"training.device {name!r}: no CUDA device here; accepted: cpu, auto")
    count, local_world = torch.cuda.device_count(), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if local_world > 1:
        if name != "cuda":
            raise UserError(f"training.device {name!r} under torchrun: each rank takes cuda:LOCAL_RANK; "
                            "accepted: cuda, auto, cpu")
        if local_world > count:
            raise UserError(f"torchrun started {local_world} processes on this node, which has {count} CUDA "
                            f"device(s): one GPU per process; accepted: --nproc-per-node {count} or fewer, or "
                            "training.device cpu (gloo)")
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    else:
        device = torch.device(name if name != "cuda" else f"cuda:{torch.cuda.current_device()}")
        if device.index >= count:
            raise UserError(f"training.device {name!r}: this machine has {count} CUDA device(s); accepted: "
                            f"cuda:0 to cuda:{count - 1}")
    torch.cuda.set_device(device)  # NCCL and the caching allocator follow the current device
    return device


def init_distributed(device: torch.device, timeout_s: float = 300.0) -> tuple[int, int]:
    """(rank, world size). Under torchrun (WORLD_SIZE > 1) this joins this attempt's process
    group (mixprec.distributed.elastic): nccl on CUDA, gloo on CPU. A single process needs no group."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    if not dist.is_initialized():
        init_group("nccl" if device.type == "cuda" else "gloo", timeout_s)
    return dist.get_rank(), dist.get_world_size()


def end_spawned_worker() -> None:
    """The last call of a torch.multiprocessing.spawn worker."""
    exit_process_group(0)


def exit_process_group(code: int) -> None:
    """Leave the process group and exit with `code`, without interpreter finalization. gloo's
    threads can still hold finished work objects whose release needs the GIL of a dying
    interpreter, which aborts the process (a rare SIGABRT, "terminate called without an
    active exception"). After a normal end (code 0) every rank waits for the others first, so
    no rank tears gloo down while a peer is still inside a collective; after an error the
    ranks may not all get here, so nobody waits."""
    if code == 0:
        dist.barrier()
    dist.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int
    ep: int = 1  # expert parallelism: ranks of an expert-parallel group, taken from dp_shard's (TorchTitan's)

    @classmethod
    def resolve(cls, replicate: int, shard: int, tp: int, world_size: int, ep: int = 1) -> "ParallelDims":
        """Degrees from the [parallelism] table; shard -1 takes what the others leave."""
        if tp < 1 or world_size % tp:
            raise UserError(f"parallelism.tensor_parallel_degree {tp} does not divide the world size {world_size}; "
                            f"accepted: a divisor of {world_size}")
        if shard == -1:
            if world_size % (replicate * tp):
                raise UserError(f"parallelism.data_parallel_replicate_degree {replicate} x tensor_parallel_degree "
                                f"{tp} does not divide the world size {world_size}")
            shard = world_size // (replicate * tp)
        if replicate * shard * tp != world_size:
            raise UserError(
                f"parallelism: data_parallel_replicate_degree {replicate} x data_parallel_shard_degree {shard} x "
                f"tensor_parallel_degree {tp} = {replicate * shard * tp}, but torchrun started {world_size} "
                f"processes; accepted: degrees whose product is {world_size} (data_parallel_shard_degree -1 takes "
                "the rest)")
        if tp > 1 and replicate > 1 and shard == 1:
            raise UserError("parallelism: DDP (data_parallel_replicate_degree > 1 with data_parallel_shard_degree "
                            "1) does not combine with tensor parallelism; accepted: data_parallel_shard_degree > 1 "
                            "(FSDP or HSDP) with tensor_parallel_degree > 1")
        if ep > 1 and (replicate > 1 or tp > 1 or shard % ep):
            raise UserError(f"parallelism.expert_parallel_degree {ep} with data_parallel_replicate_degree {replicate}, "
                            f"data_parallel_shard_degree {shard}, tensor_parallel_degree {tp}: expert parallelism takes "
                            "its ranks from FSDP2's; accepted: an expert_parallel_degree that divides "
                            "data_parallel_shard_degree, with replicate and tensor-parallel degrees 1")
        return cls(replicate, shard, tp, world_size, ep)

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def ddp_enabled(self) -> bool:
        return self.dp_replicate > 1 and not self.fsdp_enabled

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def sharded(self) -> bool:
        """Whether ranks hold different parts of the state (FSDP2, tensor parallel); under DDP
        every rank holds all of it, as one process does."""
        return self.fsdp_enabled or self.tp_enabled

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def dp_degree(self) -> int:
        return self.dp_replicate * self.dp_shard

    def dp_rank(self, rank: int) -> int:
        """Which share of the global batch `rank` takes: tensor-parallel peers share one."""
        return rank // self.tp  # the mesh is row-major with tp innermost

    def mesh(self, device_type: str):
        """The world mesh, dims named dp_replicate/dp_shard (HSDP) or dp, then tp. Slice
        it with mesh["dp"] (or ["dp_replicate", "dp_shard"]) and mesh["tp"]. With expert
        parallelism: dims dp_mod_ep (the ranks that shard an expert's weights) and ep (an
        expert-parallel group: consecutive ranks), flattened into dp for everything else."""
        from torch.distributed.device_mesh import init_device_mesh

        if self.ep_enabled:
            mesh = init_device_mesh(device_type, (self.dp_shard // self.ep, self.ep),
                                    mesh_dim_names=("dp_mod_ep", "ep"))
            mesh["dp_mod_ep", "ep"]._flatten("dp")  # TorchTitan's way to a flattened dim (dp_mesh)
            return mesh
        if self.dp_replicate > 1 and self.dp_shard > 1:  # HSDP: replicate across groups, shard within
            shape, names = (self.dp_replicate, self.dp_shard), ("dp_replicate", "dp_shard")
        else:
            shape, names = (self.dp_degree,), ("dp",)
        return init_device_mesh(device_type, (*shape, self.tp), mesh_dim_names=(*names, "tp"))

    @staticmethod
    def dp_mesh(mesh):
        names = mesh.mesh_dim_names
        if "ep" in names:  # the flattened dim, kept by the root mesh (slicing it by name is deprecated)
            return mesh["dp_mod_ep", "ep"]._flatten("dp")
        return mesh[names[:-1]] if len(names) > 2 else mesh[names[0]]
