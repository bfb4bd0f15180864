"""The precision policy: the user's words parsed once into one object whose hooks
the training loop calls. Nothing else in mixprec branches on a precision name.

    policy = Policy.from_preset("bf16-mixed")
    model, optimizer = policy.setup(model, optimizer)
    with policy.autocast():
        loss = model(x, y)
    policy.backward(loss)
    applied = policy.step(optimizer, max_norm=1.0)
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch

from mixprec.errors import UserError
from mixprec.precision.dtypes import dtype_name, parse_dtype
from mixprec.precision.emulation import EmulatedBF16Matmul

logger = logging.getLogger(__name__)

FP32, BF16 = torch.float32, torch.bfloat16


@dataclass(frozen=True)
class _Preset:
    storage_dtype: torch.dtype  # parameters, gradients, optimizer states (TorchTitan's training.dtype)
    param_dtype: torch.dtype  # compute (TorchTitan's mixed_precision_param)
    reduce_dtype: torch.dtype = FP32  # gradient reduction across ranks; a default a preset lets you override
    summary: str = ""


PRESETS: dict[str, _Preset] = {
    "fp32": _Preset(FP32, FP32, summary="everything in float32"),
    "bf16-mixed": _Preset(
        FP32, BF16, summary="float32 parameters and optimizer states, torch.autocast bfloat16 compute"
    ),
    "bf16-true": _Preset(
        BF16, BF16,
        summary="parameters, gradients and optimizer states in bfloat16, no float32 copy; RoPE and logits in float32",
    ),
}

# What users of Lightning (precision=...) and Accelerate (mixed_precision=...) already type.
ALIASES: dict[str, str] = {
    "32-true": "fp32", "32": "fp32", "no": "fp32", "float32": "fp32",
    "bf16": "bf16-mixed",
    "bf16-true": "bf16-true", "bf16-mixed": "bf16-mixed", "fp32": "fp32",
}


def resolve_preset_name(name: str, field: str = "precision.preset") -> str:
    key = str(name).strip().lower()
    if key not in ALIASES:
        raise UserError(
            f"{field}: unknown precision {name!r}; accepted: {', '.join(PRESETS)} "
            f"(aliases: {', '.join(k for k in ALIASES if k not in PRESETS)})"
        )
    return ALIASES[key]


def has_fast_bf16(device_type: str) -> bool:
    """Whether bfloat16 matmuls have a native kernel on this device. Without AVX512-BF16
    or AMX a CPU emulates them (measured on an AVX2 CPU: 16 GFLOP/s vs 140 in float32)."""
    if device_type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device_type == "cpu":
        return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return True


class Policy:
    """Where each tensor lives, in which dtype, and the hooks that keep it there.

    storage_dtype: parameters, gradients and optimizer states.
    param_dtype: compute. Narrower than storage_dtype: torch.autocast does the cast.
    reduce_dtype: gradient reduction across data-parallel ranks.
    emulate_bf16: run BF16 matmuls as FP32 GEMMs on BF16-rounded operands (see
        mixprec.precision.emulation); None decides at setup: on when the device has no
        native BF16 GEMM.
    """

    def __init__(self, param_dtype=FP32, reduce_dtype=FP32, storage_dtype=FP32, *, emulate_bf16: bool | None = None):
        self.param_dtype = parse_dtype(param_dtype, "param_dtype")
        self.reduce_dtype = parse_dtype(reduce_dtype, "reduce_dtype")
        self.storage_dtype = parse_dtype(storage_dtype, "storage_dtype")
        if self.storage_dtype == BF16 and self.param_dtype == FP32:
            raise UserError(
                "param_dtype float32 with storage_dtype bfloat16: compute cannot be wider than the "
                "stored parameters; accepted: param_dtype bfloat16 (bf16-true), or storage_dtype float32"
            )
        self.name = next(
            n for n, p in PRESETS.items()
            if (p.storage_dtype, p.param_dtype) == (self.storage_dtype, self.param_dtype)
        )
        self.emulate_bf16 = emulate_bf16
        self.device_type: str | None = None
        self._steps = 0
        self._skipped = 0
        self._last_grad_norm: float | None = None
        self._warn_known_bad()

    @classmethod
    def from_preset(cls, name: str, *, labels: dict[str, str] | None = None, emulate_bf16: bool | None = None,
                    **overrides) -> "Policy":
        """A preset by name or alias. `overrides` may change the fields a preset only
        defaults (reduce_dtype); one that contradicts the preset's own fields is an error
        naming both. `labels` names each override as the user wrote it (for messages)."""
        labels = labels or {}
        preset_name = resolve_preset_name(name, labels.get("preset", "preset"))
        preset = PRESETS[preset_name]
        fields = {"storage_dtype": preset.storage_dtype, "param_dtype": preset.param_dtype,
                  "reduce_dtype": preset.reduce_dtype}
        for key, value in overrides.items():
            if key not in fields:
                raise TypeError(f"Policy.from_preset got an unexpected field {key!r}")
            label = labels.get(key, key)
            dtype = parse_dtype(value, label)
            if key != "reduce_dtype" and dtype != fields[key]:
                raise UserError(
                    f"{labels.get('preset', 'preset')} = {name!r} contradicts {label} = {dtype_name(dtype)!r}: "
                    f"{preset_name} has {key} {dtype_name(fields[key])}; drop one of the two"
                )
            fields[key] = dtype
        return cls(**fields, emulate_bf16=emulate_bf16)

    # ---- what the policy promises -------------------------------------------------
    @property
    def uses_autocast(self) -> bool:
        return self.param_dtype != self.storage_dtype

    def describe(self) -> dict[str, str]:
        """Which dtype each kind of tensor is kept in under this policy (single process)."""
        compute = dtype_name(self.param_dtype)
        stored = dtype_name(self.storage_dtype)
        return {
            "parameters": stored,
            "matmul compute": compute,
            "norm, softmax, RoPE": "float32",
            "logits and loss": "float32",
            # autocast's casts are differentiable: the gradient of an FP32 leaf is FP32.
            "gradients": stored,
            "optimizer states": stored,
            "gradient reduction": dtype_name(self.reduce_dtype),
        }

    def __repr__(self) -> str:
        return (f"Policy({self.name}: storage_dtype={dtype_name(self.storage_dtype)}, "
                f"param_dtype={dtype_name(self.param_dtype)}, reduce_dtype={dtype_name(self.reduce_dtype)})")

    def _warn_known_bad(self) -> None:
        if self.reduce_dtype == BF16:
            logger.warning(
                "reduce_dtype bfloat16: gradients summed across ranks in bfloat16 keep 8 bits of "
                "mantissa, so small contributions are rounded away (1e7 + 1 == 1e7); float32 is advised"
            )
        if self.storage_dtype == BF16:
            logger.warning(
                "storage_dtype bfloat16: optimizer states and weights in bfloat16 drop any update smaller "
                "than 2^-8 of the weight (1 + 2^-9 == 1 in bfloat16); bf16-mixed keeps float32 copies"
            )

    # ---- hooks ----------------------------------------------------------------------
    def setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None):
        """Cast the parameters to the storage dtype in place (the same Parameter objects,
        so an optimizer built before keeps working; buffers are left alone) and log which
        path handles mixed precision."""
        if optimizer is not None and optimizer.state:
            raise ValueError("Policy.setup needs an optimizer that has not stepped yet")
        first = next(model.parameters(), None)
        self.device_type = first.device.type if first is not None else "cpu"
        with torch.no_grad():
            for p in model.parameters():
                if p.is_floating_point() and p.dtype != self.storage_dtype:
                    p.data = p.data.to(self.storage_dtype)
                    if p.grad is not None:
                        p.grad = p.grad.to(self.storage_dtype)
        if self.uses_autocast:
            logger.info(
                "Mixed precision training is handled by AMP: torch.autocast(%s, %s) over %s parameters",
                self.device_type, dtype_name(self.param_dtype), dtype_name(self.storage_dtype),
            )
        else:
            logger.info("Mixed precision training is disabled: %s (%s)", self.name, PRESETS[self.name].summary)
        if self.param_dtype == BF16:
            native = has_fast_bf16(self.device_type)
            if self.emulate_bf16 is None:
                self.emulate_bf16 = not native
                if self.emulate_bf16:
                    logger.info(
                        "bfloat16 matmuls are emulated: float32 GEMMs on bfloat16 operands, bfloat16 results "
                        "(the same numbers up to summation order), because this %s has no native bfloat16 GEMM "
                        "(no AVX512-BF16 or AMX); precision.emulate_bf16 = false uses the native kernel",
                        self.device_type,
                    )
            elif not self.emulate_bf16 and not native:
                logger.warning(
                    "bfloat16 matmuls on this %s have no native kernel (no AVX512-BF16 or AMX) and are not "
                    "emulated: expect them 5-100x slower than float32", self.device_type,
                )
        return model, optimizer

    def autocast(self, device_type: str | None = None):
        """Context for the forward pass and the loss."""
        stack = contextlib.ExitStack()
        if self.uses_autocast:
            device_type = device_type or self.device_type or ("cuda" if torch.cuda.is_available() else "cpu")
            stack.enter_context(torch.autocast(device_type, dtype=self.param_dtype))
        stack.enter_context(self._emulation())
        return stack

    def _emulation(self):
        if self.emulate_bf16 and self.param_dtype == BF16:
            return EmulatedBF16Matmul()
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        with self._emulation():
            loss.backward()

    def step(self, optimizer: torch.optim.Optimizer, max_norm: float | None = None) -> bool:
        """Clip to `max_norm` (when given) on the true gradients, step, clear the gradients.
        Returns whether the step was applied."""
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if max_norm is not None and max_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        else:
            norm = torch.nn.utils.clip_grad_norm_(params, float("inf"))  # measures, never scales
        self._last_grad_norm = norm.float().item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self._steps += 1
        return True

    # ---- monitoring and checkpointing -----------------------------------------------
    def stats(self) -> dict:
        return {
            "precision": self.name,
            "param_dtype": dtype_name(self.param_dtype),
            "storage_dtype": dtype_name(self.storage_dtype),
            "reduce_dtype": dtype_name(self.reduce_dtype),
            "autocast": self.uses_autocast,
            "steps": self._steps,
            "skipped": self._skipped,
            "grad_norm": self._last_grad_norm,
        }

    def state_dict(self) -> dict:
        return {"precision": self.name, "steps": self._steps, "skipped": self._skipped}

    def load_state_dict(self, state: dict) -> None:
        if state.get("precision") != self.name:
            logger.warning("precision: resuming a %s checkpoint under %s", state.get("precision"), self.name)
        self._steps = int(state["steps"])
        self._skipped = int(state["skipped"])
