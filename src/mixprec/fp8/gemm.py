"""Scaled FP8 GEMMs: torch's own kernels where the device has one for the layout, and an
emulation with the same numerics where it has none.

    out = scaled_mm(a, b, out_dtype)        # a (M, K), b (K, N), both Quantized

The emulation is DeepSeek-V3's accumulation scheme: FP8 x FP8 products are exact in FP32;
they are summed in FP32 over one tile of K (128 for block-wise, all of K for tensor- and
row-wise), and each partial sum is multiplied by its two scales and added into an FP32
accumulator. For tensor- and row-wise scales that is the same as dequantising first and
running an FP32 GEMM; tests/fp8/test_gemm.py checks both, and the kernels against it.

Which route each GEMM takes is decided once per (device, layout) by `probe`: the kernel is
run on a 512 x 512 x 512 problem and compared with the emulation; a kernel that is missing,
refuses the layout or disagrees is not used, and the caller logs why.
"""

from __future__ import annotations

import functools
import logging

import torch

from mixprec.fp8.scaling import EPS, Quantized, per_tile, quantize

logger = logging.getLogger("mixprec")


def emulated_mm(a: Quantized, b: Quantized, out_dtype: torch.dtype) -> torch.Tensor:
    (M, K), N = a.data.shape, b.data.shape[1]
    kb = min(a.tile[1], b.tile[0])  # K elements per partial sum
    a32, b32 = a.data.float(), b.data.float()

    def scaled(partial, ka, kb_):  # times a's scales of K tile ka (per row tile), b's of K tile kb_ (per column tile)
        partial = per_tile(torch.mul, partial, a.scale_inv[:, ka:ka + 1], (a.tile[0], N))
        return per_tile(torch.mul, partial, b.scale_inv[kb_:kb_ + 1], (M, b.tile[1]))

    if kb >= K:
        return scaled(a32 @ b32, 0, 0).to(out_dtype)
    out = torch.zeros(M, N, device=a.data.device)
    for k in range(0, K, kb):  # one partial sum per K tile, promoted into the FP32 accumulator
        out += scaled(a32[:, k:k + kb] @ b32[k:k + kb], k // a.tile[1], k // b.tile[0])
    return out.to(out_dtype)


def layout(q: Quantized, side: str) -> str:
    """tensorwise (one scale), rowwise (one per row of a, per column of b) or blockwise."""
    rows, cols = q.data.shape
    if q.scale_inv.numel() == 1:
        return "tensorwise"
    if (side == "a" and q.tile == (1, cols)) or (side == "b" and q.tile == (rows, 1)):
        return "rowwise"
    return "blockwise"


def _column_major(s: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """s (R, C) as a column-major (stride (1, R')) tensor of R' = rows (>= R, padded with ones) rows."""
    R, C = s.shape
    padded = torch.ones(C, rows or R, device=s.device)
    padded[:, :R] = s.t()
    return padded.t()


def kernel_scales(a: Quantized, b: Quantized, blockwise: bool | None = None):
    """(scale_a, scale_b, scaling types): a's and b's scales as torch's scaled GEMMs check them
    (torch's meta functions state the rules; tests/fp8/test_gemm.py runs them on the CPU).
    Scaling types None: torch._scaled_mm, a 0-dim scale each (tensor-wise) or (M, 1) and (1, N)
    (row-wise). Block-wise: F.scaled_mm with ScalingType values; 1x128 tiles of a as (M, K/128)
    and of b (128 along K) as (N, K/128), both column-major; 128x128 blocks of b as
    (L4, N/128) column-major, L4 = K/128 rounded up to a multiple of 4 (the rows past K/128
    padded). blockwise: whether the recipe is block-wise; None: from the layouts. It must be
    said where a weight is one block, or one row of blocks: its scales alone read as
    tensor- or row-wise, a pair torch has no kernel for."""
    kind_a, kind_b = layout(a, "a"), layout(b, "b")
    if blockwise is None:
        blockwise = "blockwise" in (kind_a, kind_b) or kind_a != kind_b
    sa, sb = a.scale_inv.float(), b.scale_inv.float()
    if not blockwise:
        if kind_a != kind_b:
            raise ValueError(f"no scaled GEMM takes a {kind_a} a with a {kind_b} b")
        if kind_a == "tensorwise":
            return sa.reshape(()), sb.reshape(()), None
        # (M, 1) and (1, N) with unit strides (a size-1 dim's stride survives .contiguous())
        return sa.reshape(-1).contiguous().view(-1, 1), sb.reshape(-1).contiguous().view(1, -1), None
    import torch.nn.functional as F

    if a.tile[0] != 1:
        raise ValueError(f"a's {a.tile} tiles: torch's block-wise GEMMs here take a in 1x128 tiles")
    k_tiles = sa.shape[1]
    types = (F.ScalingType.BlockWise1x128,
             F.ScalingType.BlockWise1x128 if b.tile[1] == 1 else F.ScalingType.BlockWise128x128)
    if b.tile[1] == 1:  # 128 along K, one column each: as b's transpose holds them
        return _column_major(sa), _column_major(sb.t()), types
    return _column_major(sa), _column_major(sb, -(-k_tiles // 4) * 4), types


def kernel_mm(a: Quantized, b: Quantized, out_dtype: torch.dtype, fast_accum: bool = False,
              blockwise: bool | None = None) -> torch.Tensor:
    """torch's scaled GEMM: a row-major, b column-major (a transposed row-major tensor)."""
    A, B = a.data.contiguous(), b.data.t().contiguous().t()
    scale_a, scale_b, types = kernel_scales(a, b, blockwise)
    if types is not None:
        import torch.nn.functional as F

        return F.scaled_mm(A, B, scale_a, types[0], scale_b, types[1], output_dtype=out_dtype)
    return torch._scaled_mm(A, B, scale_a, scale_b, out_dtype=out_dtype, use_fast_accum=fast_accum)


def _whole_tiles(a: Quantized, b: Quantized) -> bool:
    """torch's kernels take whole tiles only (tensor- and row-wise tiles always are)."""
    return all(size % tile == 0 for q in (a, b) for size, tile in zip(q.data.shape, q.tile))


@functools.lru_cache(maxsize=None)
def _log_partial_blocks(a_shape, a_tile, b_shape, b_tile) -> None:
    logger.info("fp8: a %s x %s GEMM with %s and %s tiles is emulated: torch's block-wise kernel takes whole tiles "
                "only", "x".join(map(str, a_shape)), b_shape[1], a_tile, b_tile)


def scaled_mm(a: Quantized, b: Quantized, out_dtype: torch.dtype, *, kernel: bool,
              fast_accum: bool = False, blockwise: bool | None = None) -> torch.Tensor:
    if kernel and not _whole_tiles(a, b):  # e.g. a Linear narrower than one 128-block
        _log_partial_blocks(tuple(a.data.shape), a.tile, tuple(b.data.shape), b.tile)
        kernel = False
    return kernel_mm(a, b, out_dtype, fast_accum, blockwise) if kernel else emulated_mm(a, b, out_dtype)


@functools.lru_cache(maxsize=None)
def probe(device: str, a_tile: tuple[int, int], b_tile: tuple[int, int], a_dtype: torch.dtype,
          b_dtype: torch.dtype, out_dtype: torch.dtype) -> str | None:
    """None when torch has a kernel for this layout (tiles as `quantize` takes them, 0 for a
    whole dimension) on `device` that agrees with the emulation on a 512^3 problem (four
    128-blocks along each side, so block-wise scale strides are those of real shapes);
    otherwise the reason it is not used."""
    gen = torch.Generator().manual_seed(0)
    a, _ = quantize(torch.randn(512, 512, generator=gen).to(device), a_dtype, a_tile)
    b, _ = quantize(torch.randn(512, 512, generator=gen).to(device), b_dtype, b_tile)
    if "blockwise" in (layout(a, "a"), layout(b, "b")):
        import torch.nn.functional as F

        if device == "cpu":
            return "torch has no block-wise scaled GEMM on the CPU"
        if not hasattr(F, "scaled_mm"):
            return f"torch {torch.__version__} has no torch.nn.functional.scaled_mm for block-wise scales"
    try:
        got = kernel_mm(a, b, out_dtype).float()
    except Exception as e:  # noqa: BLE001 - whatever the kernel raises, the emulation is used and the reason logged
        return f"torch's scaled GEMM refused the layout ({str(e).splitlines()[0][:160]})"
    want = emulated_mm(a, b, torch.float32)
    err = float((got - want).norm() / want.norm().clamp(min=EPS))
    if not err < 1e-2:  # bfloat16 output rounding alone is about 2^-9 relative
        return f"torch's scaled GEMM disagrees with the emulation (relative error {err:.2g})"
    return None
