"""What a precision policy keeps each kind of tensor in, and the warnings a mode's known
weaknesses earn, read off the policy's fields (Policy.describe and Policy.__init__ call these)."""

from __future__ import annotations

import logging

from mixprec.precision.dtypes import dtype_name
from mixprec.precision.presets import BF16, FP16, FP32

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
        "optimizer states": dtype_name(policy.optimizer_moments_dtype) + " moments" if
        policy.optimizer_moments_dtype != FP32 else master,
        "gradient reduction": dtype_name(policy.reduce_dtype),
        "loss scaling": "dynamic" if policy.loss_scale is not None else "none",
    }


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
