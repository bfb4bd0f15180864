"""FSDP2 (`fully_shard`) with the precision policy's MixedPrecisionPolicy.

Sharded parameters and optimizer states stay in the storage dtype (FP32 for the mixed
modes); each unit's parameters are all-gathered in param_dtype for compute; gradients
are reduce-scattered in reduce_dtype. The policy then does no autocast of its own:
autocast on top of FSDP's casts would cast twice. The FP8 and microscaled Linear layers'
weights are all-gathered in their own formats instead (mixprec.narrow.fsdp.linear).
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

from mixprec.dtypes import dtype_name
from mixprec.narrow.fsdp import linear as all_gather
from mixprec.narrow.fsdp import experts as experts_gather
from mixprec.narrow.experts.hf import runs_narrow
from mixprec.narrow.linear.fp8 import FP8Linear
from mixprec.models.ties import tied_modules
from mixprec.precision import Policy
from mixprec.precision.master import cast_parameters

logger = logging.getLogger(__name__)


def recomputes_forward(block) -> bool:
    """Whether a block recomputes its forward in backward (activation checkpointing)."""
    return bool(getattr(block, "checkpointed", False) or getattr(block, "mixprec_recomputes", False))


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, policy: Policy, *, reshard_after_forward: str = "default",
               cpu_offload: bool = False, lowp_all_gather: bool = True, experts_mesh: DeviceMesh | None = None
               ) -> nn.Module:
    """Shard the token embeddings, each transformer block, the final norm together with
    the output layer, and the root (TorchTitan's layout), under `policy`; any other model,
    each of its decoder layers (`layers`, else its longest nn.ModuleList) and the root. A 2-D mesh
    (replicate, shard) gives HSDP. reshard_after_forward: default (every unit but the
    root, whose parameters the backward needs first), always, never. lowp_all_gather: the
    FP8 and microscaled Linear layers' weights travel in their own format (mixprec.narrow.fsdp.linear).
    experts_mesh: under expert parallelism, the ranks that shard each expert-parallel rank's experts
    (mixprec.distributed.expert_parallel), each experts module a unit of its own over them."""
    from mixprec.models.hf import decoder_layers

    mp_policy = policy.fsdp_mixed_precision()  # first: it may change the storage dtype (master weights)
    cast_parameters(model, policy.storage_dtype)
    blocks = list(getattr(model, "layers", None) or decoder_layers(model))
    policy.narrow_gathers = _narrow_gathers(model, blocks, mesh.shape[-1], reshard_after_forward, lowp_all_gather,
                                            mp_policy.param_dtype, experts_mesh.size() if experts_mesh else 1)
    kwargs = dict(mesh=mesh, mp_policy=mp_policy,
                  reshard_after_forward=reshard_after_forward != "never",
                  offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy())
    # Tied embeddings and output (the 1B flavor's): one tensor can be in one FSDP group only, the root's
    tied = tied_modules(model)
    # mixprec's Llama; another model's embeddings and head stay in the root
    if hasattr(model, "tok_embeddings") and "tok_embeddings" not in tied:
        fully_shard(model.tok_embeddings, **kwargs)
    _shard_routers(model, policy, kwargs)
    if experts_mesh is not None:
        _shard_experts(model, experts_mesh, kwargs)
    for block in blocks:
        fully_shard(block, **kwargs)
    if hasattr(model, "output") and "output" not in tied:
        fully_shard([model.norm, model.output], **kwargs)
    fully_shard(model, **{**kwargs, "reshard_after_forward": reshard_after_forward == "always"})
    all_gather.attach_units(model)
    return model


def _shard_routers(model: nn.Module, policy: Policy, kwargs: dict) -> None:
    """A mixture-of-experts model's routers, each a unit of its own gathered in float32 (their layout rows:
    FP32 weights, logits and scores), before the blocks that hold them take the rest in the compute dtype."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    routers = list(policy.layout.routers()) if policy.layout is not None else []
    if not routers or kwargs["mp_policy"].param_dtype in (None, torch.float32):
        return
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=kwargs["mp_policy"].reduce_dtype)
    for fqn in routers:
        fully_shard(model.get_submodule(fqn), **{**kwargs, "mp_policy": fp32})
    logger.info("fsdp: %d routers all-gathered in float32, each a unit of its own (%s, ...)", len(routers), routers[0])


def _shard_experts(model: nn.Module, mesh: DeviceMesh, kwargs: dict) -> None:
    """Expert-parallel experts modules, each a unit over the ranks outside its expert-parallel group
    (mixprec.distributed.expert_parallel says how their gradients become the mean over every rank)."""
    from mixprec.models.moe import moe_layers

    for layer in moe_layers(model):
        if layer.experts.ep is not None:
            fully_shard(layer.experts, **{**kwargs, "mesh": mesh})


def _narrow_gathers(model: nn.Module, blocks: list[nn.Module], world: int, reshard_after_forward: str, enabled: bool,
                    param_dtype, experts_world: int = 1) -> str:
    """Low-precision all-gathers for the FP8 and microscaled Linear layers, or the line that says they gather
    in param_dtype. Returns what the startup line says of them."""
    narrow = [fqn for fqn, m in model.named_modules() if isinstance(m, FP8Linear)]
    experts = [fqn for fqn, m in model.named_modules() if runs_narrow(m)]
    if not narrow and not experts:
        return ""
    base = param_dtype or next(model.parameters()).dtype
    if not enabled:
        for fqn in narrow:
            model.get_submodule(fqn).gather_why = "parallelism.lowp_all_gather = false"
        logger.info("fsdp: parallelism.lowp_all_gather = false: the %d FP8/microscaled Linear layers and %d experts "
                    "modules all-gather their weights in %s and quantise them after the gather", len(narrow),
                    len(experts), dtype_name(base))
        return f"the {len(narrow)} low-precision Linear weights too: parallelism.lowp_all_gather = false"
    names = {m: fqn for fqn, m in model.named_modules()}
    in_block = {f"{names[b]}.": b for b in blocks}

    def block_of(fqn: str):
        return next((b for prefix, b in in_block.items() if fqn.startswith(prefix)), None)

    def reshards(fqn: str) -> bool:  # blocks follow reshard_after_forward; the root reshards only "always"
        return reshard_after_forward != "never" if block_of(fqn) is not None else reshard_after_forward == "always"

    def recomputes(fqn: str) -> bool:
        return recomputes_forward(block_of(fqn))

    decided = all_gather.shard_narrow(model, world, reshards=reshards, recomputes=recomputes)
    all_gather.log_decisions(model, decided, base)
    experts_decided = experts_gather.shard(model, world, reshards=reshards, recomputes=recomputes,
                                           experts_world=experts_world)
    experts_gather.log_decisions(model, experts_decided, base)
    formats = sorted({dtype_name(all_gather.element_format(model.get_submodule(f).plan.recipe))
                      for f, why in decided.items() if why is None})
    wide = sum(why is not None for why in decided.values())
    gathered = sum(why is None for why in experts_decided.values())
    return (f"{len(decided) - wide} low-precision Linear weights in {', '.join(formats) or '-'} with their scales"
            + (f", {wide} in {dtype_name(base)} (logged why)" if wide else "")
            + (f"; {gathered} of {len(experts_decided)} experts projections narrow" if experts_decided else ""))


def unsharded_bytes(model: nn.Module) -> int:
    """Bytes FSDP2 holds right now in all-gathered parameters: the storage of every
    parameter's all-gather buffers that is allocated (a resharded unit's is freed)."""
    return sum(t.untyped_storage().nbytes() for _, _, p in all_gather.fsdp_params(model) for t in p.all_gather_outputs)
