"""AdamW with its two moments stored in a narrower dtype (DeepSeek-V3 keeps them in
bfloat16 beside FP32 master weights: 4 bytes per parameter instead of 8).

Each step takes one parameter at a time: its moments are widened to FP32, updated with
exactly torch.optim.AdamW's arithmetic (single-tensor path: decoupled weight decay, lerp,
bias correction), and rounded back to nearest. With moments_dtype float32 the widening
is a no-op and the parameters match torch.optim.AdamW(foreach=False) bit for bit
(tests/optim/test_adamw.py); the FP32 temporaries never exceed one parameter's size.
"""

from __future__ import annotations

import torch


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
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)  # on the CPU, as torch's: reading it costs no device sync
                    state["exp_avg"] = torch.zeros_like(p, dtype=self.moments_dtype)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.moments_dtype)
                grad = p.grad
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
        return loss
