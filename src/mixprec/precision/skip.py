"""Skipping a step on the device: the optimizer is handed the decision as a tensor and
leaves every parameter, state and step count as it was when it is 1, without the host
reading it (torch.amp.GradScaler's protocol for fused optimizers).

- torch's fused Adam, AdamW and SGD (`_step_supports_amp_scaling`) and mixprec's own
  AdamW take `optimizer.found_inf` (and `grad_scale`, None here: the gradients are already
  unscaled) into their kernels, which skip and take the step count back on the device;
- bf16-kahan and bf16-sr's kernels (mixprec.optim.updates) take it as an argument;
- any other optimizer cannot: its step reads the decision on the host, one sync a step,
  logged at its first step (`device_skip` says why).
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("mixprec.precision.policy")


def device_skip(optimizer: torch.optim.Optimizer, updates=None) -> str | None:
    """None when `optimizer` (with `updates`, a BF16Updates) skips a step on the device, else why not."""
    if updates is not None and not updates.fused:
        return f"bf16 updates around {type(optimizer).__name__} step float32 working copies"
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        return None
    kind = "foreach" if any(g.get("foreach") for g in optimizer.param_groups) else "for-loop"
    return (f"{type(optimizer).__name__} ({kind}) has no device-side skip; torch's fused=True kernels "
            "and mixprec's AdamW have one")


def step_unless(optimizer: torch.optim.Optimizer, skip: torch.Tensor, updates=None, on_host: bool = False) -> None:
    """optimizer.step() (through `updates` where given), or nothing where `skip` (a 0-dim
    float tensor, 0 or 1) is 1. on_host: the optimizer cannot skip on the device
    (`device_skip` said why)."""
    stepper = updates if updates is not None else optimizer
    if on_host:
        if not skip.item():  # the one host read of such an optimizer's step (logged at its first step)
            stepper.step()
        return
    optimizer.grad_scale, optimizer.found_inf = None, skip
    try:
        stepper.step()
    finally:
        del optimizer.grad_scale, optimizer.found_inf
