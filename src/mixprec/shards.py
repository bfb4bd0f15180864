"""A tensor as this rank holds it: a DTensor's local shard (of any mesh: FSDP2's, expert parallelism's), any
other tensor itself. What the optimizer steps, the stability guard checks and the audit reads."""

from __future__ import annotations

import torch


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (a reduction of a DTensor sharded over an expert-parallel mesh to a bool
    has no sharding rule: its local shard has), or t itself."""
    return t.to_local() if hasattr(t, "device_mesh") else t
