"""Named precision modes, the aliases users already type, and Apex's O-levels."""

from __future__ import annotations

import torch

from dataclasses import replace

from mixprec.dtypes import dtype_name, parse_dtype
from mixprec.errors import UserError
from mixprec.narrow.formats.recipe import RECIPES, FP8Recipe
from mixprec.precision.spec import PrecisionSpec, Update

FP32, BF16, FP16 = torch.float32, torch.bfloat16, torch.float16
Preset = PrecisionSpec  # a preset is a name for a spec

PRESETS: dict[str, PrecisionSpec] = {}


def register_preset(name: str, spec: PrecisionSpec) -> PrecisionSpec:
    """Make `spec` a preset: precision.preset, Policy.from_preset, compare and audit know it."""
    if name in PRESETS and PRESETS[name] != spec:
        raise ValueError(f"a preset named {name!r} is registered already")
    PRESETS[name] = spec
    ALIASES.setdefault(name, name)
    return spec


def fp8_preset(recipe: FP8Recipe) -> PrecisionSpec:
    """bf16-mixed with the block projections' GEMMs in FP8 under `recipe` (embeddings, norms,
    attention, the output projection and the loss stay as bf16-mixed has them)."""
    return PrecisionSpec(FP32, BF16, fp8=recipe, summary=f"bf16-mixed, block projections in {recipe.label} "
                         f"({recipe.summary()})"
                         + (f", AdamW moments in {dtype_name(recipe.moments_dtype)}"
                            if recipe.moments_dtype != FP32 else ""))


# Lightning's precision=..., Accelerate's mixed_precision=..., Apex's opt_level=...
ALIASES: dict[str, str] = {
    "32-true": "fp32", "32": "fp32", "no": "fp32", "float32": "fp32",
    "bf16": "bf16-mixed",
    "16-mixed": "fp16-mixed", "16": "fp16-mixed", "fp16": "fp16-mixed",
    "16-true": "fp16-true",
    "o0": "fp32", "o1": "fp16-mixed", "o2": "fp16-master", "o3": "fp16-true",
}

# Apex's documented properties of each opt_level, and the mode that has them here.
APEX_LEVELS = {
    "O0": dict(mode="fp32", cast_model_type="torch.float32", keep_batchnorm_fp32=None, master_weights=False,
               loss_scale=1.0),
    "O1": dict(mode="fp16-mixed", cast_model_type=None, keep_batchnorm_fp32=None, master_weights=None,
               loss_scale="dynamic"),
    "O2": dict(mode="fp16-master", cast_model_type="torch.float16", keep_batchnorm_fp32=True, master_weights=True,
               loss_scale="dynamic"),
    "O3": dict(mode="fp16-true", cast_model_type="torch.float16", keep_batchnorm_fp32=False, master_weights=False,
               loss_scale=1.0),
}


for _name, _spec in {
    "fp32": PrecisionSpec(FP32, FP32, summary="everything in float32"),
    "bf16-mixed": PrecisionSpec(FP32, BF16, summary="float32 parameters and optimizer states, autocast bfloat16 "
                                                    "compute"),
    "bf16-true": PrecisionSpec(BF16, BF16, summary="parameters, gradients and optimizer states in bfloat16, no "
                                                   "float32 copy; RoPE and logits in float32"),
    "bf16-kahan": PrecisionSpec(BF16, BF16, update=Update.KAHAN,
                                summary="bf16-true with a bfloat16 Kahan compensation per parameter carrying each "
                                        "update's rounding error"),
    "bf16-sr": PrecisionSpec(BF16, BF16, update=Update.STOCHASTIC,
                             summary="bf16-true with each updated weight stochastically rounded to bfloat16 (seeded)"),
    "fp16-mixed": PrecisionSpec(FP32, FP16, loss_scaling=True,
                                summary="float32 parameters, autocast float16 compute, dynamic loss scaling"),
    "fp16-master": PrecisionSpec(FP16, FP16, master_weights=True, loss_scaling=True,
                                 summary="float16 model with float32 norms, float32 master weights and optimizer "
                                         "states, dynamic loss scaling"),
    "bf16-master": PrecisionSpec(BF16, BF16, master_weights=True,
                                 summary="bfloat16 model with float32 norms, float32 master weights and optimizer "
                                         "states"),
    "fp16-true": PrecisionSpec(FP16, FP16, summary="everything in float16, no master weights, no loss scaling"),
    "bf16-mixed-8bit": PrecisionSpec(FP32, BF16, optimizer_states="8bit",
                                     summary="bf16-mixed with AdamW's moments in block-wise 8-bit codes (blocks of "
                                             "256; small tensors and embeddings keep float32 moments)"),
    "bf16-kahan-8bit": PrecisionSpec(BF16, BF16, update=Update.KAHAN, optimizer_states="8bit",
                                     summary="bf16-kahan with AdamW's moments in block-wise 8-bit codes: 6 bytes a "
                                             "parameter with its compensation"),
}.items():
    register_preset(_name, _spec)


def resolve_preset_name(name: str, field: str = "precision.preset") -> str:
    key = str(name).strip().lower()
    recipe = next((r for r in RECIPES.values() if r.preset == key), None)
    if key not in ALIASES and recipe is not None:  # a recipe registered after import
        register_preset(key, fp8_preset(recipe))
    if key not in ALIASES:
        raise UserError(
            f"{field}: unknown precision {name!r}; accepted: {', '.join(PRESETS)} "
            f"(aliases: {', '.join(k for k in ALIASES if k not in PRESETS)})"
        )
    return ALIASES[key]


def preset_for(storage_dtype: torch.dtype, param_dtype: torch.dtype) -> str | None:
    """The mode without master weights that stores and computes in these dtypes."""
    return next((name for name, p in PRESETS.items() if not p.fp8 and p.update is Update.NEAREST
                 and p.optimizer_states is None and (p.storage_dtype, p.param_dtype, p.master_weights) == (storage_dtype, param_dtype, False)), None)


def name_of(spec: PrecisionSpec) -> str:
    """The preset a spec is (reduction dtype and overrides aside), "base+fp8-recipe" for an FP8
    recipe on another base, "+FORMAT-moments" for optimizer states a preset does not have, or "custom"."""
    from dataclasses import replace

    exact = next((name for name, p in PRESETS.items() if p == replace(spec, reduce_dtype=FP32)), None)
    if exact is not None:
        return exact
    if spec.optimizer_states is not None:  # a mode's own moments in another format: "fp8-rowwise+8bit-moments"
        return f"{name_of(replace(spec, optimizer_states=None))}+{spec.optimizer_states.name}-moments"
    plain = replace(spec, reduce_dtype=FP32, overrides=(), fp8=None)
    base = next((name for name, p in PRESETS.items() if p == plain), "custom")
    if spec.fp8 is None:
        return base
    fp8_name = spec.fp8.preset
    return fp8_name if base == "bf16-mixed" and fp8_name in PRESETS else f"{base}+{fp8_name}"


for _recipe in RECIPES.values():
    register_preset(_recipe.preset, fp8_preset(_recipe))
FP8_BASES = ("fp32", "bf16-mixed", "bf16-master", "bf16-true")  # modes an FP8 recipe may build on


def spec_of_preset(name: str, labels: dict[str, str], fp8_recipe: str, fp8_options: dict | None, overrides,
                   settings: dict) -> PrecisionSpec:
    """The spec of preset `name` (or an alias) with Policy.from_preset's keywords applied;
    the dtype keywords are taken out of `settings`."""
    preset_name = resolve_preset_name(name, labels.get("preset", "preset"))
    spec = PRESETS[preset_name]
    for key in ("storage_dtype", "param_dtype", "reduce_dtype"):
        if key not in settings:
            continue
        label, dtype = labels.get(key, key), parse_dtype(settings.pop(key), labels.get(key, key))
        if key != "reduce_dtype" and dtype != getattr(spec, key):
            raise UserError(f"{labels.get('preset', 'preset')} = {name!r} contradicts {label} = "
                            f"{dtype_name(dtype)!r}: {preset_name} has {key} {dtype_name(getattr(spec, key))}; "
                            "drop one of the two")
        spec = replace(spec, **{key: dtype})
    states = settings.pop("optimizer_states", None)
    if states is not None:
        spec = replace(spec, optimizer_states=states)
    if spec.fp8 and fp8_recipe and fp8_recipe != spec.fp8.name:
        raise UserError(f"{labels.get('preset', 'preset')} = {name!r} contradicts fp8.recipe = {fp8_recipe!r}: "
                        f"{preset_name} has the {spec.fp8.name} recipe; drop one of the two")
    recipe = spec.fp8 or (FP8Recipe.from_name(fp8_recipe) if fp8_recipe else None)
    if recipe is not None:
        recipe = recipe.with_options(**(fp8_options or {}))
    return replace(spec, fp8=recipe, overrides=spec.overrides + tuple(overrides))
