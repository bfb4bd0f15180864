"""The one entry point: swap a model's Linear layers for FP8 ones.

    conversion = convert_to_fp8(model, recipe, compute_dtype=torch.bfloat16)
    ...                                  # train; after each optimizer step:
    conversion.after_step()              # delayed scaling: push the amaxes into the history

Which layers: plain nn.Linear modules (not subclasses: their forward may do more than the
GEMM) whose dimensions are multiples of 16 (torch's FP8 kernels need them), less the
model's output projection, whatever it is called (`output_projections`), those matching a
pattern of `exclude` (a substring of the module name or an fnmatch glob), and, when given,
only those `module_filter_fn(fqn, module)` accepts. Every layer left out is logged with
its reason.
"""

from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from mixprec.narrow.formats import blockwise_cast
from mixprec.narrow.experts import ops as experts
from mixprec.narrow.experts import hf as hf_experts
from mixprec.narrow.experts.routes import describe as experts_route
from mixprec.narrow.experts.layer import ExpertsLayer
from mixprec.narrow.gemm.fp8 import KERNELS, route
from mixprec.narrow.linear.fp8 import FP8Linear, Plan, linear_class, replan
from mixprec.narrow.formats.recipe import E4M3, GEMMS, FP8Recipe, Granularity
from mixprec.narrow.formats.scaling import DelayedScales
from mixprec.dtypes import dtype_name

logger = logging.getLogger(__name__)

DEFAULT_EXCLUDE = ()


def matches(fqn: str, patterns) -> str | None:
    return next((p for p in patterns if p in fqn or fnmatch.fnmatchcase(fqn, p)), None)


def output_projections(model: nn.Module) -> dict[str, str]:
    """The Linear layers that make the model's logits, by name, with how each was found:
    the model's own word (Hugging Face's get_output_embeddings()), a weight tied to a token
    embedding, or else, in a model with token embeddings, the last Linear it registers (where
    a decoder puts its head; a model without embeddings has no vocabulary to project to).
    The logits feed a softmax over the vocabulary: FP8 there costs accuracy and saves little."""
    linears = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, nn.Linear)]
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    found = {}
    for fqn, m in linears:
        if head is not None and m is head:
            found[fqn] = "the output projection (the model's get_output_embeddings())"
        elif id(m.weight) in embedded:
            found[fqn] = "the output projection (its weight is tied to the token embedding)"
    if not found and linears and embedded:
        found[linears[-1][0]] = "the output projection (the model's last Linear)"
    return found


def why_not(fqn: str, module: nn.Module, exclude=DEFAULT_EXCLUDE, outputs: dict[str, str] | None = None) -> str | None:
    """The reason a module stays in the base mode, or None for a layer to convert.
    outputs: the model's output projections (`output_projections`)."""
    if not isinstance(module, nn.Linear):
        return "not a Linear"
    if outputs and fqn in outputs:
        return outputs[fqn]
    if type(module) is not nn.Linear:
        return f"{type(module).__name__} is not a plain nn.Linear (its forward does more than the GEMM)"
    pattern = matches(fqn, exclude)
    if pattern is not None:
        return f"matches fp8.filter_fqns pattern {pattern!r}"
    if module.in_features % 16 or module.out_features % 16:
        return f"{module.in_features} x {module.out_features}: FP8 GEMMs need dimensions that are multiples of 16"
    return None


def experts_why_not(fqn: str, module: nn.Module, recipe: FP8Recipe, reason: str | None, exclude=DEFAULT_EXCLUDE,
                    module_filter_fn=None) -> str | None:
    """The reason an experts module stays in the base mode under `recipe`, or None to convert it.
    reason: what hf_experts.find_experts said of it (None: a recipe can take it)."""
    if reason is None and recipe.delayed:
        reason = experts.DELAYED
    if reason is None and (pattern := matches(fqn, exclude)) is not None:
        reason = f"matches fp8.filter_fqns pattern {pattern!r}"
    if reason is None and module_filter_fn is not None and not module_filter_fn(fqn, module):
        reason = "refused by module_filter_fn"
    return reason


@dataclass
class Conversion:
    """The result of a conversion: what runs in FP8, what does not and why, and the GEMM
    route (torch's kernel, or the emulation and why) of each of the three GEMMs."""
    recipe: FP8Recipe
    modules: dict[str, FP8Linear] = field(default_factory=dict)
    experts: dict[str, ExpertsLayer] = field(default_factory=dict)  # experts modules, per expert in the recipe
    left_out: dict[str, str] = field(default_factory=dict)
    routes: dict[str, str | None] = field(default_factory=dict)  # GEMM -> None (kernel) or why emulated
    device: str = "cpu"  # where the GEMMs run

    def after_step(self) -> None:
        """Delayed scaling: fold each step's amaxes into the history and derive the next
        scales. Across processes the amaxes are first reduced to their maximum, so every
        rank casts with the same scales."""
        if not self.recipe.delayed:  # current scaling keeps no state between steps
            return
        delayed = list(self.modules.values())
        pending = torch.stack([m.amax_pending for m in delayed])  # (layers, 3)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(pending, op=torch.distributed.ReduceOp.MAX)
        dtypes = (E4M3, E4M3, self.recipe.grad_dtype)
        for m, p in zip(delayed, pending):
            m.amax_pending.copy_(p)
            DelayedScales.advance(m.amax_history, m.amax_pending, m.scale, dtypes, self.recipe.amax_compute_algo,
                                  self.recipe.margin)

    def state_dict(self) -> dict:
        return {"recipe": self.recipe.name,
                "delayed": {name: {"amax_history": m.amax_history.cpu(), "scale": m.scale.cpu()}
                            for name, m in self.modules.items() if self.recipe.delayed}}

    def load_state_dict(self, state: dict) -> None:
        if not self.recipe.delayed:
            return
        saved = state.get("delayed", {})
        for name, m in self.modules.items():
            if name not in saved:
                logger.warning("fp8: the checkpoint has no amax history for %s (saved by %s); it starts afresh",
                               name, state.get("recipe"))
                continue
            history = saved[name]["amax_history"]
            n = min(history.shape[1], m.amax_history.shape[1])  # a changed amax_history_len keeps the newest
            m.amax_history.zero_()
            m.amax_history[:, :n].copy_(history[:, :n])
            m.scale.copy_(saved[name]["scale"])

    def move(self, device: str) -> None:
        """Its layers compute on `device` now: their routes chosen there (mixprec.narrow.linear.fp8.replan,
        which a layer's .to also runs), and this record of them kept in step."""
        for m in self.modules.values():
            m.plan = replan(m.plan, type(m), device)
        for layer in self.experts.values():
            layer.on(device)
        plans = [m.plan for m in self.modules.values()] + [layer.gemms[0].plan for layer in self.experts.values()]
        if plans and plans[0].device != self.device:  # not where the user asked for the emulation
            self.device = device
            self.routes = linear_class(self.recipe).routes(self.recipe, device, plans[0].compute_dtype)

    def kernels(self) -> dict[str, str]:
        """Each GEMM's kernel by name (mixprec.narrow.gemm.fp8.KERNELS), or "emulated"."""
        layout = self.recipe.granularity.value  # the three GEMMs of one recipe share its layout
        return {g: "emulated" if why is not None else
                KERNELS.get(route(layout, self.device, self.recipe.fast_accum and g == GEMMS[0]), "torch's kernel")
                for g, why in self.routes.items()}

    def describe(self) -> str:
        kernels = ", ".join(f"{g}: {kernel}" for g, kernel in self.kernels().items())
        said = f"{len(self.modules)} Linear layers in {self.recipe.label} ({self.recipe.name}: {self.recipe.summary()}; {kernels})"
        if self.experts:
            plan = next(iter(self.experts.values())).gemms[0].plan
            said += (f"; {len(self.experts)} experts modules in {self.recipe.label}, each expert scaled on its own "
                     f"({experts_route(plan)})")
        return said


def _log_blockwise(conversion: Conversion) -> None:
    """Block-wise's choices, said here once rather than from inside a compiled graph: torch's
    block-wise kernel takes whole 128-tiles only, so a layer narrower than that, or a
    micro-batch of tokens that is not a whole number of tiles, has its GEMMs emulated
    (mixprec.narrow.gemm.fp8.scaled_mm); and whether the backward casts run on the Triton kernel
    (probed here, mixprec.narrow.formats.blockwise_cast)."""
    r = conversion.recipe
    if r.granularity is not Granularity.BLOCKWISE or all(why is not None for why in conversion.routes.values()):
        return
    partial = {}
    for fqn, m in conversion.modules.items():
        if m.in_features % r.block or m.out_features % r.block:
            partial.setdefault(f"{m.in_features} x {m.out_features}", []).append(fqn)
    for shape, fqns in partial.items():
        logger.info("fp8: %s (%s) run their block-wise GEMMs emulated: torch's block-wise kernel takes whole "
                    "%d-element tiles only", ", ".join(fqns), shape, r.block)
    logger.info("fp8: a micro-batch whose token count is not a multiple of %d runs its block-wise weight-gradient "
                "GEMMs emulated, for the same reason", r.block)
    blockwise_cast.probe(conversion.device)  # logs where the casts run, once per device


def convert_to_fp8(model: nn.Module, recipe: FP8Recipe, *, compute_dtype: torch.dtype,
                   exclude=DEFAULT_EXCLUDE, module_filter_fn=None, emulate: bool | None = None,
                   modules=None, device_type: str | None = None, experts=None) -> Conversion:
    """Replace the chosen nn.Linear modules of `model` in place by FP8Linear modules that
    hold the same parameters, and run the chosen experts modules of a mixture-of-experts
    model in the recipe (mixprec.narrow.experts.hf). Returns the Conversion (and logs it).

    modules, experts: the FQNs of the Linear layers and of the experts modules to convert,
    already chosen (a precision layout's); the filters and the left-out log lines are then
    the chooser's business.

    device_type: where the GEMMs will run (default: the parameters' device; a model built on
    the meta device to be loaded later says where it will be materialised).

    emulate: True runs every GEMM on the emulation (FP32 GEMMs on the FP8 values, the same
    numerics); False or None: torch's kernel wherever the probe finds one. On this project's
    CPUs both ran at the same speed, 0.6-0.7x an FP32 GEMM (benchmarks/bench_gemm.py)."""
    device = device_type or next(model.parameters()).device.type
    conversion = Conversion(recipe, device=device)
    cls = linear_class(recipe)
    if emulate:
        conversion.routes = {g: "fp8.emulate = true" for g in GEMMS}
    elif device == "meta":  # nothing runs on meta: the routes are chosen where the layers are materialised (replan)
        conversion.routes = {g: "not chosen yet: the layers are on the meta device" for g in GEMMS}
    else:
        conversion.routes = cls.routes(recipe, device, compute_dtype)
    plan = Plan(recipe, recipe.tiles, compute_dtype, tuple(why is None for why in conversion.routes.values()),
                device=device, emulated=bool(emulate))
    outputs = output_projections(model)
    chosen = None if modules is None else set(modules)
    for fqn, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or (chosen is not None and fqn not in chosen):
            continue
        reason = None if chosen is not None else why_not(fqn, module, exclude, outputs)
        if reason is None and module_filter_fn is not None and not module_filter_fn(fqn, module):
            reason = "refused by module_filter_fn"
        if reason is not None:
            conversion.left_out[fqn] = reason
            continue
        parent_name, _, child = fqn.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        new = cls.from_linear(module, plan, fqn)
        setattr(parent, child, new)
        conversion.modules[fqn] = new
    if experts is None:
        experts = []
        for fqn, found in hf_experts.find_experts(model).items():
            reason = experts_why_not(fqn, model.get_submodule(fqn), recipe, found, exclude, module_filter_fn)
            if reason is None:
                experts.append(fqn)
            else:
                conversion.left_out[fqn] = reason
    conversion.experts = hf_experts.convert(model, experts, plan) if experts else {}
    logger.info("fp8: %s", conversion.describe())
    _log_blockwise(conversion)
    for fqn, reason in conversion.left_out.items():
        logger.info("fp8: %s stays in %s: %s", fqn, dtype_name(compute_dtype), reason)
    if device == "meta" and not emulate:
        logger.info("fp8: the GEMMs' routes are chosen where the layers are materialised (on the meta device now; "
                    "convert_to_fp8's device_type names the device ahead)")
        return conversion
    reasons = {}
    for gemm, why in conversion.routes.items():
        if why is not None:
            reasons.setdefault(why, []).append(gemm)
    for why, gemms in reasons.items():
        logger.info("fp8: %s GEMMs emulated on this %s (%s): %s", ", ".join(gemms), device, recipe.emulation(device),
                    why)
    return conversion
