"""TF32 for FP32 matmuls on CUDA: torch's process-wide setting, set and read in one place.

TF32 keeps float32's 8-bit exponent and rounds the inputs of a matmul to a 10-bit
mantissa (float16's), accumulating in float32; an H100 runs it at 494 TFLOP/s against 67
for true FP32.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("mixprec.precision.policy")


def tf32_active(device_type: str | None) -> bool:
    """Whether FP32 matmuls on this device run as TF32 now."""
    return device_type == "cuda" and torch.get_float32_matmul_precision() != "highest"


def set_tf32(device_type: str | None, requested: bool) -> None:
    """Turn TF32 on when requested (CUDA only); otherwise leave torch's setting alone and
    warn when something else turned it on: nobody gets TF32 without a line saying so."""
    if device_type != "cuda":
        if requested:
            logger.info("precision.tf32: no effect on %s (TF32 is a CUDA tensor-core format)", device_type)
        return
    if requested:
        torch.set_float32_matmul_precision("high")
        logger.info("float32 matmuls run as TF32 (10-bit mantissa inputs, float32 accumulation): precision.tf32")
    elif tf32_active(device_type):
        logger.warning("float32 matmuls run as TF32: torch.set_float32_matmul_precision(%r) was called outside "
                       "mixprec; torch.set_float32_matmul_precision('highest') restores true float32",
                       torch.get_float32_matmul_precision())
