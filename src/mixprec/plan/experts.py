"""`mixprec plan` for the experts modules of a mixture of experts: each module's format
chosen, as a Linear layer's is, from what its GEMMs lose on the tensors of a real step.

An experts module is measured whole: its own forward and backward (routing, per-expert GEMMs,
gate, combine) run on the captured step's inputs (tokens, the router's choices and weights)
and output gradient, once with every projection in the candidate recipe (mixprec.narrow.experts.ops,
emulated: the kernels' numerics) and once in FP32. Its three figures are the SQNRs of the
module's output, its input gradient and its weights' gradients (both projections), held to
the Linear layers' floors less 3 dB (two GEMMs in series, each at a floor, add their noise
powers); the lost shares are its input's, its output gradient's and the worst expert weight's.

Two rules keep an experts module in the base mode whatever it measures, each said in its row:
- few tokens: when its experts received a median of fewer than `plan.min_expert_tokens` rows
  in the measured step, per-expert casts and GEMMs of so few rows cost more than they save;
- a candidate that keeps the last decoder blocks in the base mode (NVFP4's keep_last_blocks)
  is not offered to the experts of those blocks.
"""

from __future__ import annotations

import copy
import math
import statistics

import torch
from torch import nn

from mixprec.narrow.experts import hf as hf_experts
from mixprec.narrow.linear.fp8 import Plan
from mixprec.narrow.formats.mx import kept_blocks
from mixprec.plan.measure import figures, operand_shares
from mixprec.precision.layout import decoder_blocks

FP32 = torch.float32
SERIES_DB = 10 * math.log10(2)  # two GEMMs' noise powers summed: the module's floors sit this far below a GEMM's


class ExpertsCapture:
    """Hooks keeping, per experts module, its last inputs (tokens, top-k ids, top-k weights) and
    the gradient at its output, detached."""

    def __init__(self, model: nn.Module, names):
        self.inputs: dict[str, tuple[torch.Tensor, ...]] = {}
        self.dy: dict[str, torch.Tensor] = {}
        self._handles = []
        for name in names:
            module = model.get_submodule(name)
            self._handles += [
                module.register_forward_hook(lambda m, a, out, name=name: self.inputs.update(
                    {name: tuple(t.detach() for t in a[:3])})),
                module.register_full_backward_hook(lambda m, gin, gout, name=name: self.dy.update(
                    {name: gout[0].detach()}))]

    def __enter__(self) -> "ExpertsCapture":
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()


def _run(module: nn.Module, x, index, weights, dy) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output, input gradient, the weights' gradients flattened) of the module on these tensors."""
    x = x.clone().requires_grad_()
    out = module(x, index, weights)
    out.backward(dy.to(out.dtype))
    grads = torch.cat([p.grad.flatten() for p in hf_experts.expert_weights(module).values()])
    return out.float(), x.grad.float(), grads.float()


def _copy(module: nn.Module) -> nn.Module:
    twin = copy.deepcopy(module).float()
    for p in twin.parameters():
        p.grad = None
    return twin


def measure_experts(module: nn.Module, x, index, weights, dy, fmt, compute_dtype: torch.dtype) -> dict:
    """The module's three figures in the recipe `fmt` against FP32, as mixprec.plan.measure's for a Linear."""
    reference = _copy(module)
    hf_experts.in_base_mode(reference, [""], FP32)
    want = _run(reference, x.float(), index, weights.float(), dy.float())
    twin = _copy(module)
    hf_experts.convert(twin, [""], Plan(fmt, fmt.tiles, compute_dtype, (False, False, False), device=x.device.type,
                                        emulated=True))
    got = _run(twin, x, index, weights, dy)
    per_expert = [operand_shares(fmt, x.float(), w[e].T if module.is_transposed else w[e], dy.float())
                  for w in hf_experts.expert_weights(module).values() for e in range(w.shape[0])]
    shares = {role: max(s[role] for s in per_expert) for role in per_expert[0]}
    return figures(want, got, shares)


def few_tokens(counts: list[int], minimum: int) -> str | None:
    """Why an experts module stays in the base mode for its token counts, or None."""
    median = statistics.median(counts)
    if median >= minimum:
        return None
    return (f"its experts received a median of {median:g} rows in the measured step (below plan.min_expert_tokens "
            f"{minimum}): per-expert casts and GEMMs on so few rows cost more than they save")


def kept_by(candidates: dict, model: nn.Module, fqn: str) -> dict[str, str]:
    """The candidates that keep `fqn`'s decoder block in the base mode (keep_last_blocks): name -> why."""
    found = decoder_blocks(model)
    if found is None or not fqn.startswith(f"{found[0]}."):
        return {}
    name, n = found
    block = int(fqn.removeprefix(f"{name}.").split(".")[0])
    out = {}
    for cand, recipe in candidates.items():
        k = kept_blocks(n, getattr(recipe, "keep_last_blocks", 0.0))
        if block >= n - k:
            out[cand] = f"{cand} keeps the last {k} of {n} decoder blocks in the base mode"
    return out
