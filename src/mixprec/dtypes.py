"""The one place where dtype names are parsed (below every package: fp8, precision and the rest use it)."""

from __future__ import annotations

import torch

from mixprec.errors import UserError

# Names users type (TorchTitan spells them out, Lightning and Accelerate abbreviate).
_BY_NAME = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}
_CANONICAL = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def parse_dtype(value: str | torch.dtype, field: str) -> torch.dtype:
    """`value` as a torch dtype; a UserError naming `field` when it is not one we train in."""
    if isinstance(value, torch.dtype):
        if value in _CANONICAL:
            return value
        raise UserError(f"{field}: dtype {value} is not supported; accepted: {', '.join(_CANONICAL.values())}")
    dtype = _BY_NAME.get(str(value).strip().lower())
    if dtype is None:
        raise UserError(f"{field}: unknown dtype {value!r}; accepted: {', '.join(_BY_NAME)}")
    return dtype


# FP8 element formats by their short names (fp8.grad_format)
_ELEMENTS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def parse_element(value: str, field: str) -> torch.dtype:
    """An FP8 element format's short name as its torch dtype; a UserError naming `field` otherwise."""
    if value not in _ELEMENTS:
        raise UserError(f"{field}: unknown element format {value!r}; accepted: {', '.join(_ELEMENTS)}")
    return _ELEMENTS[value]


def dtype_name(dtype: torch.dtype) -> str:
    return _CANONICAL.get(dtype, str(dtype).removeprefix("torch."))
