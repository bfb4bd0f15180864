"""The optimizer's moments a precision mode promises, and the AdamW that keeps them.

torch.optim.AdamW keeps its moments in its parameters' dtype. Where a mode promises other
moments (fp8-blockwise's bfloat16 beside FP32 weights, the 8-bit formats of
precision.optimizer_states), Policy.setup puts mixprec.optim.AdamW in place of the user's
torch.optim.AdamW: the same parameter-group dicts (so an LR scheduler built on the old one
still drives the new one) and hyperparameters, logged. Another optimizer class keeps its
own state: one line says so.
"""

from __future__ import annotations

import logging

import torch

from mixprec.optim.adamw import AdamW
from mixprec.optim.fused_adamw import unsupported
from mixprec.optim.state_formats import StateFormat
from mixprec.precision.spec import FP32, Update

logger = logging.getLogger(__name__)


def wanted(spec) -> StateFormat | None:
    """The moments the mode asks of the optimizer where torch's AdamW would keep others (its
    parameters' dtype), or None: torch's own do."""
    moments = spec.moments
    if moments.quantized:
        return moments
    if spec.update is not Update.NEAREST:
        return None  # bf16-kahan and bf16-sr update bfloat16 moments in their own kernels
    own = FP32 if spec.master_weights else spec.storage_dtype
    return moments if moments.dtype != own else None


def embeddings_of(model: torch.nn.Module) -> list[torch.Tensor]:
    """The weights of the model's embedding layers (a tied output projection shares one)."""
    return [m.weight for m in model.modules() if isinstance(m, torch.nn.Embedding)]


def keeps(optimizer, states: StateFormat, compensated: bool) -> bool:
    return isinstance(optimizer, AdamW) and optimizer.states == states and optimizer.compensated == compensated


def put_in_place(policy, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 convert: bool = False) -> torch.optim.Optimizer | None:
    """The optimizer that keeps the moments `policy` promises: `optimizer` itself where it
    does (or where none is promised), else mixprec's AdamW over its parameter groups, or,
    for an optimizer that cannot be replaced, `optimizer` with a warning naming what it keeps."""
    states = wanted(policy.spec)
    if optimizer is None or states is None:
        if states is not None:
            logger.warning("%s keeps AdamW's moments in %s; setup was given no optimizer: pass the optimizer to "
                           "Policy.setup (it puts mixprec.optim.AdamW in place of torch.optim.AdamW)", policy.name,
                           states.label)
        return optimizer
    compensated = policy.spec.update is Update.KAHAN
    if keeps(optimizer, states, compensated):
        log_formats(optimizer, model)
        return optimizer
    why = None if isinstance(optimizer, AdamW) else unsupported(optimizer)
    if why is not None:
        logger.warning("%s keeps AdamW's moments in %s; this %s keeps its own state (%s): it is stepped as it is, "
                       "with its own moments", policy.name, states.label, type(optimizer).__name__, why)
        return optimizer
    defaults = optimizer.defaults
    new = AdamW(optimizer.param_groups, lr=defaults["lr"], betas=defaults["betas"], eps=defaults["eps"],
                weight_decay=defaults["weight_decay"], states=states, embeddings=embeddings_of(model),
                compensated=compensated, convert=convert)
    logger.info("optimizer: %s keeps AdamW's moments in %s: %s replaced by mixprec.optim.AdamW over the same %d "
                "parameter groups (lr, betas, eps, weight_decay as given; the same group dicts, so a scheduler "
                "built on the old one still sets them)%s", policy.name, states.label, type(optimizer).__name__,
                len(new.param_groups), ", weights Kahan-compensated" if compensated else "")
    # an LR scheduler built on the old optimizer checks that the old one stepped (torch marks it in
    # its step's wrapper): the new one's steps are the old one's now
    new.register_step_post_hook(lambda *_: setattr(optimizer, "_opt_called", True))
    log_formats(new, model)
    return new


def log_formats(optimizer: AdamW, model: torch.nn.Module) -> None:
    """One line of what keeps which moments; one line per reason naming the tensors a quantized
    format leaves in FP32."""
    if not optimizer.states.quantized:
        return
    names = {id(p): n for n, p in model.named_parameters()}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    kept = [p for p in params if id(p) in optimizer.kept_fp32]
    total = sum(p.numel() for p in params) or 1
    logger.info("optimizer: moments in %s for %d tensors (%.1f%% of the parameters); float32 for %d",
                optimizer.states.label, len(params) - len(kept), 100 * (1 - sum(p.numel() for p in kept) / total),
                len(kept))
    by_reason: dict[str, list[str]] = {}
    for p in kept:
        by_reason.setdefault(optimizer.kept_fp32[id(p)], []).append(names.get(id(p), f"<parameter {tuple(p.shape)}>"))
    for why, tensors in by_reason.items():
        logger.info("optimizer: float32 moments, %s: %s", why, ", ".join(tensors))
