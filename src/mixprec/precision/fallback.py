"""Falling back to another precision mid-run (the seeds' automatic fallback): which mode to
fall back to, decided at setup, and the swap, which keeps the FP32 weights and optimizer
state and drops the master-weights and loss-scaling parts."""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from mixprec.precision.emulation import has_fast_matmul
from mixprec.precision.master import cast_parameters
from mixprec.precision.presets import BF16, FP32, PRESETS

logger = logging.getLogger("mixprec.precision.policy")  # where these lines have always come from


def fallback_target(policy) -> str | None:
    """The mode loss_scale.fallback_to names (auto: bf16-mixed where BF16 matmuls are fast,
    else fp32), or None where there is none."""
    target = policy.loss_scale.fallback_to
    if target == "auto":
        target = "bf16-mixed" if has_fast_matmul(policy.device_type, BF16) else "fp32"
    if target and policy.sharded:
        # fully_shard fixes its MixedPrecisionPolicy when it wraps the model: a switch
        # of precision mid-run would leave it all-gathering the old dtype.
        logger.warning("precision: no automatic fallback under fully_shard: overflowing steps are skipped "
                       "and the loss scale halves down to %g; to change precision, resume the last "
                       "checkpoint with another precision.preset", policy.loss_scale.min_scale)
        return None
    return target


def fall_back(policy, target: str, reason: str | None) -> None:
    """Swap the spec for `target`'s, keeping the FP32 weights and optimizer state: the
    master-weights and loss-scaling parts go."""
    old = policy.name
    if policy.masters is not None:
        policy.masters.release()
        policy.masters = None
    cast_parameters(policy.model, FP32)
    for state in policy.optimizer.state.values() if policy.optimizer is not None else []:
        for key, t in state.items():  # FP16 states of a model without masters
            if torch.is_tensor(t) and t.is_floating_point() and key != "step":
                state[key] = t.float()
    policy.spec = replace(PRESETS[target], reduce_dtype=policy.reduce_dtype, overrides=policy.spec.overrides)
    policy.scaling, policy.loss_scale = None, None
    policy.name, policy.fallback_step = target, policy.counts.steps
    if reason is not None:
        logger.warning("[FALLBACK] step %d: %s -> %s %s", policy.counts.steps, old, policy.name, reason)
    policy.emulation.choose(policy.device_type, policy.spec.low_precision_dtypes)
