"""A tensor as this rank holds it: a DTensor's local shard (of any mesh: FSDP2's, expert parallelism's), any
other tensor itself. What the optimizer steps, the stability guard checks and the audit reads; and back: a
rank's tensor placed as a parameter's shard (the optimizer's states of a sharded parameter)."""

from __future__ import annotations

import torch


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (a reduction of a DTensor sharded over an expert-parallel mesh to a bool
    has no sharding rule: its local shard has), or t itself."""
    return t.to_local() if hasattr(t, "device_mesh") else t


def shaped_as(p: torch.Tensor, local: torch.Tensor, shape) -> torch.Tensor:
    """`local` as p's shard of a tensor of global `shape` (a DTensor placed as p where p is one), else itself."""
    if not hasattr(p, "device_mesh"):
        return local
    from torch.distributed.tensor import DTensor

    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=torch.Size(shape),
                              stride=stride)
