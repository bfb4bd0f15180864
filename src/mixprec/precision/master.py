"""Low-precision models with FP32 master weights (Apex O2, the "dual-weight" system).

The model holds FP16/BF16 weights (norm layers stay FP32); the optimizer holds FP32
copies. Each step copies the gradients up, steps in FP32, and copies the weights down,
so updates smaller than the low-precision weight's resolution still accumulate.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

ModuleFilter = Callable[[str, nn.Module], bool]


def is_norm(fqn: str, module: nn.Module) -> bool:
    """Normalisation layers: the ones Apex O2 keeps in FP32 (keep_batchnorm_fp32)."""
    norms = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase, nn.RMSNorm)
    return isinstance(module, norms) or type(module).__name__.endswith("Norm")


def cast_parameters(model: nn.Module, dtype: torch.dtype, keep_fp32: ModuleFilter | None = None) -> None:
    """Cast floating parameters in place (the same Parameter objects) to `dtype`, except
    the direct parameters of modules that `keep_fp32(fqn, module)` selects, which go to FP32."""
    with torch.no_grad():
        for fqn, module in model.named_modules():
            target = torch.float32 if keep_fp32 is not None and keep_fp32(fqn, module) else dtype
            for p in module.parameters(recurse=False):
                if p.is_floating_point() and p.dtype != target:
                    p.data = p.data.to(target)
                    if p.grad is not None:
                        p.grad = p.grad.to(target)


def _tell(optimizer: torch.optim.Optimizer, pairs) -> None:
    """An optimizer that keeps records per parameter object (mixprec's AdamW: which keep FP32 moments)
    follows the swap of (old, new) parameters in its groups."""
    if hasattr(optimizer, "replaced"):
        optimizer.replaced(pairs)


class MasterWeights:
    """FP32 copies of the model's non-FP32 parameters, swapped into the optimizer."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.pairs: list[tuple[nn.Parameter, nn.Parameter]] = []
        masters = {}
        for p in model.parameters():
            if p.dtype != torch.float32 and p not in masters:
                masters[p] = nn.Parameter(p.detach().float().clone())
                self.pairs.append((p, masters[p]))
        for group in optimizer.param_groups:
            group["params"] = [masters.get(p, p) for p in group["params"]]
        _tell(optimizer, self.pairs)

    def named_masters(self, model: nn.Module) -> dict[str, nn.Parameter]:
        """The master copy of each of `model`'s parameters that has one, by name."""
        by_param = {id(p): m for p, m in self.pairs}
        return {name: by_param[id(p)] for name, p in model.named_parameters() if id(p) in by_param}

    def grads_to_master(self) -> None:
        for p, m in self.pairs:
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None

    @torch.no_grad()
    def master_to_model(self) -> None:
        for p, m in self.pairs:
            p.copy_(m)

    def release(self) -> None:
        """The model takes the FP32 masters as its own parameters, and the optimizer's
        state moves with them (used when falling back to an FP32-storage mode)."""
        back = {m: p for p, m in self.pairs}
        for p, m in self.pairs:
            p.data = m.data
            if m in self.optimizer.state:
                self.optimizer.state[p] = self.optimizer.state.pop(m)
        for group in self.optimizer.param_groups:
            group["params"] = [back.get(q, q) for q in group["params"]]
        _tell(self.optimizer, [(m, p) for p, m in self.pairs])
        self.pairs = []

    def state_dict(self) -> list[torch.Tensor]:
        return [m.detach() for _, m in self.pairs]

    @torch.no_grad()
    def load_state_dict(self, tensors: list[torch.Tensor]) -> None:
        if len(tensors) != len(self.pairs):
            raise ValueError(f"{len(tensors)} master weights for {len(self.pairs)} parameters")
        for (_, m), t in zip(self.pairs, tensors):
            m.copy_(t)
        self.master_to_model()

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The model's state with each parameter's FP32 master in its place."""
        state = model.state_dict()
        state.update({name: m.detach() for name, m in self.named_masters(model).items()})
        return state

    @torch.no_grad()
    def load_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        model.load_state_dict(state)  # rounds into the model's dtypes
        for name, m in self.named_masters(model).items():
            m.copy_(state[name])
