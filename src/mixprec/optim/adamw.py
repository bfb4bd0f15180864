"""AdamW with its two moments stored in a narrower dtype (DeepSeek-V3 keeps them in
bfloat16 beside FP32 master weights: 4 bytes per parameter instead of 8).

Each step takes one parameter at a time: its moments are widened to FP32, updated with
exactly torch.optim.AdamW's arithmetic (single-tensor path: decoupled weight decay, lerp,
bias correction), and rounded back to nearest. With moments_dtype float32 the widening
is a no-op and the parameters match torch.optim.AdamW(foreach=False) bit for bit
(tests/optim/test_adamw.py); the FP32 temporaries never exceed one parameter's size.
"""

from __future__ import annotations

import functools

import torch

from mixprec.optim import fused_adamw


@functools.cache
def _moments_kernel():
    """fused_adamw.adamw_moments_ compiled once per process (dynamic shapes: every parameter)."""
    return torch.compile(fused_adamw.adamw_moments_, dynamic=True)


class AdamW(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, moments_dtype: torch.dtype = torch.bfloat16):
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Invalid beta parameters: {betas}")
        if moments_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"moments_dtype {moments_dtype}: accepted float32, bfloat16, float16")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.moments_dtype = moments_dtype

    def load_state_dict(self, state_dict: dict) -> None:
        # torch.optim.Optimizer casts floating state to each parameter's dtype (FP32 here);
        # the saved moments were moments_dtype values, so casting back is exact.
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key] = state[key].to(self.moments_dtype)

    @torch.no_grad()
    def step(self, closure=None):
        """One step. With `self.found_inf` set (torch.amp.GradScaler's protocol, as torch's
        fused AdamW: a 0-dim float tensor on the parameters' device, 1 to skip), the step is
        taken or skipped on the device; `self.grad_scale`, when not None, unscales the
        gradients first."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = getattr(self, "found_inf", None)
        grad_scale = getattr(self, "grad_scale", None)
        inv_scale = grad_scale.double().reciprocal().float() if grad_scale is not None else None
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                state = self.state[p]
                if not state:
                    # on the CPU, as torch's: reading it costs no device sync (on the device
                    # where a skip is decided there: the count must see it)
                    device = p.device if found_inf is not None else "cpu"
                    state["step"] = torch.tensor(0.0, device=device)
                    state["exp_avg"] = torch.zeros_like(p, dtype=self.moments_dtype)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.moments_dtype)
            grads = [p.grad if inv_scale is None else p.grad * inv_scale.to(p.grad.device) for p in params]
            if found_inf is None:
                for p, grad in zip(params, grads):
                    self._update(p, grad, self.state[p], group)
            elif params:
                self._steps_unless(group, params, grads, found_inf)
        return loss

    def _update(self, p, grad, state, group) -> None:
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        if state["step"].device.type != "cpu":  # stepped on the device before: keep reads off the device
            state["step"] = state["step"].cpu()
        state["step"] += 1
        step = state["step"].item()
        exp_avg, exp_avg_sq = state["exp_avg"].float(), state["exp_avg_sq"].float()
        p.mul_(1 - lr * wd)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1**step
        bias_correction2_sqrt = (1 - beta2**step) ** 0.5
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        p.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
        if self.moments_dtype != torch.float32:
            state["exp_avg"].copy_(exp_avg)  # rounds to nearest
            state["exp_avg_sq"].copy_(exp_avg_sq)

    def _steps_unless(self, group, params, grads, found_inf: torch.Tensor) -> None:
        """One step of `params` of `group` taken or skipped on the device (found_inf 1: nothing
        changes), the step counts and bias corrections there too. On a GPU each parameter is
        one compiled kernel (fused_adamw.adamw_moments_: FP32 in registers, the moments read
        and written in their own dtype); on a CPU _update_unless, the reference."""
        if params[0].device.type == "cpu":
            for p, grad in zip(params, grads):
                self._update_unless(p, grad, self.state[p], group, found_inf)
            return
        skip = found_inf.to(params[0].device)
        states = [self.state[p] for p in params]
        kernel = _moments_kernel()
        for p, grad, state, scalars in zip(params, grads, states,
                                           fused_adamw.device_steps(group, states, [p.device for p in params], skip)):
            kernel(p, grad, state["exp_avg"], state["exp_avg_sq"], skip, *scalars)

    def _update_unless(self, p, grad, state, group, found_inf: torch.Tensor) -> None:
        """_update's arithmetic with the step count and bias corrections on the device (the
        same float64 values: pow, true division), the results kept only where found_inf is 0.
        Bit-equal to _update on a CPU (tests/optim/test_adamw.py); costs one FP32 copy of
        the parameter and of each moment."""
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        skip = found_inf.to(p.device) != 0
        state["step"] = state["step"].to(p.device)
        state["step"] += 1 - skip.float()
        step_size, bias_correction2_sqrt = fused_adamw.bias_corrections(group, state["step"])
        exp_avg = state["exp_avg"].to(torch.float32, copy=True)
        exp_avg_sq = state["exp_avg_sq"].to(torch.float32, copy=True)
        w = p.mul(1 - lr * wd)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        w.add_(exp_avg * -step_size / denom)  # -(lr / bc1) == -lr / bc1 exactly: addcdiv's value
        p.copy_(torch.where(skip, p, w))
        state["exp_avg"].copy_(torch.where(skip, state["exp_avg"], exp_avg))  # rounds to nearest
        state["exp_avg_sq"].copy_(torch.where(skip, state["exp_avg_sq"], exp_avg_sq))

    _step_supports_amp_scaling = True  # takes found_inf and grad_scale, as torch's fused AdamW
