"""Named precision modes, the aliases users already type, and Apex's O-levels."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mixprec.errors import UserError

FP32, BF16, FP16 = torch.float32, torch.bfloat16, torch.float16


@dataclass(frozen=True)
class Preset:
    storage_dtype: torch.dtype  # the model's parameters (TorchTitan's training.dtype)
    param_dtype: torch.dtype  # compute (TorchTitan's mixed_precision_param)
    master_weights: bool = False  # FP32 copies live with the optimizer; norms stay FP32 in the model
    loss_scaling: bool = False  # dynamic loss scaling
    summary: str = ""
    fp8: str = ""  # an FP8 recipe (mixprec.fp8) for the block projections, on top of the fields above
    update: str = ""  # how a low-precision weight takes its update (mixprec.optim.updates): kahan, stochastic


PRESETS: dict[str, Preset] = {
    "fp32": Preset(FP32, FP32, summary="everything in float32"),
    "bf16-mixed": Preset(FP32, BF16, summary="float32 parameters and optimizer states, autocast bfloat16 compute"),
    "bf16-true": Preset(BF16, BF16, summary="parameters, gradients and optimizer states in bfloat16, no float32 "
                                             "copy; RoPE and logits in float32"),
    "bf16-kahan": Preset(BF16, BF16, update="kahan",
                         summary="bf16-true with a bfloat16 Kahan compensation per parameter carrying each update's "
                                 "rounding error"),
    "bf16-sr": Preset(BF16, BF16, update="stochastic",
                      summary="bf16-true with each updated weight stochastically rounded to bfloat16 (seeded)"),
    "fp16-mixed": Preset(FP32, FP16, loss_scaling=True,
                         summary="float32 parameters, autocast float16 compute, dynamic loss scaling"),
    "fp16-master": Preset(FP16, FP16, master_weights=True, loss_scaling=True,
                          summary="float16 model with float32 norms, float32 master weights and optimizer states, "
                                  "dynamic loss scaling"),
    "bf16-master": Preset(BF16, BF16, master_weights=True,
                          summary="bfloat16 model with float32 norms, float32 master weights and optimizer states"),
    "fp16-true": Preset(FP16, FP16, summary="everything in float16, no master weights, no loss scaling"),
    # bf16-mixed with the block projections' GEMMs in FP8 (embeddings, norms, attention,
    # the output layer and the loss stay as bf16-mixed has them)
    "fp8-tensorwise": Preset(FP32, BF16, fp8="tensorwise",
                             summary="bf16-mixed, block projections in FP8 with one current scale per tensor"),
    "fp8-delayed": Preset(FP32, BF16, fp8="delayed",
                          summary="bf16-mixed, block projections in FP8 with scales from an amax history"),
    "fp8-rowwise": Preset(FP32, BF16, fp8="rowwise",
                          summary="bf16-mixed, block projections in FP8 with a power-of-two scale per row"),
    "fp8-blockwise": Preset(FP32, BF16, fp8="blockwise",
                            summary="bf16-mixed, block projections in FP8 with DeepSeek-V3's 1x128 and 128x128 "
                                    "scales, AdamW moments in bfloat16"),
}
FP8_BASES = ("fp32", "bf16-mixed", "bf16-master", "bf16-true")  # modes an FP8 recipe may build on

# Lightning's precision=..., Accelerate's mixed_precision=..., Apex's opt_level=...
ALIASES: dict[str, str] = {
    **{name: name for name in PRESETS},
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


def resolve_preset_name(name: str, field: str = "precision.preset") -> str:
    key = str(name).strip().lower()
    if key not in ALIASES:
        raise UserError(
            f"{field}: unknown precision {name!r}; accepted: {', '.join(PRESETS)} "
            f"(aliases: {', '.join(k for k in ALIASES if k not in PRESETS)})"
        )
    return ALIASES[key]


def preset_for(storage_dtype: torch.dtype, param_dtype: torch.dtype) -> str | None:
    """The mode without master weights that stores and computes in these dtypes."""
    return next((name for name, p in PRESETS.items() if not p.fp8 and not p.update
                 and (p.storage_dtype, p.param_dtype, p.master_weights) == (storage_dtype, param_dtype, False)), None)
