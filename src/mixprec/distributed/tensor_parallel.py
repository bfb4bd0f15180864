"""Tensor parallelism with DTensor's `parallelize_module` (Megatron's layout).

In each transformer block the projections into attention heads and into the MLP's
hidden width are split column-wise (each rank computes some heads / some hidden units)
and the projections back to the model width row-wise (each rank holds the matching
input slice; the partial products are all-reduced). Embeddings, norms and the output
layer stay replicated. Activations between blocks are replicated, so the forward needs
two all-reduces per block and the backward two more.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from mixprec.errors import UserError
from mixprec.models.llama import ModelArgs

PLAN = {
    "attention.wq": ColwiseParallel(),
    "attention.wk": ColwiseParallel(),
    "attention.wv": ColwiseParallel(),
    "attention.wo": RowwiseParallel(),
    "feed_forward.w1": ColwiseParallel(),
    "feed_forward.w3": ColwiseParallel(),
    "feed_forward.w2": RowwiseParallel(),
}


def check_tensor_parallel(args: ModelArgs, degree: int) -> None:
    """Each rank must get whole heads and an equal share of the MLP width."""
    for what, size in (("n_heads", args.n_heads), ("n_kv_heads", args.n_kv_heads), ("ffn width", args.ffn_dim)):
        if size % degree:
            raise UserError(f"parallelism.tensor_parallel_degree {degree} does not divide the model's {what} "
                            f"{size}; accepted: a divisor of n_heads {args.n_heads}, n_kv_heads {args.n_kv_heads} "
                            f"and ffn width {args.ffn_dim}")


def apply_tensor_parallel(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Shard every block's attention and MLP projections over the 1-D `mesh`, in place."""
    for block in model.layers:
        parallelize_module(block, mesh, PLAN)
    return model
