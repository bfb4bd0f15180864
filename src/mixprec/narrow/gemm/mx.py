"""The microscaled GEMM (mixprec::mx_mm), emulated on every device: both operands dequantised without NVFP4's
tensor scale (each value an element times a power of two or an e4m3 scale: exact in FP32, and in bfloat16 for
every block above ~2^-115), multiplied with FP32 accumulation, and the product times the two tensor scales, as
the hardware applies them. On CUDA the operands are bfloat16 and torch's bfloat16 GEMM writes FP32
(`torch.mm(..., out_dtype=torch.float32)`, the tensor cores' rate); elsewhere FP32 (the route:
mixprec.narrow.formats.mx.gemm_route)."""

from __future__ import annotations

import torch

from mixprec.narrow.formats.microscaling import Blocked
from mixprec.narrow.formats.mx import _operand_dtype
from mixprec.narrow.kernels import cuda_compiled


def _dequantize(data, scale, block, tensor_scale, shape, dtype) -> torch.Tensor:
    return Blocked(data, scale, block, tensor_scale, shape).dequantize(with_tensor_scale=False, dtype=dtype)


def mx_mm(a: Blocked, b: Blocked, out_dtype: torch.dtype) -> torch.Tensor:
    """a (M, K) @ b (N, K)^T, both blocked along K: the emulated microscaled GEMM, as one
    operator (mixprec::mx_mm) on the elements and scales, so `mixprec audit` sees each
    microscaled GEMM and its operands' formats at the dispatcher."""
    return torch.ops.mixprec.mx_mm(a.data, a.scale, a.tensor_scale, list(a.block), list(a.shape),
                                   b.data, b.scale, b.tensor_scale, list(b.block), list(b.shape), out_dtype,
                                   a.values, b.values)


@torch.library.custom_op("mixprec::mx_mm", mutates_args=())
def _mx_mm(a_data: torch.Tensor, a_scale: torch.Tensor, a_tensor_scale: torch.Tensor | None, a_block: list[int],
           a_shape: list[int], b_data: torch.Tensor, b_scale: torch.Tensor, b_tensor_scale: torch.Tensor | None,
           b_block: list[int], b_shape: list[int], out_dtype: torch.dtype, a_values: torch.Tensor | None = None,
           b_values: torch.Tensor | None = None) -> torch.Tensor:
    """a_values, b_values: the operands dequantised by their casts already (`values`), else dequantised here."""
    a = Blocked(a_data, a_scale, tuple(a_block), a_tensor_scale, tuple(a_shape), a_values).bits()
    b = Blocked(b_data, b_scale, tuple(b_block), b_tensor_scale, tuple(b_shape), b_values).bits()
    device = a_data.device.type
    dtype, dequantize = _operand_dtype(device), cuda_compiled.compiled(_dequantize, device)
    a_op, b_op = (q.values if q.values is not None else dequantize(q.data, q.scale, q.block, None, q.shape, dtype)
                  for q in (a, b))
    if dtype == torch.bfloat16:  # exact operands, FP32 accumulation and output
        out = torch.mm(a_op, b_op.t(), out_dtype=torch.float32)
    else:
        out = a_op @ b_op.t()
    for q in (a, b):
        if q.tensor_scale is not None:
            out = out * q.tensor_scale
    return out.to(out_dtype)


@_mx_mm.register_fake
def _(a_data, a_scale, a_tensor_scale, a_block, a_shape, b_data, b_scale, b_tensor_scale, b_block, b_shape,
      out_dtype, a_values=None, b_values=None):
    return a_data.new_empty(a_shape[0], b_shape[0], dtype=out_dtype)
