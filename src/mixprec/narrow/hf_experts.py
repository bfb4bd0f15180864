"""The experts of Hugging Face mixture-of-experts models in a narrow recipe, through
transformers' own seam: an experts implementation registered in its `ExpertsInterface`
("mixprec") and selected by the model's `experts_implementation`, as transformers' own
`grouped_mm` is. It runs the same routing as `grouped_mm` (tokens sorted by expert, the
cumulative end offsets, the gate, the routing weights, the combine), with each projection
on mixprec.narrow.experts; an experts module left in the base mode runs torch's grouped GEMM
in the base compute dtype (`in_base_mode`). A module it was not set up for runs transformers'
`grouped_mm`.

Which modules are experts: the classes transformers' `use_experts_implementation` decorates
(their `has_gate` / `is_transposed` / `has_bias` say the layout: qwen3_moe, qwen2_moe,
mixtral, olmoe, deepseek_v3, phimoe, gpt_oss (transposed, biased, interleaved), ...). A
module holding 3-D expert weights outside the interface (Llama 4's experts run a bmm; dbrx,
jetmoe) cannot be reached there: it stays in the base mode, named in the log and the audit.

Which modules are routers, by role rather than class (Llama 4's and PhiMoE's routers
subclass nn.Linear): a sibling of an experts module with a 2-D weight of one row per expert,
and one-output gates beside them (Qwen2-MoE's shared_expert_gate). They stay out of every
narrow format, with their logits and score function in FP32 (mixprec.precision.layout).
"""

from __future__ import annotations

import logging
import zlib

import torch
from torch import nn

from mixprec.narrow import experts
from mixprec.narrow.experts import ExpertsGemm, ExpertsLayer
from mixprec.narrow.linear import Plan
from mixprec.narrow.microscaling import byte_values
from mixprec.narrow.mx import MXRecipe

logger = logging.getLogger(__name__)

IMPLEMENTATION = "mixprec"  # the key in transformers' ExpertsInterface
BASE = "grouped_mm"  # what an unconverted experts module runs under it: transformers' own grouped GEMMs
OWN = "mixprec_seam"  # a class attribute of experts modules that run mixprec's ExpertsLayer themselves


def interface_experts(module: nn.Module) -> bool:
    """A module whose forward transformers' experts interface dispatches (use_experts_implementation)."""
    return hasattr(module, "is_transposed") and hasattr(module, "has_gate") and hasattr(module, "config") \
        and hasattr(module.config, "_experts_implementation")


def runs_here(module: nn.Module) -> bool:
    """A module whose experts mixprec can run: transformers' interface, or one that declares the seam
    itself (mixprec's own MoE: `mixprec.models.moe.Experts`, whose forward runs its ExpertsLayer)."""
    return getattr(module, OWN, False) or interface_experts(module)


def expert_weights(module: nn.Module) -> dict[str, nn.Parameter]:
    """A module's own 3-D floating parameters: one matrix per expert."""
    return {n: p for n, p in module.named_parameters(recurse=False) if p.dim() == 3 and p.is_floating_point()}


def projections(module: nn.Module) -> tuple[str, str]:
    return ("gate_up_proj" if module.has_gate else "up_proj"), "down_proj"


def find_experts(model: nn.Module) -> dict[str, str | None]:
    """Every experts module of `model`: FQN -> None where a recipe can take it, else why it cannot."""
    found = {}
    for fqn, m in model.named_modules():
        weights = expert_weights(m)
        if not weights:
            continue
        if not runs_here(m):
            found[fqn] = (f"{type(m).__name__} is outside transformers' experts interface (its forward runs the experts "
                          "itself): no seam to run them in a narrow format")
        elif getattr(m, "_is_expert_parallel", False):
            found[fqn] = "expert-parallel experts (tokens exchanged between ranks) are not converted yet"
        else:
            shapes = [tuple(weights[n].shape[1:]) for n in projections(m) if n in weights]
            odd = [s for s in shapes if s[0] % 16 or s[1] % 16]
            found[fqn] = (f"expert matrices {' and '.join(f'{a} x {b}' for a, b in odd)}: narrow GEMMs need dimensions "
                          "that are multiples of 16" if odd else None)
    return found


def routers(model: nn.Module, experts_fqns) -> dict[str, str]:
    """The routers and gates beside each experts module: FQN -> what it is."""
    found = {}
    for fqn in experts_fqns:
        parent_name, _, own = fqn.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        n_experts = next(iter(expert_weights(parent.get_submodule(own)).values())).shape[0]
        for name, child in parent.named_children():
            w = getattr(child, "weight", None)
            if name == own or not isinstance(w, torch.Tensor) or w.dim() != 2:
                continue
            if w.shape[0] == n_experts:
                found[f"{parent_name}.{name}".lstrip(".")] = f"the router of {fqn} ({n_experts} experts)"
            elif w.shape[0] == 1:
                found[f"{parent_name}.{name}".lstrip(".")] = f"a one-output gate beside {fqn}"
    return found


def convert(model: nn.Module, fqns, plan: Plan) -> dict[str, ExpertsLayer]:
    """Run the experts modules `fqns` of `model` in `plan`'s recipe: each gets its ExpertsLayer, and its
    config the "mixprec" experts implementation (registered in transformers' interface here)."""
    experts.check_recipe(plan.recipe)
    microscaled = isinstance(plan.recipe, MXRecipe)
    if microscaled:  # drawn and copied now, outside any compiled region (as MXLinear.from_linear)
        device = plan.device if plan.device not in ("meta",) else "cpu"
        plan.recipe.transform(torch.device(device))
        byte_values(torch.device(device))
    converted = {}
    for fqn in fqns:
        m = model.get_submodule(fqn)
        keys = []
        for proj in projections(m):
            name = f"{fqn}.{proj}"
            n_experts = getattr(m, proj).shape[0]
            # each expert's part of its stochastic-rounding keys, as an MXLinear's salt is its name's
            salts = tuple(zlib.crc32(f"{name}.{e}".encode()) for e in range(n_experts)) if microscaled else ()
            keys.append(experts.register(ExpertsGemm(name, plan, bool(m.is_transposed), salts,
                                                     experts.uses_grouped(plan))))
        m.mixprec_experts = converted[fqn] = ExpertsLayer(fqn, *keys, plan.compute_dtype)
        _select(m)
    return converted


def _select(module: nn.Module) -> None:
    """The module's config selects mixprec's implementation (a config is shared by a model's experts modules,
    as transformers sets it); another one chosen before is said. mixprec's own experts need nothing."""
    if not interface_experts(module):
        return
    register_implementation()
    old = module.config._experts_implementation
    if old != IMPLEMENTATION:
        if old != BASE:
            logger.info("precision: experts_implementation %r replaced by %r (transformers' experts interface; "
                        "the recipe and the base mode's dtype run there)", old, IMPLEMENTATION)
        module.config._experts_implementation = IMPLEMENTATION


def in_base_mode(model: nn.Module, fqns, dtype: torch.dtype) -> None:
    """Run the experts modules `fqns` on torch's grouped GEMM in `dtype`, their weights cast to it as
    autocast casts a Linear's (transformers' grouped_mm, which autocast does not reach, would
    compute in the weights' own dtype: FP32 master weights in FP32)."""
    for fqn in fqns:
        m = model.get_submodule(fqn)
        m.mixprec_experts = ExpertsLayer(fqn, None, None, dtype)
        _select(m)


def replan(layer: ExpertsLayer, plan: Plan) -> None:
    """The layer's projections under `plan` (its routes chosen again for another device)."""
    layer.up, layer.down = (experts.register(ExpertsGemm(g.name, plan, g.transposed, g.salts,
                                                         experts.uses_grouped(plan))) for g in layer.gemms)


def runs_narrow(module: nn.Module) -> bool:
    """Whether `module` runs its experts' GEMMs in a narrow recipe now."""
    layer = getattr(module, "mixprec_experts", None)
    return layer is not None and layer.narrow and (not interface_experts(module)
                                                   or module.config._experts_implementation == IMPLEMENTATION)


def register_implementation() -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

    if IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS:
        ExpertsInterface.register(IMPLEMENTATION, experts_forward)


def experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts forward (the arguments of its `grouped_mm`) with the projections in the recipe."""
    layer = getattr(self, "mixprec_experts", None)
    if layer is None:  # a module this process's policy did not set up
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        return ALL_EXPERTS_FUNCTIONS[BASE](self, hidden_states, top_k_index, top_k_weights)
    up, down = layer.projections(bool(self.is_transposed))
    perm, expert_ids_g, offs = experts.dispatch(top_k_index, self.num_experts)
    x = hidden_states[perm // top_k_index.shape[1]]  # (S, H)
    up_name, down_name = projections(self)
    out = up(x, getattr(self, up_name), offs)  # (S, 2I) or (S, I)
    if self.has_bias:
        out = out + getattr(self, f"{up_name}_bias")[expert_ids_g].to(out.dtype)
    out = self._apply_gate(out) if self.has_gate else self.act_fn(out)  # (S, I)
    out = down(out, self.down_proj, offs)  # (S, H)
    if self.has_bias:
        out = out + self.down_proj_bias[expert_ids_g].to(out.dtype)
    if self.has_post_expert_norm:
        out = self.post_expert_norm(out)
    return experts.combine(out, top_k_weights, perm, hidden_states.dtype)
