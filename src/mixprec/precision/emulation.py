"""BF16 and FP16 matmuls emulated in FP32, for CPUs without a native low-precision GEMM.

On a CPU without AVX512-BF16 or AMX, PyTorch's BF16 matmul falls back to a slow
generic kernel (measured on an AVX2 CPU: 1.2 to 25 GFLOP/s by operand layout, against
120 to 150 in FP32), and FP16 has no fast CPU GEMM at all. A low-precision GEMM with
FP32 accumulation -- what GPU tensor cores do -- equals an FP32 GEMM on the same
operands rounded once at the end: a product of two BF16 numbers (8-bit significands)
or two FP16 numbers (11 bits) is exact in FP32 (24 bits). So under this mode, matmuls
that receive BF16/FP16 tensors run as FP32 GEMMs and round their result back
(FP16 results above 65504 become inf, as on the GPU). Dtypes seen by the rest of the
program are unchanged; only the summation order may differ from a native kernel.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mixprec.dtypes import dtype_name

logger = logging.getLogger("mixprec.precision.policy")

aten = torch.ops.aten
_MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
# PyTorch's fused CPU attention (what F.scaled_dot_product_attention runs on a CPU): its
# bfloat16/float16 kernels use the same slow low-precision GEMMs. Run in float32 on the
# rounded inputs, the result rounded back: (output, logsumexp) forward, the three gradients
# backward. A fused GPU kernel also rounds the softmax probabilities to the low dtype before
# P @ V; this does not, so attention is slightly more exact here than there.
_ATTENTION = {aten._scaled_dot_product_flash_attention_for_cpu.default: 1,  # outputs rounded back: the first
              aten._scaled_dot_product_flash_attention_for_cpu_backward.default: 3}
LOW = (torch.bfloat16, torch.float16)


def has_fast_matmul(device_type: str, dtype: torch.dtype) -> bool:
    """Whether `dtype` matmuls have a native fast kernel on this device. A CPU without
    AVX512-BF16 or AMX emulates BF16 (measured on an AVX2 CPU: 16 GFLOP/s vs 140 in
    FP32); FP16 needs AMX-FP16."""
    if dtype == torch.float32:
        return True
    if device_type == "cuda":
        return torch.cuda.is_available() and (dtype == torch.float16 or torch.cuda.is_bf16_supported())
    if device_type == "cpu":
        if dtype == torch.bfloat16:
            return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
        return torch.cpu._is_amx_fp16_supported()
    return True


def _low_dtype(args) -> torch.dtype | None:
    return next((a.dtype for a in args if isinstance(a, torch.Tensor) and a.dtype in LOW), None)


def _up(x):
    return x.float() if isinstance(x, torch.Tensor) and x.dtype in LOW else x


class EmulatedMatmul(TorchDispatchMode):
    """Under this mode, mm/addmm/bmm/baddbmm and the CPU's fused attention on BF16 or FP16
    tensors run in FP32 and return the input dtype. Enter it around the forward and the
    backward pass."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _MATMULS and (dtype := _low_dtype(args)) is not None:
            return func(*map(_up, args), **kwargs).to(dtype)
        if func in _ATTENTION and (dtype := _low_dtype(args)) is not None:
            out = func(*map(_up, args), **{k: _up(v) for k, v in kwargs.items()})
            rounded = _ATTENTION[func]
            return tuple(t.to(dtype) if i < rounded else t for i, t in enumerate(out))
        return func(*args, **kwargs)


class Emulation:
    """The policy part that decides, per device, whether low-precision matmuls are emulated
    (requested: True, False, or None for "when the device has no native kernel"), logs the
    choice, and gives the context the forward and backward run in."""

    def __init__(self, requested: bool | None):
        self.requested, self.active = requested, requested

    def will_emulate(self, device_type: str, dtypes) -> bool:
        if not dtypes:
            return False
        if self.requested is None:
            return not all(has_fast_matmul(device_type, d) for d in dtypes)
        return self.requested

    def choose(self, device_type: str, dtypes) -> None:
        """Decide for `dtypes` (the low-precision matmul dtypes in use) on `device_type`, and log why."""
        self.active = self.will_emulate(device_type, dtypes)
        for dtype in sorted(dtypes, key=str):
            native = has_fast_matmul(device_type, dtype)
            if self.requested is None and self.active and not native:
                logger.info(
                    "%s matmuls and fused CPU attention (SDPA) are emulated: float32 GEMMs on %s operands, %s "
                    "results (the same numbers up to summation order), because this %s has no native %s GEMM; "
                    "precision.emulate_matmul = false uses the native kernels", *[dtype_name(dtype)] * 3,
                    device_type, dtype_name(dtype))
            elif self.requested is False and not native:
                logger.warning("%s matmuls on this %s have no native kernel and are not emulated: expect them "
                               "5-100x slower than float32", dtype_name(dtype), device_type)

    def context(self):
        return EmulatedMatmul() if self.active else contextlib.nullcontext()
