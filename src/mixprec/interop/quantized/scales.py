"""What the narrow formats' readers share: FP8 weights read with a scale tensor beside each (a View over the
folder), the scales of a block grid spread over a rank's rows, E8M0 scale bytes decoded."""

from __future__ import annotations

import math

import torch

from mixprec.interop.interfaces import View


class ScaledWeights(View):
    """A folder's FP8 weights, each with its scale tensor beside it (`scales`: weight -> scale), read as the
    weights they stand for; the scales hidden."""

    scales: dict[str, str]

    @property
    def made(self) -> dict[str, str]:
        return self.scales


def block_scales(folder, name: str, rows: slice | None, shape, block) -> torch.Tensor:
    """The scales of tensor `name` (one per block of `block` elements, the last of a dimension partial) spread
    over the `shape` elements of `rows`: only those rows' blocks are read."""
    (br, bc), first = block, 0 if rows is None else rows.start
    grid = slice(first // br, math.ceil((first + shape[0]) / br))
    s = folder.read(name, grid)
    s = s.repeat_interleave(br, 0)[first - grid.start * br:][:shape[0]]
    return s.repeat_interleave(bc, 1)[:, :shape[1]]


def scale_values(s: torch.Tensor) -> torch.Tensor:
    """A scale tensor's values in float32: ue8m0 as float8_e8m0fnu, or its bytes (uint8) as 2^(byte - 127)."""
    if s.dtype == torch.uint8:
        return (s.float() - 127.0).exp2()
    return s.float()
