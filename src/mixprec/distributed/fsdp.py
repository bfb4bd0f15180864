"""FSDP2 (`fully_shard`) with the precision policy's MixedPrecisionPolicy.

Sharded parameters and optimizer states stay in the storage dtype (FP32 for the mixed
modes); each unit's parameters are all-gathered in param_dtype for compute; gradients
are reduce-scattered in reduce_dtype. The policy then does no autocast of its own:
autocast on top of FSDP's casts would cast twice.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

from mixprec.precision import Policy
from mixprec.precision.master import cast_parameters


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, policy: Policy, *, reshard_after_forward: str = "default",
               cpu_offload: bool = False) -> nn.Module:
    """Shard the token embeddings, each transformer block, the final norm together with
    the output layer, and the root (TorchTitan's layout), under `policy`; any other model,
    each of its decoder layers (`layers`, else its longest nn.ModuleList) and the root. A 2-D mesh
    (replicate, shard) gives HSDP. reshard_after_forward: default (every unit but the
    root, whose parameters the backward needs first), always, never."""
    mp_policy = policy.fsdp_mixed_precision()  # first: it may change the storage dtype (master weights)
    cast_parameters(model, policy.storage_dtype)
    kwargs = dict(mesh=mesh, mp_policy=mp_policy,
                  reshard_after_forward=reshard_after_forward != "never",
                  offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy())
    # Tied embeddings and output (the 1B flavor's): one tensor can be in one FSDP group only, the root's
    tied = hasattr(model, "output") and model.output.weight is model.tok_embeddings.weight
    if hasattr(model, "tok_embeddings") and not tied:  # mixprec's Llama; another model's stay in the root
        fully_shard(model.tok_embeddings, **kwargs)
    from mixprec.models.hf import decoder_layers

    for block in getattr(model, "layers", None) or decoder_layers(model):
        fully_shard(block, **kwargs)
    if hasattr(model, "output") and not tied:
        fully_shard([model.norm, model.output], **kwargs)
    fully_shard(model, **{**kwargs, "reshard_after_forward": reshard_after_forward == "always"})
    return model
