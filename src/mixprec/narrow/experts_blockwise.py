"""Grouped block-wise experts on a GPU: torch has no grouped block-wise scaled GEMM, so the three
GEMMs of a block-wise experts projection run on Triton kernels of mixprec's own
(mixprec.narrow.experts_blockwise_kernel) in DeepGEMM's contiguous layout: each expert's tokens
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

from mixprec.narrow.scaling import Quantized
from mixprec.narrow.segments import Segments

BLOCK = 128


@functools.cache
def _kernels():
    """(m_grouped, k_grouped), imported at first use (Triton is optional); run in Triton's interpreter on
    CPU tensors where the process started with TRITON_INTERPRET=1."""
    from mixprec.narrow.experts_blockwise_kernel import k_grouped, m_grouped

    return m_grouped, k_grouped


@torch.library.custom_op("mixprec::grouped_blockwise_mm", mutates_args=())
def _grouped_blockwise_mm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
                          tile_expert: torch.Tensor) -> torch.Tensor:
    """a (P, SUM) e4m3 in 1 x 128 tiles (sa (P, SUM/128)), each 128-row tile expert tile_expert[i]'s;
    b (E, SUM, OUT) e4m3 in 128 x 128 blocks (sb (E, SUM/128, OUT/128)), any strides -> (P, OUT) FP32."""
    P, SUM = a.shape
    E, _, OUT = b.shape
    out = torch.empty(P, OUT, dtype=torch.float32, device=a.device)
    _kernels()[0][(P // BLOCK, -(-OUT // BLOCK))](
        a, sa, b, sb, tile_expert, out, E, SUM, OUT, sa.shape[1], *b.stride(), *sb.stride(), BLOCK=BLOCK)
    return out


@_grouped_blockwise_mm.register_fake
def _(a, sa, b, sb, tile_expert):
    return a.new_empty(a.shape[0], b.shape[2], dtype=torch.float32)


@torch.library.custom_op("mixprec::grouped_blockwise_wgrad", mutates_args=())
def _grouped_blockwise_wgrad(g: torch.Tensor, sg: torch.Tensor, x: torch.Tensor, sx: torch.Tensor,
                             tile_start: torch.Tensor) -> torch.Tensor:
    """Each expert's g_e^T @ x_e -> (E, N, K) FP32: g (P, N), x (P, K) e4m3 in 128 x 1 tiles along the
    tokens (sg (., N), sx (., K) per tile), expert e's tiles tile_start[e]:tile_start[e + 1]."""
    (P, N), K, E = g.shape, x.shape[1], tile_start.shape[0] - 1
    out = torch.empty(E, N, K, dtype=torch.float32, device=g.device)
    _kernels()[1][(E, -(-N // BLOCK), -(-K // BLOCK))](g, sg, x, sx, tile_start, out, N, K, BLOCK=BLOCK)
    return out


@_grouped_blockwise_wgrad.register_fake
def _(g, sg, x, sx, tile_start):
    return g.new_empty(tile_start.shape[0] - 1, g.shape[1], x.shape[1], dtype=torch.float32)


def mm(a: Quantized, b: Quantized, seg: Segments, out_dtype: torch.dtype) -> torch.Tensor:
    """experts_fp8.mm's block-wise GEMM on the kernel: a (S, SUM) per token, b stacked (E, SUM, OUT)."""
    pos, ends, P = seg.aligned(BLOCK)
    tile_expert = torch.searchsorted(ends.long(), torch.arange(0, P, BLOCK, device=pos.device), right=True)
    out = torch.ops.mixprec.grouped_blockwise_mm(
        Segments.place(a.data, pos, P), Segments.place(a.scale_inv, pos, P), b.data, b.scale_inv,
        tile_expert.to(torch.int32))
    return out[pos.clamp(max=P - 1)].to(out_dtype)


def wgrad(g_data, g_inv, x_data, x_inv, seg: Segments) -> torch.Tensor:
    """experts_fp8.wgrad_mm over 128-token tiles on the kernel: g_inv, x_inv per tile as `Segments.tiles`
    numbers them (each expert's tiles from its first token: the contiguous layout's tiles, in order)."""
    pos, ends, P = seg.aligned(BLOCK)
    tile_start = torch.cat([ends.new_zeros(1), ends // BLOCK]).to(torch.int32)
    return torch.ops.mixprec.grouped_blockwise_wgrad(
        Segments.place(g_data, pos, P), g_inv.contiguous(), Segments.place(x_data, pos, P),
        x_inv.contiguous(), tile_start)


def route(device: str) -> str | None:
    """None where block-wise experts run on the kernels on `device`; otherwise why the grouped emulation runs."""
    if device != "cuda":
        return "mixprec's grouped block-wise kernels run on CUDA GPUs only"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed (mixprec's grouped block-wise kernels are Triton kernels)"
    if torch.cuda.get_device_capability() < (8, 9):
        return "FP8 tensor cores need compute capability 8.9 or more"
    return _probe(device)


@functools.lru_cache(maxsize=None)
def _probe(device: str) -> str | None:
    """The kernels against the grouped emulation on a 4-expert problem (an empty expert, sizes off 128):
    None when forward, input and weight gradients agree within bfloat16 rounding, else why not used."""
    from mixprec.narrow import experts_fp8
    from mixprec.narrow.experts import ExpertsGemm
    from mixprec.narrow.linear import Plan
    from mixprec.narrow.recipe import RECIPES

    recipe = RECIPES["blockwise"]
    plan = Plan(recipe, recipe.tiles, torch.bfloat16, (True, True, True), device=device)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(300, 256, generator=gen).to(device, torch.bfloat16)
    w = torch.randn(4, 384, 256, generator=gen).to(device)
    dy = torch.randn(300, 384, generator=gen).to(device, torch.bfloat16)
    offs = torch.tensor([130, 130, 257, 300], dtype=torch.int32, device=device)
    results = []
    for kernel in (True, False):
        g = ExpertsGemm("probe", plan, False, grouped=kernel)
        try:
            results.append((experts_fp8.forward(x, w, offs, g), *experts_fp8.backward(x, w, offs, dy, g)))
        except Exception as e:  # noqa: BLE001 - whatever the kernels raise, the emulation runs and says why
            return f"mixprec's grouped block-wise kernels failed here ({str(e).splitlines()[0][:160]})"
    for got, want in zip(*results):
        err = float((got.float() - want.float()).norm() / want.float().norm())
        if not err < 1e-2:
            return f"mixprec's grouped block-wise kernels disagree with the grouped emulation ({err:.2g})"
    return None
