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

from mixprec.narrow.kernels import cuda_compiled


def pad_to(t: torch.Tensor, multiple: int, dim: int = 0) -> torch.Tensor:
    """t with zeros appended along `dim` to a multiple of `multiple` (zeros change no amax, add nothing)."""
    pad = -t.shape[dim] % multiple
    if not pad:
        return t
    widths = [0, 0] * (t.dim() - dim - 1) + [0, pad]
    return F.pad(t, widths)


@cuda_compiled.sized("rows", "P")
def _sources(pos: torch.Tensor, rows: int, P: int) -> torch.Tensor:
    src = torch.full((P + 1,), rows, device=pos.device, dtype=torch.int32)
    return src.scatter_(0, pos, torch.arange(rows, device=pos.device, dtype=torch.int32))[:P]


def _length(rows: int, n: int, multiple: int, nonempty: bool) -> int:
    """The static length of an aligned layout: each of n experts adds at most `multiple - 1` padding rows, or
    `multiple` where an empty one gets a block of its own."""
    return -(-(rows + n * (multiple - (0 if nonempty else 1))) // multiple) * multiple


def segment_amax(values: torch.Tensor, ids: torch.Tensor, n: int) -> torch.Tensor:
    """(n, C): the max of `values` (R, C), non-negative, over the rows of each id (0 where none; NaN kept)."""
    index = ids.view(-1, *[1] * (values.dim() - 1)).expand_as(values)
    return values.new_zeros(n, *values.shape[1:]).scatter_reduce_(0, index, values, "amax")


@cuda_compiled.sized("rows")
def _index(offs: torch.Tensor, rows: int):
    """(starts (E,), sizes (E,), each row's expert (rows,) in 0..E, each row's index in its expert (rows,))."""
    ends = offs.long()
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    ids = torch.searchsorted(ends, torch.arange(rows, device=offs.device), right=True)
    local = torch.arange(rows, device=offs.device) - torch.cat([starts, ends[-1:]])[ids]  # past offs[-1]: from it
    return starts, ends - starts, ids, local


@cuda_compiled.sized("rows")
def _tiles(sizes: torch.Tensor, ids: torch.Tensor, local: torch.Tensor, rows: int, tile: int):
    n = sizes.shape[0]
    counts = -(-sizes // tile)  # (E,) tiles per expert
    first = torch.cumsum(counts, 0) - counts
    T = rows // tile + n
    tile_of_row = torch.where(ids < n, first[ids.clamp(max=n - 1)] + local // tile, T)
    expert_of_tile = torch.searchsorted(torch.cumsum(counts, 0), torch.arange(T + 1, device=sizes.device),
                                        right=True)  # unused tiles get E
    ends = torch.searchsorted(tile_of_row, torch.arange(T, device=sizes.device), right=True)
    return tile_of_row, expert_of_tile, ends.to(torch.int32)


@cuda_compiled.sized("rows")
def _aligned(sizes: torch.Tensor, ids: torch.Tensor, local: torch.Tensor, rows: int, multiple: int, nonempty: bool,
             keep_past: bool):
    n = sizes.shape[0]
    padded = -(-sizes // multiple) * multiple
    if nonempty:
        padded = padded.clamp(min=multiple)
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    past = ends[-1] + local if keep_past else _length(rows, n, multiple, nonempty)  # local: from offs[-1] there
    pos = torch.where(ids < n, starts[ids.clamp(max=n - 1)] + local, past)
    return pos, ends.to(torch.int32)


class Segments:
    """The experts' rows of a sorted (rows, ...) tensor, from their cumulative ends `offs`. Each piece of
    bookkeeping is one function of tensors that CUDA runs compiled (mixprec.narrow.kernels.cuda_compiled: a kernel or
    two, not one per op), computed once for the Segments (a pass's), the row count a size (no recompile)."""

    def __init__(self, offs: torch.Tensor, rows: int):
        self.offs, self.rows, self.n = offs, rows, offs.shape[0]
        # starts (E,), sizes (E,), ids (rows,) each row's expert in 0..E, local (rows,) its index in its expert
        self.starts, self.sizes, self.ids, self.local = cuda_compiled.compiled(_index, offs.device.type)(offs, rows)
        self._layouts = {}

    def amax(self, values: torch.Tensor) -> torch.Tensor:
        """(E + 1, C): each expert's max of |values| (rows, C) per column, FP32."""
        return segment_amax(values.abs().float(), self.ids, self.n + 1)

    def per_row(self, per_expert: torch.Tensor) -> torch.Tensor:
        """(E + 1, ...) -> (rows, ...): each row's expert's entry."""
        return per_expert[self.ids]

    def _once(self, key, fn, *args):
        if key not in self._layouts:
            self._layouts[key] = cuda_compiled.compiled(fn, self.offs.device.type)(*args)
        return self._layouts[key]

    def tiles(self, tile: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each expert's rows in tiles of `tile` counted from its first row (the last one partial):
        (each row's tile (rows,), each tile's expert (T + 1,), each tile's end row (T,) int32 as a grouped
        GEMM's offs), T = rows // tile + E tiles at most, the unused ones empty; tile T holds the rows
        past offs[-1]."""
        return self._once(("tiles", tile), _tiles, self.sizes, self.ids, self.local, self.rows, tile)

    def aligned(self, multiple: int, nonempty: bool = False,
                keep_past: bool = False) -> tuple[torch.Tensor, torch.Tensor, int]:
        """A layout with each expert's first row at a multiple of `multiple` and zero rows between:
        (each row's position in it (rows,), the experts' ends there (E,) int32 rounded up to the multiple,
        its static length P). The rows past offs[-1] go to position P (dropped by `place`), or with keep_past
        right after the last expert (in no expert's block). nonempty: an expert with no rows gets `multiple`
        zero rows (a grouped GEMM that cannot take an empty group)."""
        pos, ends = self._once(("aligned", multiple, nonempty, keep_past), _aligned, self.sizes, self.ids,
                               self.local, self.rows, multiple, nonempty, keep_past)
        return pos, ends, _length(self.rows, self.n, multiple, nonempty)

    def sources(self, multiple: int, nonempty: bool = True,
                keep_past: bool = False) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The `aligned(multiple, nonempty, keep_past)` layout read the other way: (each position's row (P,)
        int32, `rows` at a zero row, the experts' ends there (E,) int32, P): a gather fills it in one pass."""
        pos, ends, P = self.aligned(multiple, nonempty, keep_past)
        src = self._once(("sources", multiple, nonempty, keep_past), _sources, pos, self.rows, P)
        return src, ends, P

    @staticmethod
    def place(t: torch.Tensor, pos: torch.Tensor, length: int) -> torch.Tensor:
        """t (rows, C) scattered to rows `pos` of a zero (length, C) tensor (pos == length: dropped)."""
        if t.element_size() == 1 and t.is_floating_point():  # FP8 has no index_copy: its bytes
            return Segments.place(t.contiguous().view(torch.uint8), pos, length).view(t.dtype)
        out = t.new_zeros(length + 1, *t.shape[1:])
        return out.index_copy_(0, pos, t)[:length]
