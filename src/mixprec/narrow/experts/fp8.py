"""Grouped experts in the FP8 recipes (tensor-, row- and block-wise): every expert's casts in
one pass over the stacked tensors, every GEMM one grouped GEMM, the group offsets on the device.

    x (S, K) sorted by expert, W (E, N, K) each expert's weight as an nn.Linear holds it
    y  = x @ W_e^T         a: x by token (tensor-wise: by expert)    b: W_e as the Linear's
    dx = dy @ W_e          a: dy likewise                             b: W_e as the Linear's dgrad
    dW_e = dy_e^T @ x_e    both along each expert's tokens

Each scale is the dense Linear's rule applied to one expert's slice: tensor-wise, the expert's
amax (a scale per row, the same for every row of an expert: torch's grouped row-wise kernel
serves it as it serves row-wise); row-wise, per token along K or N, per expert and column along
the tokens; block-wise, 1x128 tiles per token, 128x128 blocks per expert, 128-token tiles
counted from each expert's first row. The emulated GEMM is the dense one's
(mixprec.narrow.gemm.fp8.emulated_mm: FP8 products summed in FP32 over a K tile, times the two
scales) with each mm a grouped mm: torch's CPU grouped GEMM is a loop of mm over the groups,
so every expert's output and gradients equal its Linear run alone, bit for bit
(tests/narrow/test_experts.py). The block-wise weight gradient sums 128-token tiles: each
expert's tokens moved to a multiple of 128, the tiles are one batched GEMM, and the scaled
partial sums are added into their expert's in order (index_add_: sequential on the CPU,
deterministic on CUDA under torch.use_deterministic_algorithms). Every grouped GEMM is laid
out as torch's CUDA kernel takes it with any group sizes (`_grouped_mm` below;
tests/narrow/cuda_grouped_rules.py checks every call). On CUDA the row- and tensor-wise forward and
e4m3 input gradient run on torch's grouped row-wise kernel, and all three block-wise GEMMs on
mixprec's grouped block-wise kernels (mixprec.narrow.experts.blockwise), where their probes admit them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mixprec.narrow.kernels import cuda_compiled
from mixprec.narrow.experts import blockwise as experts_blockwise
from mixprec.narrow.experts.blockwise import BLOCK
from mixprec.narrow.formats.gathered import BACKWARD, FORWARD, gathered_experts
from mixprec.narrow.formats.recipe import E4M3
from mixprec.narrow.formats.scaling import Quantized, amax_to_scale, cast, quantize, resolve_tile
from mixprec.narrow.experts.segments import Segments, pad_to, segment_amax


ALIGN = 8  # elements in 16 bytes of bfloat16, what torch's grouped GEMM takes on CUDA (its TMA loads' alignment)
GROUPS = 1024  # torch's grouped GEMMs on CUDA take fewer groups than this


def _laid_out(t: torch.Tensor, column_major: bool) -> torch.Tensor:
    """t, or a copy of it with the same values, laid out as torch's grouped GEMM takes an operand on CUDA
    (check_valid_strides_and_return_transposed, at bfloat16's size): row-major, a unit last stride and a
    row stride of at least the row's length, a multiple of 16 bytes; or column-major, the same of its
    transpose; a 3-D operand's batch stride and the first element on 16 bytes too. The CPU runs the same
    layout, so that tests see the calls CUDA gets."""
    if column_major:
        return _laid_out(t.transpose(-2, -1), False).transpose(-2, -1)
    C = t.shape[-1]
    if (t.stride(-1) == 1 and t.stride(-2) >= max(1, C) and t.stride(-2) % ALIGN == 0
            and t.storage_offset() % ALIGN == 0 and (t.dim() == 2 or t.stride(0) % ALIGN == 0)):
        return t
    buf = t.new_zeros(*t.shape[:-1], -(-C // ALIGN) * ALIGN)
    buf[..., :C] = t
    return buf[..., :C]


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None, a_elements: torch.Tensor,
               b_elements: torch.Tensor) -> torch.Tensor:
    """torch's grouped GEMM on exact operands (FP8 elements, widened inside; dequantised values): a (S, K) @
    b (E, K, N) -> (S, N) by groups of rows, in the GEMM's own dtype (FP32 on the CPU, bfloat16 elsewhere: each
    FP32 sum rounded once, widened it would be a pass more and no value); or a (N, S) @ b (S, K) -> (E, N, K) by
    groups of the summed dimension (offs), or a (T, N, M) @ b (T, M, K) -> (T, N, K) batched (offs None), both
    FP32 (weight gradients, widened in the kernel that zeroes empty groups); rows past
    offs[-1] of a 2-D x 3-D result are zero, and so is an empty group's (E, N, K) slice. a and b are the
    narrow elements a_elements and b_elements widened or dequantised: they ride along so that `mixprec
    audit` reads each grouped GEMM's formats at the dispatcher (one operator, mixprec::grouped_mm, as a
    microscaled Linear's mixprec::mx_mm)."""
    return torch.ops.mixprec.grouped_mm(a, b, offs, a_elements, b_elements)


@torch.library.custom_op("mixprec::grouped_mm", mutates_args=())
def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None, a_elements: torch.Tensor,
                b_elements: torch.Tensor) -> torch.Tensor:
    # On the CPU in FP32: a loop of mm over the groups, each group's sum the dense GEMM's. Elsewhere
    # torch's grouped GEMM takes and writes bfloat16 only (its CUDA kernel and meta function): the
    # operands are exact in bfloat16, and each group's FP32 sum is rounded to bfloat16 once before
    # the scales (as torchao's MoE training writes its grouped GEMMs).
    dtype = torch.float32 if a.device.type == "cpu" else torch.bfloat16
    a, b = a.to(dtype), b.to(dtype)
    if offs is None:  # batched: no groups, so no limit on their number (CUDA's grouped GEMM takes < 1,024)
        return torch.bmm(a, b).float()
    if b.dim() == 3:  # a's rows split by offs: a row-major, b as it comes (both take any group sizes)
        out = torch._grouped_mm(_laid_out(a, False), _laid_out(b, b.stride(-2) == 1), offs=offs)
        return cuda_compiled.compiled(_rows_present, out.device.type)(out, offs)
    # the summed dimension split by offs: CUDA takes any group sizes (empty ones included) only with a
    # column-major and b row-major; other layouts assert every group but the last a positive multiple of
    # 16 bytes, on the device, which ends the process: a row-major a with a column-major b (an operand pair
    # cast so along the tokens) is taken as it comes, from a caller whose groups are that
    given = a.stride(-1) == 1 and b.stride(-2) == 1 and b.stride(-1) != 1
    out = torch._grouped_mm(_laid_out(a, not given), _laid_out(b, given), offs=offs)
    return cuda_compiled.compiled(_groups_present, out.device.type)(out, offs)


def _rows_present(out: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """A 2-D x 3-D grouped GEMM's (S, N) output, the rows past offs[-1] zero (one kernel on CUDA)."""
    return valid_rows(out.contiguous(), offs)


def _groups_present(out: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """A 2-D x 2-D grouped GEMM's (E, N, K) output in FP32 (a weight gradient, for FP32 masters: widened in the
    same kernel), an empty group's slice zero (one kernel on CUDA)."""
    sizes = torch.diff(offs, prepend=offs.new_zeros(1))  # (E,) each group's rows
    return torch.where(sizes[:, None, None] > 0, out.float().contiguous(), torch.zeros((), device=out.device))


def _scaled_groups(out: torch.Tensor, g_inv: torch.Tensor, x_inv: torch.Tensor) -> torch.Tensor:
    """Each expert's (N, K) sum times its scales along N and along K, in place: no second FP32 (E, N, K)
    (one kernel on CUDA)."""
    return out.mul_(g_inv[:, :, None]).mul_(x_inv[:, None, :])


@_grouped_mm.register_fake
def _(a, b, offs, a_elements, b_elements):
    if offs is None:
        return a.new_empty(a.shape[0], a.shape[1], b.shape[2], dtype=torch.float32)
    if b.dim() == 3:  # the GEMM's own dtype (the operator's body)
        return a.new_empty(a.shape[0], b.shape[2], dtype=torch.float32 if a.device.type == "cpu" else torch.bfloat16)
    return a.new_empty(offs.shape[0], a.shape[0], b.shape[1], dtype=torch.float32)


# ---- the casts ------------------------------------------------------------------------------
# Each cast is one function of tensors that CUDA runs compiled (mixprec.narrow.kernels.cuda_compiled: Inductor fuses the
# amax, the scale and the cast into a kernel or two that read the input once; eagerly each op is a pass over
# the tensor in FP32); the same functions run eagerly elsewhere, so the CPU's numbers are the eager ones.
def _by_token(t, c: int, dtype, pow2: bool):
    """t (S, C) in (1, c) tiles (c 0: the whole row): (data, scale_inv)."""
    q, _ = quantize(t, dtype, (1, c), power_of_2=pow2)
    return q.data, q.scale_inv


def _by_expert(t, ids, n: int, dtype, pow2: bool):
    """t (S, C) with one scale per expert (ids: each row's, n of them), held per row: (data, the rows' scale_inv
    (S, 1), each expert's scale_inv (n,))."""
    scale = amax_to_scale(segment_amax(t.abs().float(), ids, n).amax(dim=1), dtype, pow2)  # (n,)
    q = cast(t, scale[ids][:, None], (1, t.shape[1]), dtype)
    return q.data, q.scale_inv, scale.reciprocal()


def _column_scales(t, group, n: int, dtype, pow2: bool, t_scale_inv, t_tile):
    """(t, dequantised first where FP8 in t_tile tiles; its scale per column over each group of rows (n, C))."""
    if t_scale_inv is not None:
        t = Quantized(t, t_scale_inv, t_tile).dequantize()
    return t, amax_to_scale(segment_amax(t.abs().float(), group, n), dtype, pow2)


@cuda_compiled.sized("n")  # block-wise: the tiles follow the rows
def _along(t, group, n: int, dtype, pow2: bool, t_scale_inv=None, t_tile=(1, 1)):
    """t (S, C) with one scale per column over each group of rows (ids `group`, n groups): (data, scale_inv
    (n, C)). t_scale_inv: t is FP8 in t_tile tiles, dequantised first (in the same kernel on CUDA)."""
    t, scale = _column_scales(t, group, n, dtype, pow2, t_scale_inv, t_tile)
    return cast(t, scale[group], (1, 1), dtype).data, scale.reciprocal()


@cuda_compiled.sized("n")
def _along_placed(t, group, n: int, src, dtype, pow2: bool, t_scale_inv=None, t_tile=(1, 1)):
    """`_along`'s cast with its rows placed at the positions that read them (src: each position's row, len(t)
    for a zero row) and written transposed: (data (C, P) row-major, scale_inv (n, C)); each element the one
    `_along` casts (the placing and the transposed layout are the writes of the same kernel on CUDA)."""
    t, scale = _column_scales(t, group, n, dtype, pow2, t_scale_inv, t_tile)
    rows = torch.cat([t, t.new_zeros(1, t.shape[1])])[src]  # (P, C), zero rows between the groups
    group = torch.cat([group, group.new_full((1,), n - 1)])[src]  # a zero row's scale: any, 0 casts to 0
    return cast(rows, scale[group], (1, 1), dtype).data.t().contiguous(), scale.reciprocal()


def _stacked(w, tile: tuple[int, int], dtype, pow2: bool, column_major: bool = False, phantom: bool = False):
    """w (E, R, C) per expert in (tr, tc) tiles (0: the whole dimension), each expert's rows padded to whole
    tiles: (data (E, R, C), scale_inv (E, ceil(R/tr), ceil(C/tc))). column_major: the data written with R
    the unit stride (the grouped row-wise kernel's b), same values. phantom: one more expert of zeros (E + 1)."""
    if phantom:
        w = F.pad(w, (0, 0, 0, 0, 0, 1))
    E, R, C = w.shape
    tr, tc = tile[0] or R, tile[1] or C
    q, _ = quantize(pad_to(w, tr, dim=1).reshape(-1, C), dtype, (tr, tc), power_of_2=pow2)
    data = q.data.view(E, -1, C)[:, :R]
    if column_major:
        data = data.transpose(1, 2).contiguous().transpose(1, 2)
    return data, q.scale_inv.view(E, -1, q.scale_inv.shape[1])


def cast_tokens(t: torch.Tensor, seg: Segments, tile: tuple[int, int], dtype, pow2: bool):
    """t (S, C) cast along C: per token in (1, c) tiles (row- and block-wise), or with one scale per
    expert (tensor-wise, tile (0, 0)) held as a scale per row. Returns it and, tensor-wise, each
    expert's inverse scale (E + 1,) (the weight gradient's), else None."""
    device = t.device.type
    if tile[0] == 1:
        data, inv = cuda_compiled.compiled(_by_token, device)(t, tile[1], dtype, pow2)
        return Quantized(data, inv, resolve_tile(tile, t.shape)), None
    data, rows_inv, inv = cuda_compiled.compiled(_by_expert, device)(t, seg.ids, seg.n + 1, dtype, pow2)
    return Quantized(data, rows_inv, (1, t.shape[1])), inv


def cast_along_tokens(t: torch.Tensor | Quantized, seg: Segments, rows: int, dtype, pow2: bool,
                      src: torch.Tensor | None = None):
    """t (S, C) cast along the tokens for a weight-gradient GEMM: one scale per column over each
    expert's tokens (rows 0) or over each `rows`-token tile of an expert (`Segments.tiles`); an FP8 t
    (Quantized) is dequantised first. Returns the FP8 data (S, C) and the inverse scales (groups, C),
    groups indexed as the tiles or experts. src (`Segments.sources`): the data placed in that layout and
    written transposed (C, P), as a kernel reads it."""
    group, n = (seg.tiles(rows)[0], seg.rows // rows + seg.n + 1) if rows else (seg.ids, seg.n + 1)
    data, scale_inv, tile = (t.data, t.scale_inv, t.tile) if isinstance(t, Quantized) else (t, None, (1, 1))
    if src is None:
        return cuda_compiled.compiled(_along, seg.offs.device.type)(data, group, n, dtype, pow2, scale_inv, tile)
    cast_ = cuda_compiled.compiled(_along_placed, seg.offs.device.type)
    return cast_(data, group, n, src, dtype, pow2, scale_inv, tile)


def cast_stacked(w: torch.Tensor, tile: tuple[int, int], dtype, pow2: bool, which: str = FORWARD,
                 column_major: bool = False, phantom: bool = False) -> Quantized:
    """w (E, R, C) cast per expert in tiles of (tr, tc) (0: the whole dimension): data (E, R, C), scale_inv
    (E, ceil(R/tr), ceil(C/tc)). Each expert's rows are padded with zeros to whole tiles, so no tile spans two.
    An experts weight FSDP2 gathered in its narrow format is read as it came: each expert's copy for `which`
    pass, as the dense Linear reads its gathered copy. column_major: the data laid out with R the unit stride
    (written so by the cast: the input gradient's b on the grouped row-wise kernel, which reads it so).
    phantom: a zero expert after the last, cast with them (`mm`: the rows past offs[-1] are its, zeros), where
    one group more stays below CUDA's limit."""
    gathered = gathered_experts(w, which)
    if gathered is not None:
        return gathered
    E, R, C = w.shape
    phantom = phantom and E + 1 < GROUPS
    data, inv = cuda_compiled.compiled(_stacked, w.device.type)(w, tile, dtype, pow2, column_major, phantom)
    return Quantized(data, inv, (tile[0] or R, tile[1] or C))


def transposed(q: Quantized) -> Quantized:
    """A stacked (E, R, C) tensor as (E, C, R)."""
    return Quantized(q.data.transpose(1, 2), q.scale_inv.transpose(1, 2), q.tile[::-1])


# ---- the GEMMs ------------------------------------------------------------------------------
def valid_rows(out: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """out with the rows past offs[-1] zeroed (a grouped GEMM leaves them undefined), on the device."""
    rows = torch.arange(out.shape[0], device=out.device) < offs[-1]
    return torch.where(rows[:, None], out, torch.zeros((), dtype=out.dtype, device=out.device))


def _scaled_grouped_mm(a, b, scale_a, scale_b, offs, fast_accum: bool = False):
    """torch's grouped row-wise GEMM (its meta function states the layout: a row-major, b column-major;
    2-D x 3-D: a (S, K), b (E, K, N), scale_a (S,), scale_b (E, N); 2-D x 2-D, the summed dimension split:
    a (N, P), b (P, K), scale_a (E * N,), scale_b (E * K,)); a test stands a reference in for it on the CPU."""
    return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs, out_dtype=torch.bfloat16,
                                    use_fast_accum=fast_accum)


def on_row_kernel(kernel: bool, a_dtype: torch.dtype, K: int, N: int) -> bool:
    """Whether a row- or tensor-wise grouped GEMM runs on torch's grouped row-wise kernel: where the plan
    says so, on e4m3 operands (tensor-wise's e5m2 gradients are emulated) and K, N multiples of 16."""
    return kernel and a_dtype == E4M3 and K % 16 == 0 and N % 16 == 0


def mm(a: Quantized, b: Quantized, seg: Segments, out_dtype: torch.dtype, kernel: bool,
       fast_accum: bool = False) -> torch.Tensor:
    """a (S, K) @ b_e (K, N) for each expert's rows -> (S, N), b stacked (E, K, N); a scaled per token
    (or per expert as per token) and K tile, b per expert, K tile and column tile. On torch's grouped
    row-wise kernel where `kernel` (scales one per row of a and per expert and column of b; fast_accum:
    its reduced-precision accumulation, as the recipe's dense forward), else emulated as
    mixprec.narrow.gemm.fp8.emulated_mm, each mm a grouped mm."""
    (S, K), N = a.data.shape, b.data.shape[2]
    E, kt, nt = b.scale_inv.shape
    if kernel and b.tile == (BLOCK, BLOCK):  # block-wise: mixprec's Triton kernels (mixprec.narrow.experts.blockwise)
        return experts_blockwise.mm(a, b, seg, out_dtype)
    if on_row_kernel(kernel, a.data.dtype, K, N):
        sb = b.scale_inv.reshape(E, nt).expand(E, N) if nt == 1 else b.scale_inv.reshape(E, N)
        column_major = b.data.transpose(1, 2).contiguous().transpose(1, 2)  # a copy unless cast so
        # a zero expert cast after the last (`cast_stacked(phantom=True)`) takes the rows past offs[-1]: they come
        # out zero from the kernel itself, no pass over the output to zero them (a finite row times zeros)
        phantom = E == seg.n + 1
        offs = torch.cat([seg.offs, seg.offs.new_full((1,), S)]) if phantom else seg.offs
        out = _scaled_grouped_mm(a.data.contiguous(), column_major, a.scale_inv.reshape(-1).contiguous(),
                                 sb.contiguous(), offs, fast_accum=fast_accum)
        return (out if phantom else valid_rows(out, seg.offs)).to(out_dtype)
    kb = min(a.tile[1], b.tile[0])  # K elements per partial sum
    sb_rows = seg.per_row(torch.cat([b.scale_inv, b.scale_inv.new_ones(1, kt, nt)]))  # (S, kt, nt)

    def scaled(partial, ka, kb_):  # times a's scales of K tile ka, then b's of K tile kb_ (per column tile)
        return partial * a.scale_inv[:, ka:ka + 1] * sb_rows[:, kb_].repeat_interleave(b.tile[1], dim=1)[:, :N]

    if kb >= K:
        out = scaled(grouped_mm(a.data, b.data, seg.offs, a.data, b.data), 0, 0)
    else:
        out = torch.zeros(S, N, device=a.data.device)
        for k in range(0, K, kb):  # one partial sum per K tile, promoted into the FP32 accumulator
            a_k, b_k = a.data[:, k:k + kb], b.data[:, k:k + kb]
            partial = grouped_mm(a_k, b_k, seg.offs, a_k, b_k)
            out += scaled(partial, k // a.tile[1], k // b.tile[0])
    return valid_rows(out, seg.offs).to(out_dtype)


def wgrad_mm(g_data, g_inv, x_data, x_inv, seg: Segments, rows: int) -> torch.Tensor:
    """Each expert's dy_e^T (N, M_e) @ x_e (M_e, K) in FP32 -> (E, N, K): the FP8 products summed over
    the expert's tokens (rows 0) or over each `rows`-token tile, each sum times the tiles' scales
    (g_inv, x_inv (groups, N) and (groups, K)), the tiles' sums added in order."""
    if not rows:
        out = grouped_mm(g_data.t(), x_data, seg.offs, g_data, x_data)  # (E, N, K)
        return cuda_compiled.compiled(_scaled_groups, out.device.type)(out, g_inv[:seg.n], x_inv[:seg.n])
    # each expert's tokens from a multiple of `rows` (zero rows between), so tile t is rows t*rows:(t+1)*rows,
    # the t-th of Segments.tiles, and the tiles' sums are one batched GEMM: no groups (a grouped GEMM with a
    # group per tile passes CUDA's 1,024 groups at 131,072 rows)
    pos, ends, P = seg.aligned(rows)
    T = P // rows
    g_tiles = Segments.place(g_data, pos, P).view(T, rows, -1)  # (T, rows, N)
    x_tiles = Segments.place(x_data, pos, P).view(T, rows, -1)  # (T, rows, K)
    partial = grouped_mm(g_tiles.transpose(1, 2), x_tiles, None, g_data, x_data)  # (T, N, K): each tile's sum
    partial = partial * g_inv.narrow(0, 0, T)[:, :, None] * x_inv.narrow(0, 0, T)[:, None, :]  # (narrow: one op
    # whether or not T is all the tiles the casts counted)
    expert_of_tile = torch.searchsorted(ends.long(), torch.arange(0, P, rows, device=ends.device), right=True)
    out = partial.new_zeros(seg.n + 1, *partial.shape[1:])
    # in tile order: sequential on the CPU, deterministic on CUDA under torch.use_deterministic_algorithms
    return out.index_add_(0, expert_of_tile, partial)[:seg.n]


def scaled_wgrad(dy: torch.Tensor, xq: Quantized, seg: Segments, grad_dtype, pow2: bool) -> torch.Tensor:
    """Each expert's dy_e^T (N, M_e) @ x_e (M_e, K) -> (E, N, K) bfloat16 on torch's grouped row-wise kernel,
    2-D x 2-D (the summed tokens split by expert): both cast along each expert's tokens as `cast_along_tokens`
    casts them (x from the forward's FP8 rows), placed with each expert's tokens padded to 16 with zero rows
    (an empty expert: 16 of them; the kernel takes no empty group) and written transposed: a = dy^T (N, P)
    row-major, b = x (P, K) column-major, as the kernel reads them (torchao's MoE weight gradient's layout)."""
    src, ends, P = seg.sources(16)
    g_t, g_inv = cast_along_tokens(dy, seg, 0, grad_dtype, pow2, src)  # (N, P), (E + 1, N)
    x_t, x_inv = cast_along_tokens(xq, seg, 0, E4M3, pow2, src)  # (K, P), (E + 1, K)
    return _scaled_grouped_mm(g_t, x_t.t(), g_inv[:seg.n].reshape(-1), x_inv[:seg.n].reshape(-1), ends)


# ---- a projection's passes ------------------------------------------------------------------
def forward(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, g, xq: Quantized | None = None) -> torch.Tensor:
    """x (S, K) @ each expert's W_e^T, w (E, N, K), under the projection `g` (mixprec.narrow.experts.ops.ExpertsGemm):
    (S, N) in the plan's compute dtype. xq: x already cast as this recipe casts it (expert parallelism's FP8
    dispatch), used as it is."""
    plan = g.plan
    r, t = plan.recipe, plan.tiles
    seg = Segments(offs, x.shape[0])
    if xq is None:
        xq, _ = cast_tokens(x, seg, t.x, E4M3, r.power_of_2_scales)
    (N, K), pow2 = w.shape[1:], r.power_of_2_scales
    row_kernel = t.w != (BLOCK, BLOCK) and on_row_kernel(g.grouped, E4M3, K, N)
    wq = cast_stacked(w, t.w, E4M3, pow2, phantom=row_kernel)  # `mm`: the rows past offs[-1]
    return mm(xq, transposed(wq), seg, plan.compute_dtype, g.grouped, r.fast_accum)


def backward(x, w, offs, dy, g, xq: Quantized | None = None, x_dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx (S, K) in x's dtype, dW (E, N, K) in w's dtype): the dense Linear's backward for each expert.
    xq: the forward's cast of x, kept (x None, dx in x_dtype; row- and block-wise only)."""
    plan = g.plan
    r, t = plan.recipe, plan.tiles
    pow2 = r.power_of_2_scales
    seg = Segments(offs, dy.shape[0])
    if xq is None:
        xq, x_inv = cast_tokens(x, seg, t.x, E4M3, pow2)  # the forward's cast again (deterministic)
        x_dtype = x.dtype
    gq, g_inv = cast_tokens(dy, seg, t.g, r.grad_dtype, pow2)
    N, K = w.shape[1:]
    blockwise = plan.kernels[2] and t.w == (BLOCK, BLOCK)  # mixprec's kernels, which read b K-major
    row_kernel = not blockwise and on_row_kernel(plan.kernels[1], r.grad_dtype, N, K)
    wq_d = cast_stacked(w, t.w_dgrad or t.w, E4M3, pow2, BACKWARD if t.w_dgrad else FORWARD,
                        column_major=row_kernel or blockwise, phantom=row_kernel)  # summed over N
    dx = mm(gq, wq_d, seg, plan.compute_dtype, g.grouped).to(x_dtype)
    del wq_d  # what the weight gradient does not read is freed before it runs (a smaller peak)
    if t.g_wgrad:  # cast again along the tokens
        del gq
    if t.g_wgrad == (0, 1) and on_row_kernel(plan.kernels[2], r.grad_dtype, N, K):  # row-wise, per expert
        return dx, scaled_wgrad(dy, xq, seg, r.grad_dtype, pow2).to(w.dtype)
    if blockwise:  # 128-token tiles, cast into the contiguous layout transposed, as the kernel reads them
        rows = t.g_wgrad[0]
        src, _, _ = seg.sources(rows, nonempty=False)
        g_t, g_inv = cast_along_tokens(dy, seg, rows, r.grad_dtype, pow2, src)
        x_t, x_inv = cast_along_tokens(xq, seg, rows, E4M3, pow2, src)
        return dx, experts_blockwise.wgrad(g_t, g_inv, x_t, x_inv, seg, w.dtype)
    if t.g_wgrad:  # scaled along the tokens: row-wise per expert, block-wise per 128-token tile
        rows = t.g_wgrad[0]
        g_data, g_inv = cast_along_tokens(dy, seg, rows, r.grad_dtype, pow2)
        x_data, x_inv = cast_along_tokens(xq, seg, rows, E4M3, pow2)  # the forward's FP8 x, dequantised
    else:  # tensor-wise: the casts of the forward and the input gradient, one scale per expert
        rows, g_data, x_data = 0, gq.data, xq.data
        g_inv, x_inv = g_inv[:, None], x_inv[:, None]
    return dx, wgrad_mm(g_data, g_inv, x_data, x_inv, seg, rows).to(w.dtype)
