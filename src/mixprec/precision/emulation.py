"""BF16 matmuls emulated in FP32, for CPUs without a native BF16 GEMM.

On a CPU without AVX512-BF16 or AMX, PyTorch's BF16 matmul falls back to a slow
generic kernel (measured on an AVX2 CPU: 1.2 to 25 GFLOP/s by operand layout, against
120 to 150 in FP32). A BF16 GEMM with FP32 accumulation -- what BF16 hardware does --
equals an FP32 GEMM on the BF16 operands rounded to BF16 once at the end: every
product of two BF16 numbers (8-bit significands) is exact in FP32 (24 bits). So this
mode runs matmuls that receive BF16 tensors as FP32 GEMMs and rounds the result to
BF16. Dtypes seen by the rest of the program are unchanged; only the summation
order may differ from a native kernel.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
_MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}


def _up(x):
    return x.float() if isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16 else x


class EmulatedBF16Matmul(TorchDispatchMode):
    """Under this mode, mm/addmm/bmm/baddbmm on BF16 tensors run in FP32 and return BF16.
    Enter it around the forward pass and the backward pass (autograd's matmuls too)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _MATMULS and any(isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 for a in args):
            return func(*map(_up, args), **kwargs).to(torch.bfloat16)
        return func(*args, **kwargs)
