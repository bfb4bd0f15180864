"""The scaling math: amax, scale, the cast to FP8, and delayed scaling's amax history.

A tensor (R, C) is cast in tiles of (tr, tc) elements, one FP32 scale per tile:
(R, C) is one tensor-wise scale, (1, C) one per row, (1, 128) DeepSeek-V3's activation
tiles, (128, 128) its weight blocks. A tile size of 0 means the whole dimension. The cast
is x * scale, clamped to the format's largest finite value (e4m3fn has no infinity: an
unclamped overflow would be NaN on some devices), and the stored factor is 1 / scale,
which torch's scaled GEMMs multiply back in.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from mixprec.narrow.formats.recipe import E4M3, E5M2

FP8_MAX = {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max}  # 448, 57344
EPS = 1e-12  # an all-zero tile gets a finite scale


class Quantized(NamedTuple):
    data: torch.Tensor  # FP8, the source's (R, C)
    scale_inv: torch.Tensor  # FP32 (ceil(R / tr), ceil(C / tc)): data * scale_inv is the value
    tile: tuple[int, int]  # (tr, tc), resolved: never 0

    def t(self) -> "Quantized":
        return Quantized(self.data.t(), self.scale_inv.t(), (self.tile[1], self.tile[0]))

    def dequantize(self) -> torch.Tensor:
        """The FP32 values this FP8 tensor stands for."""
        return per_tile(torch.mul, self.data.float(), self.scale_inv, self.tile)


def resolve_tile(tile: tuple[int, int], shape) -> tuple[int, int]:
    return (tile[0] or shape[0], tile[1] or shape[1])


def _spans(n: int, t: int):
    """Dimension n cut into (start, stop, tile length, first tile, stop tile): its whole tiles
    of length t, then the partial tile left over, where either exists."""
    whole = n - n % t
    spans = ((0, whole, t, 0, whole // t), (whole, n, n - whole, whole // t, whole // t + 1))
    return [span for span in spans if span[1] > span[0]]


def per_tile(op, x: torch.Tensor, values: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
    """op(x, v) with each tile of x (R, C) against its own entry of `values` (ceil(R/tr),
    ceil(C/tc)), by broadcasting: no per-element copy of `values`. The whole tiles are one
    view (tiles, tr, tiles, tc); a partial edge tile is a piece of its own, joined on after.
    (A repeat_interleave of the values cut to (R, C), or x padded to whole tiles and cut
    back, is what Inductor's CPU code computed wrongly where a tile was partial: it read
    past the values, or wrote only the first tile of each row of an FP8 output;
    tests/narrow/test_scaling.py compiles every tile shape against the eager result.)"""
    (R, C), (nr, nc) = x.shape, values.shape
    if not R or not C:  # no tiles (an expert-parallel rank that received no rows): op's dtype, x's shape
        return op(x, values.new_zeros(()))
    tr, tc = (R if nr == 1 else tile[0]), (C if nc == 1 else tile[1])
    rows = []
    for r0, r1, rt, i0, i1 in _spans(R, tr):
        pieces = [op(x[r0:r1, c0:c1].reshape(i1 - i0, rt, j1 - j0, ct), values[i0:i1, None, j0:j1, None])
                  .reshape(r1 - r0, c1 - c0) for c0, c1, ct, j0, j1 in _spans(C, tc)]
        rows.append(torch.cat(pieces, 1) if len(pieces) > 1 else pieces[0])
    return torch.cat(rows, 0) if len(rows) > 1 else rows[0]


def tile_amax(x: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
    """max |x| per tile, FP32, shape (ceil(R/tr), ceil(C/tc)); partial edge tiles are
    padded with zeros, which do not change a max of absolute values."""
    (R, C), (tr, tc) = x.shape, tile
    pr, pc = -R % tr, -C % tc
    a = x.abs().float()
    if pr or pc:
        a = F.pad(a, (0, pc, 0, pr))
    return a.view((R + pr) // tr, tr, (C + pc) // tc, tc).amax(dim=(1, 3))


def amax_to_scale(amax: torch.Tensor, dtype: torch.dtype, power_of_2: bool = False, margin: int = 0) -> torch.Tensor:
    """The scale that maps `amax` to the format's largest value (divided by 2**margin), the
    correctly rounded FP32 quotient. Rounded down to a power of two, scaling changes only
    exponents: x * scale is exact."""
    amax = amax.float().clamp(min=EPS)
    # One division, rounded once: `FP8_MAX / amax` with a Python number on top is evaluated
    # as amax.reciprocal() * FP8_MAX, two roundings, 1 ulp off the quotient for ~27% of amaxes.
    scale = torch.full_like(amax, FP8_MAX[dtype]).div_(amax) / 2.0**margin
    return torch.exp2(torch.floor(torch.log2(scale))) if power_of_2 else scale


def cast(x: torch.Tensor, scale: torch.Tensor, tile: tuple[int, int], dtype: torch.dtype) -> Quantized:
    """x (R, C) times its per-tile scale, saturated to the format's range, in FP8."""
    limit = FP8_MAX[dtype]
    data = per_tile(torch.mul, x.float(), scale, tile).clamp(-limit, limit).to(dtype)
    return Quantized(data, scale.reciprocal(), tile)


def quantize(x: torch.Tensor, dtype: torch.dtype, tile: tuple[int, int], *,
             power_of_2: bool = False) -> tuple[Quantized, torch.Tensor]:
    """Current scaling: each tile scaled by its own amax. Returns the FP8 tensor and the amax."""
    tile = resolve_tile(tile, x.shape)
    amax = tile_amax(x, tile)
    return cast(x, amax_to_scale(amax, dtype, power_of_2), tile, dtype), amax


def sqnr(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 20 log10(|ref| / |ref - approx|)."""
    ref = reference.detach().double()
    return float(20 * torch.log10(ref.norm() / (ref - approx.detach().double()).norm()))


class DelayedScales:
    """Transformer Engine's delayed scaling for one Linear's three operands (input,
    weight, gradient of the output), as tensors a module keeps as buffers:

    history (3, L)  the amax of each of the last L steps, newest first;
    pending (3,)    the amax seen so far in this step (max over micro-batches and recomputes);
    scale (3,)      this step's scales, from the history; 0 until a first step completes,
                    and meanwhile each tensor is scaled by its own amax.

    During a step each cast uses `scale` and raises `pending`; a value beyond what the
    scale expected saturates (clamps to the format's maximum). After the optimizer step,
    `advance` pushes `pending` into the history and derives the next scales:
    scale = fp8_max / amax_ref / 2**margin, amax_ref the history's max or its newest entry.
    """

    INPUT, WEIGHT, GRAD = 0, 1, 2

    @staticmethod
    def advance(history: torch.Tensor, pending: torch.Tensor, scale: torch.Tensor, dtypes, algo: str,
                margin: int) -> None:
        # A non-finite amax (an overflowing step) is not history: it would zero the scale.
        new = torch.where(torch.isfinite(pending), pending, torch.zeros_like(pending))
        history.copy_(torch.cat([new[:, None], history[:, :-1]], dim=1))
        ref = history.amax(dim=1) if algo == "max" else history[:, 0]
        fresh = _maxima(tuple(dtypes), history.device) / ref.clamp(min=EPS) / 2.0**margin
        scale.copy_(torch.where(ref > 0, fresh, scale))  # nothing recorded: keep the old scale
        pending.zero_()


def _maxima(dtypes: tuple, device: torch.device) -> torch.Tensor:
    """(len(dtypes),) the formats' largest values on `device`, made there once (filled, not
    copied from the host: a tensor made from a list would be a blocking copy every step)."""
    key = (dtypes, str(device))
    if key not in _MAXIMA:
        maxima = torch.empty(len(dtypes), device=device)
        for i, d in enumerate(dtypes):
            maxima[i] = FP8_MAX[d]
        _MAXIMA[key] = maxima
    return _MAXIMA[key]


_MAXIMA: dict[tuple, torch.Tensor] = {}  # (dtypes, device) -> _maxima's tensor
