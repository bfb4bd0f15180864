"""The experts of Hugging Face mixture-of-experts models in a narrow recipe, through
transformers' own seam: an experts implementation registered in its `ExpertsInterface`
("mixprec") and selected by the model's `experts_implementation`, as transformers' own
`grouped_mm` is. It runs the same routing as `grouped_mm` (tokens sorted by expert, the
cumulative end offsets, the gate, the routing weights, the combine), with each projection
on mixprec.narrow.experts.ops; an experts module left in the base mode runs torch's grouped GEMM
in the base compute dtype (`in_base_mode`). A module it was not set up for runs transformers'
`grouped_mm`.

Which modules are experts: the classes transformers' `use_experts_implementation` decorates
(qwen3_moe, qwen2_moe, mixtral, olmoe, deepseek_v3, phimoe, gpt_oss (transposed, biased,
interleaved), ...), known by what the decorator gives every release's instances: a `config`
with `_experts_implementation`, `is_transposed` and `has_bias`. The other layout flags came
release by release (`has_gate` in 5.3, `is_concatenated` in 5.8, `_is_expert_parallel` in
5.18, `has_post_expert_norm` in 5.20); where a release lacks one, the module has the layout
its default names (before 5.3 every decorated class held `gate_up_proj`), read by `flag`. A
module holding 3-D expert weights outside the interface (Llama 4's experts run a bmm; dbrx,
jetmoe) cannot be reached there: it stays in the base mode, named in the log and the audit.

Which modules are routers, by role rather than class or name (Llama 4's and PhiMoE's routers
subclass nn.Linear; HunYuan's is `gate.wg`, AFMoE's `router.gate`, Gemma 4's `router.proj`):
the one matrix of a sibling of an experts module (the sibling itself, or a wrapper around it)
that maps the experts' input to one score per expert, and one-output gates beside them
(Qwen2-MoE's shared_expert_gate). A sibling holding more than one matrix (a shared expert,
attention) is no router. They stay out of every narrow format, with their logits and score
function in FP32 (mixprec.precision.layout).

The implementation is selected on the config object the experts modules hold, which models
built from one config share; so the model set up gets its own copy of its configs first
(`_own_configs`): another model of the same config keeps the implementation it had.
"""

from __future__ import annotations

import copy
import logging
import zlib

import torch
from torch import nn

from mixprec.narrow.experts import ops as experts
from mixprec.narrow.experts.layer import ExpertsLayer, combine, dispatch
from mixprec.narrow.experts.ops import ExpertsGemm
from mixprec.narrow.experts.routes import uses_grouped
from mixprec.narrow.linear.fp8 import Plan
from mixprec.narrow.formats.microscaling import byte_values
from mixprec.narrow.formats.mx import MXRecipe

logger = logging.getLogger(__name__)

IMPLEMENTATION = "mixprec"  # the key in transformers' ExpertsInterface
BASE = "grouped_mm"  # what an unconverted experts module runs under it: transformers' own grouped GEMMs
OWN = "mixprec_seam"  # a class attribute of experts modules that run mixprec's ExpertsLayer themselves


def interface_experts(module: nn.Module) -> bool:
    """A module whose forward transformers' experts interface dispatches (use_experts_implementation):
    what every release's decorator sets on it (5.0 onwards)."""
    return hasattr(module, "is_transposed") and hasattr(module, "has_bias") and hasattr(module, "config") \
        and hasattr(module.config, "_experts_implementation")


# a flag the decorator sets from some release on -> the layout of a module from a release before it
# (`is_transposed` and `has_bias` every release sets: read as they are)
_BEFORE = {"has_gate": lambda m: hasattr(m, "gate_up_proj"), "has_post_expert_norm": lambda m: False,
           "_is_expert_parallel": lambda m: False}


def flag(module: nn.Module, name: str) -> bool:
    """A layout flag of an experts module, on any transformers release (`_BEFORE`)."""
    value = getattr(module, name, None)
    return bool(_BEFORE[name](module) if value is None else value)


def runs_here(module: nn.Module) -> bool:
    """A module whose experts mixprec can run: transformers' interface, or one that declares the seam
    itself (mixprec's own MoE: `mixprec.models.moe.Experts`, whose forward runs its ExpertsLayer)."""
    return getattr(module, OWN, False) or interface_experts(module)


def expert_weights(module: nn.Module) -> dict[str, nn.Parameter]:
    """A module's own 3-D floating parameters: one matrix per expert."""
    return {n: p for n, p in module.named_parameters(recurse=False) if p.dim() == 3 and p.is_floating_point()}


def projections(module: nn.Module) -> tuple[str, str]:
    return ("gate_up_proj" if flag(module, "has_gate") else "up_proj"), "down_proj"


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
        elif flag(m, "_is_expert_parallel"):
            found[fqn] = "expert-parallel experts (tokens exchanged between ranks) are not converted yet"
        else:
            shapes = [tuple(weights[n].shape[1:]) for n in projections(m) if n in weights]
            odd = [s for s in shapes if s[0] % 16 or s[1] % 16]
            found[fqn] = (f"expert matrices {' and '.join(f'{a} x {b}' for a, b in odd)}: narrow GEMMs need dimensions "
                          "that are multiples of 16" if odd else None)
    return found


def _matrices(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """(FQN within `module`, submodule) of each submodule holding a 2-D `weight`, `module` itself included."""
    return [(name, m) for name, m in module.named_modules()
            if isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() == 2]


def _experts_list(module: nn.Module) -> tuple[int, set[int]] | None:
    """(experts, their input features) of a ModuleList of two or more alike MLPs (the experts of a
    model, or a release, outside the experts interface, each expert its own Linear layers), else None."""
    if not isinstance(module, nn.ModuleList) or len(module) < 2 or len({type(m) for m in module}) != 1:
        return None
    first = _matrices(module[0])
    return (len(module), {m.weight.shape[1] for _, m in first}) if first else None


def routers(model: nn.Module, experts_fqns) -> dict[str, str]:
    """The routers and gates beside each experts module, by role: FQN -> what it is. A sibling of the
    experts module (or a wrapper among its siblings) whose one matrix maps the experts' input
    features to one score per expert is its router; one to a single output, a gate. Experts held as
    a ModuleList of alike MLPs have theirs found the same way."""
    found = {}
    shapes = {}  # experts FQN -> (experts, the features a router of theirs reads)
    for fqn in experts_fqns:
        weight = next(iter(expert_weights(model.get_submodule(fqn)).values()))  # (E, N, K) or (E, K, N)
        shapes[fqn] = weight.shape[0], set(weight.shape[1:])
    for fqn, m in model.named_modules():
        if fqn not in shapes and (listed := _experts_list(m)) is not None:
            shapes[fqn] = listed
    for fqn, (n_experts, features) in shapes.items():
        parent_name, _, own = fqn.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        for name, child in parent.named_children():
            matrices = _matrices(child) if name != own else []
            if len(matrices) != 1:  # none, or a shared expert / attention: several matrices
                continue
            sub, m = matrices[0]
            rows, cols = m.weight.shape
            if cols not in features:
                continue
            at = ".".join(part for part in (parent_name, name, sub) if part)
            if rows == n_experts:
                found[at] = f"the router of {fqn} ({n_experts} experts)"
            elif rows == 1:
                found[at] = f"a one-output gate beside {fqn}"
    return found


def convert(model: nn.Module, fqns, plan: Plan) -> dict[str, ExpertsLayer]:
    """Run the experts modules `fqns` of `model` in `plan`'s recipe: each gets its ExpertsLayer, and its
    config the "mixprec" experts implementation (registered in transformers' interface here)."""
    experts.check_recipe(plan.recipe)
    _own_configs(model, fqns)
    microscaled = isinstance(plan.recipe, MXRecipe)
    if microscaled:  # drawn and copied now, outside any compiled region (as MXLinear.from_linear)
        device = plan.device if plan.device not in ("meta",) else "cpu"
        plan.recipe.transform(torch.device(device))
        byte_values(torch.device(device))
    converted = {}
    for fqn in fqns:
        m = model.get_submodule(fqn)
        gemms = []
        for proj in projections(m):
            name = f"{fqn}.{proj}"
            n_experts = getattr(m, proj).shape[0]
            # each expert's part of its stochastic-rounding keys, as an MXLinear's salt is its name's
            salts = tuple(zlib.crc32(f"{name}.{e}".encode()) for e in range(n_experts)) if microscaled else ()
            gemms.append(ExpertsGemm(name, plan, bool(m.is_transposed), salts, uses_grouped(plan)))
        where = getattr(m, projections(m)[1]).device
        # the salts beside the weights; a meta model's on the host until it is materialised (FollowsMoves)
        m.mixprec_experts = converted[fqn] = ExpertsLayer(fqn, *gemms, plan.compute_dtype,
                                                          "cpu" if where.type == "meta" else str(where))
        m.mixprec_moves = FollowsMoves(m.mixprec_experts, where)
        _select(m)
    return converted


def _own_configs(model: nn.Module, fqns) -> None:
    """Give `model` its own copies of the configs its experts modules `fqns` would switch: every module of
    `model` holding one of them gets the copy (the model's `config` too, so it reads what runs), and a
    model built from the same config object keeps the experts implementation it had."""
    shared = {id(c): c for fqn in fqns if interface_experts(m := model.get_submodule(fqn))
              and (c := m.config)._experts_implementation != IMPLEMENTATION}
    if not shared:
        return
    memo = {}  # id(original) -> copy, for every object copied: a text config inside a model's is copied once
    copy.deepcopy(list(shared.values()), memo)
    for m in model.modules():
        held = getattr(m, "config", None)
        if held is not None and id(held) in memo:
            m.config = memo[id(held)]


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
    _own_configs(model, fqns)
    for fqn in fqns:
        m = model.get_submodule(fqn)
        m.mixprec_experts = ExpertsLayer(fqn, None, None, dtype)
        _select(m)


class FollowsMoves(nn.Module):
    """A narrow experts module's child that its moves reach (.to, .cuda, to_empty run every child's
    `_apply`, as they run FP8Linear's): the layer's GEMM routes are chosen again on the new device. It
    holds no parameter and no state_dict entry: an empty buffer says where the module is now."""

    def __init__(self, layer: ExpertsLayer, device: torch.device):
        super().__init__()
        self.layer = layer
        self.register_buffer("where", torch.empty(0, device=device), persistent=False)

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self.layer.on(str(self.where.device))
        return out


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
    if top_k_weights.shape[-1] != top_k_index.shape[-1]:  # transformers before 5.2: DeepSeek-V2's (T, E) weights
        top_k_weights = top_k_weights.gather(-1, top_k_index)
    perm, expert_ids_g, offs = dispatch(top_k_index, self.num_experts)
    x = hidden_states[perm // top_k_index.shape[1]]  # (S, H)
    up_name, down_name = projections(self)
    out = up(x, getattr(self, up_name), offs)  # (S, 2I) or (S, I)
    if self.has_bias:
        out = out + getattr(self, f"{up_name}_bias")[expert_ids_g].to(out.dtype)
    out = self._apply_gate(out) if flag(self, "has_gate") else self.act_fn(out)  # (S, I)
    out = down(out, self.down_proj, offs)  # (S, H)
    if self.has_bias:
        out = out + self.down_proj_bias[expert_ids_g].to(out.dtype)
    if flag(self, "has_post_expert_norm"):
        out = self.post_expert_norm(out)
    return combine(out, top_k_weights, perm, hidden_states.dtype)
