"""The steps that apply something to a built model, in TorchTitan's order: tensor
parallel, activation checkpointing, torch.compile, then FSDP2 (fully_shard wraps the
compiled blocks, so its hooks stay outside the compiled code).

Each step keeps the parameters and their names (layers.3.attention.wq.weight stays
that), so checkpoints move freely between runs with and without any of them.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.utils.checkpoint
from torch import nn

from mixprec.distributed.expert_parallel import apply_expert_parallel
from mixprec.distributed.fsdp import apply_fsdp
from mixprec.distributed.parallel import ParallelDims
from mixprec.distributed.tensor_parallel import apply_tensor_parallel
from mixprec.errors import UserError
from mixprec.precision import Policy

logger = logging.getLogger(__name__)

AC_MODES = ("none", "selective", "full")


def checkpointed_blocks(n_layers: int, mode: str) -> list[int]:
    """Which blocks recompute in backward: none, every other one (selective: 1, 3, 5, ...,
    as TorchTitan's layer-wise option "2"), or all. The memory planner counts the same."""
    if mode not in AC_MODES:
        raise ValueError(f"activation checkpointing mode {mode!r}; accepted: {', '.join(AC_MODES)}")
    step = {"none": 0, "selective": 2, "full": 1}[mode]
    return [i for i in range(n_layers) if step and (i + 1) % step == 0] if step else []


def apply_activation_checkpointing(model: nn.Module, mode: str) -> list[int]:
    """Mark blocks to keep only their input and recompute the rest in backward
    (torch.utils.checkpoint, non-reentrant). Returns the marked block indices."""
    chosen = checkpointed_blocks(len(model.layers), mode)
    for i, block in enumerate(model.layers):
        if hasattr(block, "checkpointed"):  # mixprec's own blocks checkpoint themselves
            block.checkpointed = i in chosen
        elif i in chosen:  # another model's layer (a Hugging Face decoder layer): its forward, wrapped
            _checkpoint_forward(block)
    if chosen:
        logger.info("activation checkpointing: %s, %d of %d blocks recompute their forward in backward",
                    mode, len(chosen), len(model.layers))
    return chosen


def _checkpoint_forward(block: nn.Module) -> None:
    """Run `block`'s forward under non-reentrant torch.utils.checkpoint; its parameters and
    their names stay as they are (a checkpoint wrapper module would rename them)."""
    forward = block.forward

    @functools.wraps(forward)
    def checkpointed(*args, **kwargs):
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    block.forward = checkpointed
    block.mixprec_recomputes = True  # what the low-precision all-gather asks (distributed.fsdp.recomputes_forward)


def apply_compile(model: nn.Module, components: tuple[str, ...], policy: Policy, device_type: str) -> None:
    """torch.compile each transformer block's forward (one graph reused by every block)
    and the output layer's forward (projection and loss), unless the policy emulates its
    matmuls here: a TorchDispatchMode, which torch.compile cannot trace."""
    if policy.will_emulate(device_type):
        logger.warning("compile: running eager: %s emulates its %s matmuls on this %s with a TorchDispatchMode, "
                       "which torch.compile cannot trace (precision.emulate_matmul = false compiles with the native "
                       "kernels)", policy.name, policy.matmul_dtype, device_type)
        return
    _backward_outside_autocast()
    if "model" in components:
        for block in model.layers:
            block.forward = torch.compile(block.forward)
    if "loss" in components and not hasattr(model, "output"):
        components = tuple(c for c in components if c != "loss")
        logger.info("compile: the loss component is mixprec's own output layer; this model's head and loss run "
                    "eager (compile.components model compiles its decoder layers)")
    if "loss" in components:
        model.output.forward = torch.compile(model.output.forward)
    logger.info("compile: torch.compile (Inductor) applied to %s", " and ".join(
        {"model": f"each of the {len(model.layers)} transformer blocks", "loss": "the output layer and loss"}[c]
        for c in components))


def _backward_outside_autocast() -> None:
    """Eager autograd runs the backward outside autocast; compiled regions traced their
    backward under the forward's autocast by default up to torch 2.13 (pytorch#153044),
    so an fp16 backward could overflow where eager's does not. Match eager."""
    import torch._functorch.config as functorch_config

    if getattr(functorch_config, "backward_pass_autocast", "off") != "off":
        functorch_config.backward_pass_autocast = "off"
        logger.info("compile: compiled backward passes run outside autocast, as eager ones do "
                    "(torch._functorch.config.backward_pass_autocast = 'off')")


def parallelize(model: nn.Module, dims: ParallelDims, policy: Policy, device: torch.device, *, pcfg, ac_mode: str,
                compile_components: tuple[str, ...] | None) -> None:
    """Apply the policy's model rewrites (FP8), TP, activation checkpointing, compile and
    FSDP2 to `model` in place. compile_components None: no compile."""
    if dims.tp_enabled and any(not isinstance(f, torch.dtype) for f in policy.spec.compute_formats):
        raise UserError(f"{policy.name} with parallelism.tensor_parallel_degree {dims.tp}: the FP8 layers are not "
                        "tensor-parallel; accepted: tensor_parallel_degree 1 (FSDP2 and DDP shard or replicate them)")
    policy.prepare_model(model, device.type)
    mesh = dims.mesh(device.type) if dims.world_size > 1 and not dims.ddp_enabled else None
    if dims.tp_enabled:
        apply_tensor_parallel(model, mesh["tp"])
        logger.info("parallelism: tensor parallel over %d ranks (attention and MLP projections split "
                    "column-/row-wise)", dims.tp)
    if dims.ep_enabled:
        apply_expert_parallel(model, mesh, pcfg.expert_dispatch)
    apply_activation_checkpointing(model, ac_mode)
    if compile_components:
        apply_compile(model, compile_components, policy, device.type)
    if dims.fsdp_enabled:
        apply_fsdp(model, dims.dp_mesh(mesh), policy, reshard_after_forward=pcfg.fsdp_reshard_after_forward,
                   cpu_offload=pcfg.enable_cpu_offload, lowp_all_gather=pcfg.lowp_all_gather,
                   experts_mesh=mesh["dp_mod_ep"] if dims.ep_enabled else None)
    elif dims.tp_enabled and policy.param_dtype != policy.storage_dtype:
        # Without fully_shard there is no MixedPrecisionPolicy: autocast over the DTensor
        # model casts each sharded matmul instead of leaving it in float32.
        logger.info("parallelism: tensor parallel without FSDP: %s is applied by torch.autocast over the "
                    "DTensor model (no fully_shard to cast the parameters)", policy.name)
