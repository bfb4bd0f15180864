"""Per-expert views of a stacked tensor whose rows are sorted by expert, found on the device.

    seg = Segments(offs, rows)          # offs (E,) int32: expert e owns rows offs[e-1]:offs[e]
    seg.ids                             # (rows,) each row's expert; rows past offs[-1] get E
    seg.amax(values)                    # (E + 1, C): max |value| over each expert's rows
    seg.tiles(128)                      # each expert's rows cut into tiles of 128 from its first row
    seg.aligned(32)                     # each expert's first row moved to a multiple of 32
    seg.sources(16)                     # the same layout as each position's row (a gather's index)

An experts layer scales each expert on its own: a tensor-wise scale is its expert's amax, a
scale along the tokens runs over its expert's tokens only, a block of tokens never spans two
experts. Everything here is computed from `offs` by tensor operations whose number does not
depend on the number of experts, and nothing is read back to the host: sizes are the static
upper bounds (an expert adds at most one partial tile, at most `multiple - 1` padding rows),
the unused tail left empty. Index E (one past the last expert) collects the rows past offs[-1]
and the unused tiles: callers drop it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def pad_to(t: torch.Tensor, multiple: int, dim: int = 0) -> torch.Tensor:
    """t with zeros appended along `dim` to a multiple of `multiple` (zeros change no amax, add nothing)."""
    pad = -t.shape[dim] % multiple
    if not pad:
        return t
    widths = [0, 0] * (t.dim() - dim - 1) + [0, pad]
    return F.pad(t, widths)


def segment_amax(values: torch.Tensor, ids: torch.Tensor, n: int) -> torch.Tensor:
    """(n, C): the max of `values` (R, C), non-negative, over the rows of each id (0 where none; NaN kept)."""
    index = ids.view(-1, *[1] * (values.dim() - 1)).expand_as(values)
    return values.new_zeros(n, *values.shape[1:]).scatter_reduce_(0, index, values, "amax")


class Segments:
    """The experts' rows of a sorted (rows, ...) tensor, from their cumulative ends `offs`."""

    def __init__(self, offs: torch.Tensor, rows: int):
        self.offs, self.rows, self.n = offs, rows, offs.shape[0]
        ends = offs.long()
        self.starts = torch.cat([ends.new_zeros(1), ends[:-1]])  # (E,)
        self.sizes = ends - self.starts
        self.ids = torch.searchsorted(ends, torch.arange(rows, device=offs.device), right=True)  # (rows,) in 0..E
        starts = torch.cat([self.starts, ends[-1:]])  # the rows past offs[-1] start at offs[-1]
        self.local = torch.arange(rows, device=offs.device) - starts[self.ids]  # each row's index in its expert

    def amax(self, values: torch.Tensor) -> torch.Tensor:
        """(E + 1, C): each expert's max of |values| (rows, C) per column, FP32."""
        return segment_amax(values.abs().float(), self.ids, self.n + 1)

    def per_row(self, per_expert: torch.Tensor) -> torch.Tensor:
        """(E + 1, ...) -> (rows, ...): each row's expert's entry."""
        return per_expert[self.ids]

    def tiles(self, tile: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each expert's rows in tiles of `tile` counted from its first row (the last one partial):
        (each row's tile (rows,), each tile's expert (T + 1,), each tile's end row (T,) int32 as a grouped
        GEMM's offs), T = rows // tile + E tiles at most, the unused ones empty; tile T holds the rows
        past offs[-1]."""
        counts = -(-self.sizes // tile)  # (E,) tiles per expert
        first = torch.cumsum(counts, 0) - counts
        T = self.rows // tile + self.n
        valid = self.ids < self.n
        tile_of_row = torch.where(valid, first[self.ids.clamp(max=self.n - 1)] + self.local // tile, T)
        expert_of_tile = torch.searchsorted(torch.cumsum(counts, 0), torch.arange(T + 1, device=self.offs.device),
                                            right=True)  # unused tiles get E
        ends = torch.searchsorted(tile_of_row, torch.arange(T, device=self.offs.device), right=True)
        return tile_of_row, expert_of_tile, ends.to(torch.int32)

    def aligned(self, multiple: int, nonempty: bool = False) -> tuple[torch.Tensor, torch.Tensor, int]:
        """A layout with each expert's first row at a multiple of `multiple` and zero rows between:
        (each row's position in it (rows,), the experts' ends there (E,) int32 rounded up to the multiple,
        its static length P). The rows past offs[-1] go to position P (dropped by `place`). nonempty: an
        expert with no rows gets `multiple` zero rows (a grouped GEMM that cannot take an empty group)."""
        padded = -(-self.sizes // multiple) * multiple
        if nonempty:
            padded = padded.clamp(min=multiple)
        ends = torch.cumsum(padded, 0)
        P = -(-(self.rows + self.n * (multiple - (0 if nonempty else 1))) // multiple) * multiple
        starts = ends - padded
        pos = torch.where(self.ids < self.n, starts[self.ids.clamp(max=self.n - 1)] + self.local, P)
        return pos, ends.to(torch.int32), P

    def sources(self, multiple: int, nonempty: bool = True) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The `aligned(multiple, nonempty)` layout read the other way: (each position's row (P,), `rows` at
        a zero row between experts, the experts' ends there (E,) int32, P): a gather fills it in one pass."""
        pos, ends, P = self.aligned(multiple, nonempty)
        src = torch.full((P + 1,), self.rows, device=pos.device, dtype=pos.dtype)
        return src.scatter_(0, pos, torch.arange(self.rows, device=pos.device))[:P], ends, P

    @staticmethod
    def place(t: torch.Tensor, pos: torch.Tensor, length: int) -> torch.Tensor:
        """t (rows, C) scattered to rows `pos` of a zero (length, C) tensor (pos == length: dropped)."""
        if t.element_size() == 1 and t.is_floating_point():  # FP8 has no index_copy: its bytes
            return Segments.place(t.contiguous().view(torch.uint8), pos, length).view(t.dtype)
        out = t.new_zeros(length + 1, *t.shape[1:])
        return out.index_copy_(0, pos, t)[:length]
