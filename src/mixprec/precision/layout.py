"""A precision spec resolved against a model: one row per module that holds parameters or
runs a matmul, saying what its parameters are stored in and what its matmuls compute in,
and why. `describe` prints it, the audit checks each module against it, the memory
planner turns it into bytes, and the policy applies it (FP8 conversion, compute overrides).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mixprec.dtypes import dtype_name
from mixprec.errors import UserError
from mixprec.narrow.convert import experts_why_not, output_projections, why_not
from mixprec.narrow.experts.hf import expert_weights, find_experts, routers
from mixprec.narrow.formats.mx import kept_blocks
from mixprec.narrow.formats.recipe import FP8Recipe
from mixprec.precision.master import is_norm
from mixprec.precision.spec import FP32, Format, PrecisionSpec, format_name

# reasons FP8 cannot take a Linear whatever a rule says: its shape or its forward
_STRUCTURAL = ("not a Linear", "is not a plain nn.Linear", "multiples of 16")


@dataclass(frozen=True)
class ModulePrecision:
    kind: str  # linear, matmul, experts, router, norm, embedding or other
    storage: torch.dtype  # its own parameters
    compute: Format | None  # its matmuls; None for a module without a matmul of its own
    why: str  # where the compute format comes from
    features: int = 0  # a Linear's in x out features (its GEMM FLOPs per token, up to a factor 6); experts: top-k's

    @property
    def compute_name(self) -> str:
        return format_name(self.compute) if self.compute is not None else "-"


@dataclass(frozen=True)
class Layout:
    spec: PrecisionSpec
    modules: dict[str, ModulePrecision]

    def linears(self) -> dict[str, ModulePrecision]:
        return {fqn: m for fqn, m in self.modules.items() if m.kind == "linear"}

    def fp8(self, recipe: FP8Recipe | None = None, kind: str = "linear") -> dict[str, FP8Recipe]:
        """The Linear layers (kind "experts": the experts modules) in a narrow recipe (`recipe` only,
        when given), with their recipe."""
        return {fqn: m.compute for fqn, m in self.modules.items() if isinstance(m.compute, FP8Recipe)
                and m.kind == kind and (recipe is None or m.compute == recipe)}

    def experts(self, recipe: FP8Recipe | None = None) -> dict[str, FP8Recipe]:
        return self.fp8(recipe, kind="experts")

    def routers(self) -> dict[str, ModulePrecision]:
        return {fqn: m for fqn, m in self.modules.items() if m.kind == "router"}

    def recipes(self) -> list[FP8Recipe]:
        return list(dict.fromkeys([*self.fp8().values(), *self.experts().values()]))

    def dtype_overrides(self) -> dict[str, torch.dtype]:
        """Linear layers and routers whose compute dtype differs from the base mode's."""
        return {fqn: m.compute for fqn, m in self.modules.items() if m.kind in ("linear", "router")
                and isinstance(m.compute, torch.dtype) and m.compute != self.spec.param_dtype}

    def left_out(self) -> dict[str, str]:
        """Linear layers (and other matmul modules) not in FP8 although the base mode has a
        recipe, with why."""
        if self.spec.fp8 is None:
            return {}
        return {fqn: m.why for fqn, m in self.modules.items()
                if m.kind in ("linear", "matmul", "experts") and not isinstance(m.compute, FP8Recipe)}

    def flops_by_format(self, exclude=()) -> dict[str, float]:
        """Each compute format's share of the Linear layers' and experts' GEMM FLOPs (all three
        GEMMs of a layer scale with in x out features, per token alike; a token runs top-k of
        the experts), less the `exclude` FQNs."""
        flops = {}
        for fqn, m in self.modules.items():
            if m.kind not in ("linear", "experts"):
                continue
            if fqn not in exclude:
                flops[m.compute_name] = flops.get(m.compute_name, 0) + m.features
        total = sum(flops.values())
        return {k: v / total for k, v in sorted(flops.items())} if total else {}

    def table(self) -> list[tuple[str, str, str, str]]:
        """(module, storage, compute, why) rows, for printing."""
        return [(fqn or "(root)", dtype_name(m.storage), m.compute_name, m.why)
                for fqn, m in self.modules.items()]


def _kind(module: nn.Module, fqn: str) -> str:
    if isinstance(module, nn.Linear):
        return "linear"
    if type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None:
        return "matmul"  # transformers' GPT-2 projection: x @ W + b, W stored (in, out)
    if isinstance(module, nn.Embedding):
        return "embedding"
    return "norm" if is_norm(fqn, module) else "other"


def resolve(spec: PrecisionSpec, model: nn.Module, *, exclude=(), module_filter_fn=None,
            sharded: bool = False) -> Layout:
    """The per-module table of `spec` on `model`. exclude: FQN patterns FP8 leaves out (the
    config's fp8.filter_fqns); module_filter_fn(fqn, module): False leaves a layer out of FP8;
    sharded: fully_shard keeps the parameters (FP32 masters included) itself."""
    outputs = output_projections(model)
    kept = _kept_blocks(spec, model)
    experts = find_experts(model)
    gates = routers(model, experts)
    rows = {}
    for fqn, module in model.named_modules():
        own = [p for p in module.parameters(recurse=False) if p.is_floating_point()]
        kind = "experts" if fqn in experts else "router" if fqn in gates else _kind(module, fqn)
        if not own and kind != "linear":
            continue
        storage = spec.storage_dtype
        if spec.master_weights:
            storage = FP32 if sharded or kind == "norm" else storage  # Apex O2 keeps norms FP32
        if kind == "router":
            rows[fqn] = ModulePrecision(kind, FP32, FP32, f"{gates[fqn]}: routers stay out of the narrow formats, their "
                                        "weights, logits and scores in float32 (DeepSeek-V3 keeps the gating in "
                                        "higher precision)")
            continue
        if kind == "experts":
            rows[fqn] = _experts_row(spec, fqn, module, storage, experts[fqn], exclude, module_filter_fn, kept)
            continue
        if kind == "matmul":
            rows[fqn] = ModulePrecision(kind, storage, spec.param_dtype, f"a {type(module).__name__}, not an nn.Linear: "
                                        "FP8 and per-module overrides convert nn.Linear layers only")
            continue
        if kind != "linear":
            rows[fqn] = ModulePrecision(kind, storage, None, "no matmul of its own")
            continue
        compute, why = spec.param_dtype, "the base mode"
        if spec.fp8 is not None:
            reason = why_not(fqn, module, exclude, outputs)
            if reason is None and module_filter_fn is not None and not module_filter_fn(fqn, module):
                reason = "refused by module_filter_fn"
            if reason is None:
                reason = next((why for prefix, why in kept.items() if fqn.startswith(prefix)), None)
            compute, why = (spec.fp8, "the base mode's FP8 recipe") if reason is None else (spec.param_dtype, reason)
        rule = spec.override_for(fqn)
        if rule is not None:
            if isinstance(rule.compute, FP8Recipe):
                reason = why_not(fqn, module)
                if reason is not None and any(s in reason for s in _STRUCTURAL):
                    why = f"{rule.why} cannot apply: {reason}"
                else:
                    compute, why = rule.compute, rule.why
            else:
                compute, why = rule.compute, rule.why
        rows[fqn] = ModulePrecision(kind, storage, compute, why, module.in_features * module.out_features)
    _check_planned(spec, rows)
    return Layout(spec, rows)


def _experts_row(spec: PrecisionSpec, fqn: str, module: nn.Module, storage: torch.dtype, reason: str | None,
                 exclude, module_filter_fn, kept: dict[str, str]) -> ModulePrecision:
    """An experts module: in the base mode's recipe, or in the base mode and why."""
    weights = expert_weights(module)
    n_experts = next(iter(weights.values())).shape[0]
    config = getattr(module, "config", None)
    top_k = getattr(module, "top_k", None) or getattr(config, "num_experts_per_tok", n_experts)
    params = sum(p.numel() for p in weights.values()) * min(top_k, n_experts) // n_experts  # a token's share
    rule = spec.override_for(fqn)
    if rule is not None and isinstance(rule.compute, FP8Recipe):  # a plan's or the user's recipe for it
        why = experts_why_not(fqn, module, rule.compute, reason, exclude=())
        if why is None:
            return ModulePrecision("experts", storage, rule.compute, f"{rule.why}, per expert", params)
        return ModulePrecision("experts", storage, spec.param_dtype, f"{rule.why} cannot apply: {why}", params)
    if rule is not None and rule.compute == spec.param_dtype:
        return ModulePrecision("experts", storage, spec.param_dtype, rule.why, params)
    if rule is not None:
        raise UserError(f"{rule.source or 'precision.override'}: experts module {fqn!r} cannot compute in "
                        f"{format_name(rule.compute)}; accepted for experts: the base mode's "
                        f"{dtype_name(spec.param_dtype)} or a current-scaling narrow recipe")
    if spec.fp8 is None:
        return ModulePrecision("experts", storage, spec.param_dtype, "the base mode", params)
    reason = experts_why_not(fqn, module, spec.fp8, reason, exclude, module_filter_fn)
    if reason is None:
        reason = next((why for prefix, why in kept.items() if fqn.startswith(prefix)), None)
    if reason is None:
        return ModulePrecision("experts", storage, spec.fp8, "the base mode's narrow recipe, per expert", params)
    return ModulePrecision("experts", storage, spec.param_dtype, reason, params)


def decoder_blocks(model: nn.Module) -> tuple[str, int] | None:
    """(FQN, length) of the model's decoder layers: its longest nn.ModuleList (as models.hf.decoder_layers)."""
    lists = [(fqn, len(m)) for fqn, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    return max(lists, key=lambda t: t[1]) if lists else None


def _kept_blocks(spec: PrecisionSpec, model: nn.Module) -> dict[str, str]:
    """The decoder blocks a recipe's keep_last_blocks keeps in the base mode: FQN prefix -> why."""
    share = getattr(spec.fp8, "keep_last_blocks", 0.0)
    if not share:
        return {}
    found = decoder_blocks(model)
    if found is None:
        return {}
    name, n = found
    k = kept_blocks(n, share)
    why = (f"{spec.fp8.preset} keeps the last {share:.0%} of the decoder blocks ({k} of {n}: {name}.{n - k}"
           f"{f'-{n - 1}' if k > 1 else ''}) in {dtype_name(spec.param_dtype)} (fp8.keep_last_blocks)")
    return {f"{name}.{i}.": why for i in range(n - k, n)}


def _check_planned(spec: PrecisionSpec, rows: dict[str, ModulePrecision]) -> None:
    """A rule for one named module (a plan file's) must name a Linear layer or an experts module of this model."""
    planned = [o for o in spec.overrides if o.source]
    linears = sorted(fqn for fqn, m in rows.items() if m.kind in ("linear", "experts"))
    missing = [o.modules for o in planned if o.modules not in linears]
    if missing:
        raise UserError(f"{planned[0].source}: no Linear layer {missing[0]!r} in the model ({len(missing)} of its "
                        f"{len(planned)} layers missing); accepted: a plan of this model, whose Linear layers are "
                        f"named like {', '.join(linears[:3])}")
