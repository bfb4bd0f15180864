"""Grouped block-wise experts on a GPU: torch has no grouped block-wise scaled GEMM, so the three
GEMMs of a block-wise experts projection run on Triton kernels of mixprec's own
(mixprec.narrow.kernels.experts_blockwise) in DeepGEMM's contiguous layout: each expert's tokens
moved to start at a multiple of 128 with zero rows between (`Segments.aligned`), so every
128-token tile belongs to one expert and the kernels need no group sizes on the host.

    forward, input gradient   one kernel over (128-token tiles) x (128 output columns), each tile
                              multiplying its expert's weight blocks
    weight gradient           one kernel over (experts) x (128 x 128 blocks of dW), each summing
                              its expert's 128-token tiles

The casts are experts_fp8's (1 x 128 tiles per token, 128 x 128 blocks per expert, 128 x 1 tiles
along each expert's tokens); the kernels compute what the grouped emulation computes (FP32
partial sums over each 128-wide tile, each times its two scales), in another summation order:
tests/narrow/test_experts_blockwise.py runs them in Triton's interpreter against it, and each is
compiled for sm_90 in the suite. Each kernel is an operator (mixprec::grouped_blockwise_mm,
mixprec::grouped_blockwise_wgrad) whose FP8 arguments `mixprec audit` reads.
"""

from __future__ import annotations

import functools

import torch

from mixprec.narrow.formats.scaling import Quantized
from mixprec.narrow.experts.segments import Segments

BLOCK = 128


@functools.cache
def _kernels():
    """(m_grouped, k_grouped, their launch options), imported at first use (Triton is optional); run in
    Triton's interpreter on CPU tensors where the process started with TRITON_INTERPRET=1."""
    from mixprec.narrow.kernels.experts_blockwise import LAUNCH_OPTIONS, k_grouped, m_grouped

    return m_grouped, k_grouped, LAUNCH_OPTIONS


@torch.library.custom_op("mixprec::grouped_blockwise_mm", mutates_args=())
def _grouped_blockwise_mm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, src: torch.Tensor,
                          tile_expert: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """a (S, SUM) e4m3 in 1 x 128 tiles (sa (S, SUM/128)), its rows at the positions src (P,) says (S: a zero
    row), each 128-position tile expert tile_expert[i]'s; b (E, SUM, OUT) e4m3 in 128 x 128 blocks (sb (E,
    SUM/128, OUT/128)) -> (S, OUT) in out_dtype, the rows at no position zero."""
    (S, SUM), (E, _, OUT), P = a.shape, b.shape, src.shape[0]
    if b.stride(1) != 1:  # the kernel reads b K-major (SUM the unit stride), as the casts write it
        b = b.transpose(1, 2).contiguous().transpose(1, 2)
    # bfloat16 written by the kernel on CUDA (rounded to nearest); Triton's interpreter truncates a float32 to
    # bfloat16 (3.9), so on CPU tensors the kernel writes FP32 and torch rounds it, as CUDA does
    out = torch.empty(S, OUT, dtype=out_dtype if a.is_cuda else torch.float32, device=a.device)
    m_grouped, _, options = _kernels()
    m_grouped[(P // BLOCK, -(-OUT // BLOCK))](
        a, sa, b, sb, src, tile_expert, out, S, E, SUM, OUT, sa.shape[1], *b.stride(), *sb.stride(), BLOCK=BLOCK,
        **options)
    return out.to(out_dtype)


@_grouped_blockwise_mm.register_fake
def _(a, sa, b, sb, src, tile_expert, out_dtype):
    return a.new_empty(a.shape[0], b.shape[2], dtype=out_dtype)


@torch.library.custom_op("mixprec::grouped_blockwise_wgrad", mutates_args=())
def _grouped_blockwise_wgrad(g_t: torch.Tensor, sg: torch.Tensor, x_t: torch.Tensor, sx: torch.Tensor,
                             tile_start: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Each expert's g_e^T @ x_e -> (E, N, K) in out_dtype (the weight's: no copy to convert): g_t (N, P), x_t
    (K, P) e4m3, the contiguous layout transposed, in 128 x 1 tiles along the tokens (sg (., N), sx (., K) per
    tile), expert e's tiles tile_start[e]:tile_start[e + 1]."""
    (N, P), K, E = g_t.shape, x_t.shape[0], tile_start.shape[0] - 1
    # bfloat16 written by the kernel on CUDA; FP32 on CPU tensors, rounded by torch (as `_grouped_blockwise_mm`)
    out = torch.empty(E, N, K, dtype=out_dtype if g_t.is_cuda else torch.float32, device=g_t.device)
    _, k_grouped, options = _kernels()
    k_grouped[(E, -(-N // BLOCK), -(-K // BLOCK))](g_t, sg, x_t, sx, tile_start, out, N, K, P, BLOCK=BLOCK,
                                                    **options)
    return out.to(out_dtype)


@_grouped_blockwise_wgrad.register_fake
def _(g_t, sg, x_t, sx, tile_start, out_dtype):
    return g_t.new_empty(tile_start.shape[0] - 1, g_t.shape[0], x_t.shape[0], dtype=out_dtype)


def layout(seg: Segments) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The contiguous layout read as a map: (each position's row (P,) int32, S for a zero row; each
    128-position tile's expert (P / 128,) int32, E for none; P). The rows past offs[-1] sit after the last
    expert, in tiles of no expert (the kernel writes them zero)."""
    src, ends, P = seg.sources(BLOCK, nonempty=False, keep_past=True)
    tile_expert = torch.searchsorted(ends.long(), torch.arange(0, P, BLOCK, device=src.device), right=True)
    return src, tile_expert.to(torch.int32), P


def mm(a: Quantized, b: Quantized, seg: Segments, out_dtype: torch.dtype) -> torch.Tensor:
    """experts_fp8.mm's block-wise GEMM on the kernel: a (S, SUM) per token, b stacked (E, SUM, OUT)."""
    src, tile_expert, _ = layout(seg)
    out = torch.ops.mixprec.grouped_blockwise_mm(a.data, a.scale_inv, b.data, b.scale_inv, src, tile_expert,
                                                 out_dtype if out_dtype == torch.bfloat16 else torch.float32)
    return out.to(out_dtype)


def wgrad(g_t, g_inv, x_t, x_inv, seg: Segments, out_dtype: torch.dtype) -> torch.Tensor:
    """experts_fp8.wgrad_mm over 128-token tiles on the kernel: g_t (N, P), x_t (K, P) in the contiguous
    layout transposed (`Segments.sources(128, nonempty=False)`), g_inv, x_inv per tile as `Segments.tiles`
    numbers them (each expert's tiles from its first token: the contiguous layout's tiles, in order)."""
    _, ends, _ = seg.aligned(BLOCK)
    tile_start = torch.cat([ends.new_zeros(1), ends // BLOCK]).to(torch.int32)
    return torch.ops.mixprec.grouped_blockwise_wgrad(g_t, g_inv.contiguous(), x_t, x_inv.contiguous(), tile_start,
                                                     out_dtype)
