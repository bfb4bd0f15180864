"""What a precision policy keeps each kind of tensor in, per role and per module, and the
log lines a mode earns (its path, its known weaknesses), read off the policy's spec and
layout (Policy.describe, Policy.__init__ and Policy.setup call these)."""

from __future__ import annotations

import logging

import torch

from mixprec.dtypes import dtype_name
from mixprec.precision.presets import BF16, FP16, FP32, PRESETS

logger = logging.getLogger(__name__)


def describe(policy) -> dict[str, str]:
    """Which dtype each kind of tensor is kept in under this policy."""
    stored = dtype_name(policy.storage_dtype)
    master = "float32" if policy.master_weights else stored
    fp8 = (f"float8 in the block projections ({policy.fp8.summary()}), {policy.matmul_dtype} elsewhere"
           if policy.fp8 is not None else None)
    return {
        "parameters": stored + (" (norms float32)" if policy.master_weights and not policy.sharded else ""),
        "matmul compute": fp8 or policy.matmul_dtype,
        "norm, softmax, RoPE": "float32",
        "logits and loss": "float32",
        # autocast's casts are differentiable: the gradient of an FP32 leaf is FP32.
        "gradients": stored,
        "master weights": ("float32 (the sharded parameters)" if policy.sharded else master)
        if policy.master_weights else "none",
        "weight updates": {"kahan": f"Kahan-compensated ({stored} compensation per parameter)",
                           "stochastic": f"stochastically rounded to {stored}"}.get(
            policy.update, "float32" if policy.storage_dtype == FP32 or policy.master_weights
            else f"rounded to nearest {stored}"),
        "optimizer states": policy.optimizer_states.label + " moments" if policy.optimizer_states is not None
        else master,
        "gradient reduction": dtype_name(policy.reduce_dtype),
        "loss scaling": "dynamic" if policy.loss_scale is not None else "none",
        **({"per-module overrides": "; ".join(map(str, policy.spec.overrides))} if policy.spec.overrides else {}),
    }


def describe_modules(layout) -> str:
    """The per-module table: module, its parameters' dtype, its matmuls' compute, and why."""
    rows = [("module", "stored", "compute", "why")] + layout.table()
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}" for r in rows)


def policy_repr(policy) -> str:
    return (f"Policy({policy.name}: storage_dtype={dtype_name(policy.storage_dtype)}, "
            f"param_dtype={dtype_name(policy.param_dtype)}, reduce_dtype={dtype_name(policy.reduce_dtype)}"
            f"{', master_weights' if policy.master_weights else ''}"
            f"{', loss scaling' if policy.loss_scale is not None else ''}"
            f"{f', {policy.update} updates' if policy.update else ''}"
            f"{f', fp8 {policy.fp8.name}' if policy.fp8 is not None else ''}"
            f"{f', {len(policy.spec.overrides)} per-module overrides' if policy.spec.overrides else ''})")


def log_path(policy) -> None:
    """Which mechanism applies the mode: fully_shard, autocast, or none."""
    if policy.sharded:
        logger.info("Mixed precision training is handled by fully_shard: %s parameters sharded in %s%s, "
                    "all-gathered in %s%s, gradients reduced in %s", policy.name, dtype_name(policy.storage_dtype),
                    " (they are the master weights)" if policy.master_weights else "",
                    dtype_name(policy.param_dtype), f" ({policy.narrow_gathers})" if policy.narrow_gathers else "",
                    dtype_name(policy.reduce_dtype))
    elif policy.uses_autocast:
        logger.info("Mixed precision training is handled by AMP: torch.autocast(%s, %s) over %s parameters%s",
                    policy.device_type, dtype_name(policy.param_dtype), dtype_name(policy.storage_dtype),
                    " with float32 master weights" if policy.master_weights else "")
    else:
        logger.info("Mixed precision training is disabled: %s (%s)", policy.name,
                    PRESETS[policy.name].summary if policy.name in PRESETS else "custom")
    if policy.scaling is not None:
        logger.info("[MIXED PRECISION] training with %s, loss scale %g", policy.name, policy.scaling.value)


def warn_optimizer(policy, optimizer) -> None:
    """What the optimizer does not do that the mode wants, or does that the mode cannot take."""
    tiny_eps = [g["eps"] for g in (optimizer.param_groups if optimizer is not None else []) if "eps" in g
                and torch.tensor(g["eps"], dtype=FP16).item() == 0]
    if policy.storage_dtype == FP16 and not policy.master_weights and tiny_eps:
        # Adam divides by sqrt(v) + eps: a parameter whose gradient is exactly 0 (an
        # embedding row no token used) gets 0 / 0 = NaN in its first float16 update.
        logger.warning("%s: optimizer eps %g is 0 in float16, so a zero gradient gives a NaN update; "
                       "use eps >= 6e-8 (1e-4 is usual for float16 states)", policy.name, tiny_eps[0])


def warn_known_bad(policy) -> None:
    """Log what the mode loses: narrow gradient reduction, bfloat16 or float16 weights without
    float32 copies or compensated updates."""
    if policy.reduce_dtype != FP32:
        logger.warning(
            "reduce_dtype %s: gradients summed across ranks in %s lose small contributions "
            "(in bfloat16, 1e7 + 1 == 1e7); float32 is advised", *[dtype_name(policy.reduce_dtype)] * 2)
    if policy.storage_dtype == BF16 and not policy.master_weights and not policy.update:
        logger.warning(
            "storage_dtype bfloat16: optimizer states and weights in bfloat16 drop any update smaller "
            "than 2^-8 of the weight (1 + 2^-9 == 1 in bfloat16); bf16-mixed keeps float32 copies")
    if policy.storage_dtype == FP16 and not policy.master_weights:
        logger.warning(
            "%s: float16 weights, gradients and optimizer states%s: gradients below 2^-24 flush to zero, "
            "updates below 2^-11 of a weight are lost and values above 65504 overflow; fp16-mixed or "
            "fp16-master avoid this", policy.name, "" if policy.loss_scale else " without loss scaling")


def summary(policy) -> dict:
    """The run's precision figures, for summary.json."""
    c = policy.counts
    return {
        "precision": policy.requested, "precision_final": policy.name, "param_dtype": dtype_name(policy.param_dtype),
        "matmul_dtype": policy.matmul_dtype, "storage_dtype": dtype_name(policy.storage_dtype),
        "reduce_dtype": dtype_name(policy.reduce_dtype), "autocast": policy.uses_autocast,
        "master_weights": policy.master_weights, "update": policy.update, "steps": c.steps,
        "skipped_steps": c.skipped, "nonfinite_steps": c.nonfinite,
        "loss_scale": policy.scaling.value if policy.scaling is not None else None,
        "overflow_count": c.overflows, "overflow_rate": c.overflows / c.steps if c.steps else 0.0,
        "fallback_triggered": policy.fallback_step is not None, "fallback_step": policy.fallback_step,
        "fp8_recipe": policy.fp8.name if policy.fp8 is not None else None,
        "fp8_layers": policy.formats.fp8_layers if policy.formats is not None else 0,
        "precision_overrides": [str(o) for o in policy.spec.overrides if not o.source],
        "precision_plan": next((o.source.removeprefix("precision.plan ") for o in policy.spec.overrides if o.source),
                               None),
        "gemm_flops_by_format": policy.layout.flops_by_format() if policy.layout is not None else {},
        "promoted": policy.promoted,
    }
