"""torch.optim.AdamW's update for one bfloat16 parameter as one kernel: FP32 arithmetic in
registers, bfloat16 in memory, and the result Kahan-compensated or stochastically rounded.

The generic path of mixprec.optim.updates widens the weight, gradient and moments to FP32
copies, runs the optimizer's own kernel and narrows them back: about 80 more bytes moved
per parameter than bf16-true's step, which on a memory-bound CPU costs 7% of a small-
flavor step. For torch.optim.AdamW these functions compute the same arithmetic (the
single-tensor path: decoupled weight decay, lerp, bias correction; FMA and order may
differ in the last bit) reading 10 bytes and writing 8 per parameter, compiled into one
kernel per parameter.
"""

from __future__ import annotations

import torch

from mixprec.optim.rounding import round_trip, stochastic_round_bf16


def _adamw(w, g, m, v, step_size, bias_correction2_sqrt, lr, beta1, beta2, eps, weight_decay, sign):
    """The new FP32 weight and moments from FP32 `w` and low-precision g, m, v."""
    grad = g.float() * sign
    w = w * (1 - lr * weight_decay)
    m32 = torch.lerp(m.float(), grad, 1 - beta1)
    v32 = v.float() * beta2 + (1 - beta2) * grad * grad
    denom = v32.sqrt() / bias_correction2_sqrt + eps
    return w - step_size * m32 / denom, m32, v32


def adamw_kahan_(p, c, g, m, v, *scalars) -> None:
    """One AdamW step of weight p + compensation c, in place on p, c, m, v. `scalars`:
    step_size (lr / bias correction 1), bias correction 2's root, lr, beta1, beta2, eps,
    weight decay, gradient sign."""
    w, m32, v32 = _adamw(p.float() + c.float(), g, m, v, *scalars)
    rounded = round_trip(w, p.dtype)  # compiled with rounding.compile_options(p.dtype)
    p.copy_(rounded)  # exact: rounded is a value of p's dtype
    c.copy_(w - rounded)  # exact in FP32: what the rounding dropped
    m.copy_(m32)
    v.copy_(v32)


def adamw_stochastic_(p, g, m, v, key, *scalars) -> None:
    """One AdamW step of bfloat16 p, the weight stochastically rounded (keyed by `key`)."""
    w, m32, v32 = _adamw(p.float(), g, m, v, *scalars)
    p.copy_(stochastic_round_bf16(w, key))
    m.copy_(m32)
    v.copy_(v32)


def unsupported(optimizer: torch.optim.Optimizer) -> str | None:
    """Why these kernels cannot stand in for `optimizer`'s step, or None when they can."""
    if type(optimizer) is not torch.optim.AdamW:
        return f"{type(optimizer).__name__} is not torch.optim.AdamW"
    for group in optimizer.param_groups:
        for option in ("amsgrad", "differentiable", "capturable"):
            if group.get(option):
                return f"AdamW with {option}=True"
        if torch.is_tensor(group["lr"]) or any(torch.is_tensor(b) for b in group["betas"]):
            return "AdamW with tensor learning rate or betas"
    return None


def scalars(group: dict, step: float) -> tuple[torch.Tensor, ...]:
    """The kernels' scalars for a parameter of `group` at its `step` (1-based), as 0-dim host
    tensors, so a compiled kernel is not specialised on their values."""
    lr, (beta1, beta2) = group["lr"], group["betas"]
    values = (lr / (1 - beta1**step), (1 - beta2**step) ** 0.5, lr, beta1, beta2, group["eps"], group["weight_decay"],
              -1.0 if group["maximize"] else 1.0)
    return tuple(torch.tensor(x, dtype=torch.float64) for x in values)
