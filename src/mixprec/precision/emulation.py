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

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
_MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
LOW = (torch.bfloat16, torch.float16)


def _low_dtype(args) -> torch.dtype | None:
    return next((a.dtype for a in args if isinstance(a, torch.Tensor) and a.dtype in LOW), None)


def _up(x):
    return x.float() if isinstance(x, torch.Tensor) and x.dtype in LOW else x


class EmulatedMatmul(TorchDispatchMode):
    """Under this mode, mm/addmm/bmm/baddbmm on BF16 or FP16 tensors run in FP32 and
    return the input dtype. Enter it around the forward and the backward pass."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _MATMULS and (dtype := _low_dtype(args)) is not None:
            return func(*map(_up, args), **kwargs).to(dtype)
        return func(*args, **kwargs)
