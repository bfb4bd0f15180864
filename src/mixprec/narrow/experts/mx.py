"""Grouped experts in the microscaled recipes (MXFP8, NVFP4, MXFP4): every expert's casts in one
pass over the stacked tensors, every GEMM one grouped GEMM on the dequantised operands.

Each cast is the dense MXLinear's (mixprec.narrow.formats.mx) on one expert's slice:
    blocks along K or N  per token (x, dy) or per expert row (W, W^T): one cast of the whole stack;
    NVFP4's tensor scale the amax of the expert's slice, held per row or per block;
    blocks along the tokens (the weight gradient's x^T and dy^T) in a layout where each expert's
        first token sits at a multiple of the block (`Segments.aligned`), so no block spans two
        experts; with NVFP4's Hadamard transform, each expert's tokens padded to 16 first, as the
        dense layer pads them;
    stochastic rounding keyed per expert (the bits of its dy, its salt, the operand) and drawn
        for each element's index within its expert's tensor, as the dense cast draws them.
The GEMMs are the dense emulation's (FP32 sums of the dequantised operands, NVFP4's two tensor
scales after) with each mm a grouped mm, so every expert's outputs and gradients equal its
MXLinear run alone, bit for bit, on the CPU (tests/narrow/test_experts.py).
"""

from __future__ import annotations

import torch

from mixprec.narrow.kernels import cuda_compiled
from mixprec.narrow.formats import mx
from mixprec.narrow.experts.fp8 import grouped_mm, valid_rows
from mixprec.narrow.formats.gathered import BACKWARD, FORWARD, gathered_experts
from mixprec.narrow.formats.microscaling import E2M1, Blocked, rotate
from mixprec.narrow.experts.segments import Segments, pad_to, segment_amax


def _role(r, gradient: bool, key):
    """(the element dtype, the rounding key or None) of a cast: a gradient's in the recipe's gradient format
    (FP4 recipes: their element) with its stochastic rounding's key where the recipe rounds so."""
    dtype = r.grad_dtype if gradient and r.element != E2M1 else r.element
    return dtype, (key if gradient and r.stochastic_gradients else None)


def _cast_tokens(r, t: torch.Tensor, seg: Segments, *, gradient: bool = False, row_key=None) -> Blocked:
    """The recipe's cast of the tokens t (S, C) along C, with its dequantised values (the GEMM's operand):
    MXRecipe.quantize, NVFP4's tensor amax each expert's, stochastic rounding keyed by row_key (S, 1) (each
    row's expert's key) and each element's index in its expert's tensor."""
    dtype, row_key = _role(r, gradient, row_key)
    width = -(-t.shape[1] // r.block) * r.block  # an expert's tensor's padded row length
    cast = cuda_compiled.compiled(_token_cast, t.device.type)
    return cast(t, seg.ids, seg.n + 1, seg.local, width, row_key, dtype, r.block, r.scale_rounding, r.nv,
                r.four_over_six, mx._operand_dtype(t.device.type))


def _token_cast(t, ids, n: int, local, width: int, row_key, element, block: int, rounding, nv: bool,
                four_over_six: bool, values) -> Blocked:
    """mx._cast of t (S, C) with NVFP4's amax per expert (ids: each row's, n of them) and the keys of stochastic
    rounding (row_key; each element's index from its row's place in its expert, `local`); one function, so that
    on CUDA the amax, the keys and the cast are one compiled kernel or two."""
    amax = segment_amax(t.abs().float(), ids, n).amax(dim=1)[ids][:, None] if nv else None
    key = (_index(local, width, width), row_key) if row_key is not None else None
    return mx._cast(t, element, block, rounding, nv, False, four_over_six, key, amax, values)


def _elements(q: Blocked) -> torch.Tensor:
    """A cast's elements in their own dtype (e2m1 bytes as float4_e2m1fn_x2): what the audit reads."""
    return q.typed().data


def _stacked(r, w: torch.Tensor, square: bool, which: str = FORWARD):
    """w (E, N, K) cast per expert along K (which = BACKWARD: w^T along N): (the values (E, R, C), NVFP4's
    tensor scale per expert (E,) or None, the elements). An experts weight FSDP2 gathered in its narrow
    format is read as it came: each expert's copy for `which` pass, as the dense MXLinear reads its own."""
    q = gathered_experts(w, which)
    if q is not None:  # the stack's rows dequantised at once: blocks never span two experts' rows
        E, rows, R = q.data.shape[0], q.data.shape[1], q.shape[0]
        flat = Blocked(q.data.reshape(E * rows, -1), q.scale.reshape(E * q.scale.shape[1], -1), q.block, None,
                       (E * rows, q.shape[1]))
        values = flat.dequantize(with_tensor_scale=False, dtype=mx._operand_dtype(w.device.type))
        return values.view(E, rows, -1)[:, :R], q.tensor_scale, q.typed().data
    E, R, C = (w.shape[0], w.shape[2], w.shape[1]) if which == BACKWARD else w.shape
    rows = r.block if square else 1  # square blocks: each expert's rows padded to whole blocks
    cast = cuda_compiled.compiled(_cast_stack, w.device.type)
    q = cast(w, which == BACKWARD, rows, r.element, r.block, r.scale_rounding, r.nv, square, r.four_over_six,
             mx._operand_dtype(w.device.type))
    ts = q.tensor_scale.view(E, -1)[:, 0] if r.nv else None
    return q.values.view(E, -1, C)[:, :R], ts, _elements(q)


def _cast_stack(w, transpose: bool, rows: int, element, block: int, rounding, nv: bool, square: bool,
                four_over_six: bool, values) -> Blocked:
    """mx._cast of the stack w (E, R, C) (transposed: each W_e^T) along C, each expert's rows padded to `rows`,
    NVFP4's tensor amax the expert's; one function, so that on CUDA the transposed read, the padding, the amax
    and the cast are one compiled kernel or two (no transposed FP32 copy of the weights)."""
    w = w.transpose(1, 2) if transpose else w
    C = w.shape[2]
    padded = pad_to(w, rows, dim=1)
    per_block_row = padded.shape[1] // rows
    amax = w.abs().float().amax(dim=(1, 2)).repeat_interleave(per_block_row)[:, None] if nv else None
    return mx._cast(padded.reshape(-1, C), element, block, rounding, nv, square, four_over_six, None, amax, values)


def _keys(dy: torch.Tensor, seg: Segments, salts: torch.Tensor, role: int) -> torch.Tensor:
    """(E + 1,) int32: mx._key of each expert's dy, salt and operand (the bits' integer sum per expert)."""
    row_sums = mx.bits_of(dy).sum(dim=1, dtype=torch.long)  # summed in int64, no int64 copy of dy
    return mx.mix_key(row_sums.new_zeros(seg.n + 1).index_add_(0, seg.ids, row_sums), salts, role)


def _index(rows: torch.Tensor, width: torch.Tensor | int, columns: int) -> torch.Tensor:
    """(R, columns) int32: element (r, c)'s index in its own expert's tensor, rows[r] its row there and
    `width` that tensor's padded row length."""
    cols = torch.arange(columns, device=rows.device, dtype=torch.int32)
    return (rows.to(torch.int32)[:, None] * width + cols).to(torch.int32)


def _per_row(seg: Segments, per_expert: torch.Tensor) -> torch.Tensor:
    """(E,) -> (S, 1): each row's expert's value (the rows past offs[-1] take expert 0's: they are zeroed)."""
    return seg.per_row(torch.cat([per_expert, per_expert[:1]]))[:, None]


def _tensor_scaled(out: torch.Tensor, a_ts: torch.Tensor, b_ts: torch.Tensor, offs: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    """A grouped GEMM's (S, N) out times NVFP4's two tensor scales per row, the rows past offs[-1] zero
    (whatever their scales), in `dtype` (one kernel on CUDA)."""
    return valid_rows(out * a_ts * b_ts, offs).to(dtype)


def forward(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, g) -> torch.Tensor:
    """x (S, K) @ each expert's W_e^T, w (E, N, K): (S, N) in the plan's compute dtype."""
    r = g.plan.recipe
    seg = Segments(offs, x.shape[0])
    xq = _cast_tokens(r, x, seg)
    w_values, w_ts, w_elements = _stacked(r, w, r.weight_2d)
    out = grouped_mm(xq.values, w_values.transpose(1, 2), offs, _elements(xq), w_elements)  # rows past offs[-1] 0
    if r.nv:  # the tensor scales after the GEMM, as the hardware applies them
        out = cuda_compiled.compiled(_tensor_scaled, out.device.type)(out, xq.tensor_scale, _per_row(seg, w_ts), offs,
                                                                      g.plan.compute_dtype)
    return out.to(g.plan.compute_dtype)


def backward(x, w, offs, dy, g, salts: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx (S, K) in x's dtype, dW (E, N, K) in w's dtype): the dense MXLinear's backward for each expert.
    salts: (E + 1,) each expert's (mixprec.narrow.experts.ops.Key); None: 0 for each, as a dense layer's
    without a salt."""
    r, device = g.plan.recipe, x.device
    (S, K), N = x.shape, dy.shape[1]
    seg = Segments(offs, S)
    if not r.stochastic_gradients:
        salts = None
    elif salts is None:
        salts = torch.zeros(seg.n + 1, dtype=torch.long, device=device)
    else:  # on the layer's device already (ExpertsLayer.on): no copy in the step
        salts = salts.to(device, non_blocking=True)
    # the input gradient: dy along N per token, W^T along N per expert
    row_key = seg.per_row(_keys(dy, seg, salts, 0))[:, None] if salts is not None else None
    gq = _cast_tokens(r, dy, seg, gradient=True, row_key=row_key)
    if r.weight_2d:  # the forward's square blocks serve W^T: the same values, read as they are (E, N, K)
        w_values, w_ts, w_elements = _stacked(r, w, True)
    else:  # W^T (E, K, N) cast along N, read transposed
        wt_values, w_ts, w_elements = _stacked(r, w, False, BACKWARD)
        w_values = wt_values.transpose(1, 2)
    dx = grouped_mm(gq.values, w_values, offs, _elements(gq), w_elements)
    if r.nv:
        dx = cuda_compiled.compiled(_tensor_scaled, dx.device.type)(dx, gq.tensor_scale, _per_row(seg, w_ts), offs,
                                                                    g.plan.compute_dtype)
    dx = dx.to(g.plan.compute_dtype).to(x.dtype)
    del gq, w_values, w_elements  # freed before the weight gradient runs (it casts dy and x again, along the tokens)
    if not r.weight_2d:
        del wt_values
    return dx, _wgrad(r, x, dy, seg, salts).to(w.dtype)


@cuda_compiled.sized("P")  # the layout's length follows the rows
def _placed_cast(t, pos, P: int, h, column_expert, n: int, element, block: int, rounding, nv: bool,
                 four_over_six: bool, key, values) -> Blocked:
    """mx._cast of t (S, C) placed at rows `pos` of a zero (P, C) layout and transposed (C, P), rotated by the
    Hadamard signs h (or not), NVFP4's tensor amax each expert's (column_expert: each position's, n of them),
    stochastic rounding keyed by key = (each position's expert's padded token count, its index there, its
    expert's key): element (c, m) of an expert's (C, its tokens) tensor drawn at c * that count + m; one
    function, so that on CUDA the placing, the rotation, the keys and the cast are one compiled kernel or two."""
    tt = Segments.place(t, pos, P).t()  # (C, P): each expert's tokens from a multiple of the block
    if h is not None:
        tt = rotate(tt, h)
    amax = None
    if nv:  # the tensor scale of each expert's (C, its tokens) slice, per block of tokens
        per_expert = segment_amax(tt.abs().float().amax(dim=0)[:, None], column_expert, n)[:, 0]
        amax = per_expert[column_expert].view(-1, block)[:, 0][None, :]
    if key is not None:
        padded, local, keys = key
        rows = torch.arange(tt.shape[0], device=tt.device)
        key = ((rows[:, None] * padded[None, :] + local[None, :]).to(torch.int32), keys)
    return mx._cast(tt, element, block, rounding, nv, False, four_over_six, key, amax, values)


def sums_as_cast(device_type: str) -> bool:
    """Whether the weight gradient's GEMM (without the rotation) sums the tokens' layout as cast: every expert
    from a multiple of the block, one block at least, zero rows between (off the CPU: no gather back to the
    sorted rows). The CPU's grouped GEMM, a loop of mm, sums each expert's own tokens instead: its bits are the
    dense layer's, which zero rows appended to each sum would move (another blocking of the sum)."""
    return device_type != "cpu"


def _wgrad(r, x: torch.Tensor, dy: torch.Tensor, seg: Segments, salts) -> torch.Tensor:
    """(E, N, K) FP32: each expert's dy_e^T @ x_e, both cast along the expert's tokens."""
    h = r.transform(x.device)
    pad = mx.HADAMARD_SIZE if h is not None else 1  # the dense layer pads each expert's tokens to 16 to rotate
    multiple = max(pad, r.block)
    as_cast = h is None and sums_as_cast(x.device.type)
    pos, ends, P = seg.aligned(multiple, nonempty=as_cast)
    # each position's expert, its start and its tensor's padded length in the aligned layout
    column_expert = torch.searchsorted(ends.long(), torch.arange(P, device=x.device), right=True)  # (P,) 0..E
    starts = torch.cat([ends.new_zeros(1), ends]).long()
    width = torch.cat([-(-seg.sizes // pad) * pad, seg.sizes.new_zeros(1)])  # (E + 1,) tokens in the GEMM

    def along_tokens(t: torch.Tensor, gradient: bool, key=None) -> Blocked:  # as `_cast_tokens` casts, placed first
        dtype, key = _role(r, gradient, key)
        cast = cuda_compiled.compiled(_placed_cast, t.device.type)
        return cast(t, pos, P, h, column_expert, seg.n + 1, dtype, r.block, r.scale_rounding, r.nv, r.four_over_six,
                    key, mx._operand_dtype(t.device.type))

    key = None
    if salts is not None:  # element (n, m) of an expert's (N, its tokens padded to whole blocks): n * that + m
        local = torch.arange(P, device=x.device) - starts[column_expert]
        padded = -(-width // r.block) * r.block
        key = (padded[column_expert], local, _keys(dy, seg, salts, 1)[column_expert][None, :])  # indices: in the cast
    gt, xt = along_tokens(dy, True, key), along_tokens(x, False)
    if as_cast:  # dy^T (N, P) row-major, x (P, K) column-major, zero rows between the experts (adding nothing),
        # every group a positive multiple of the block, as CUDA takes that layout
        offs, g_values, x_values = ends, gt.values, xt.values.t()
    else:
        if h is not None:  # the GEMM sums each expert's tokens padded to 16 (rotated, the padding is not zero)
            _, offs, P16 = seg.aligned(pad)
            at = torch.arange(P16, device=x.device)
            expert16 = torch.searchsorted(offs.long(), at, right=True)
            at = (starts[expert16] + at - torch.cat([offs.new_zeros(1), offs]).long()[expert16]).clamp(max=P - 1)
        else:  # the GEMM sums each expert's own tokens: back to the sorted rows
            offs, at = seg.offs, pos.clamp(max=P - 1)
        # dy^T column-major (N, tokens) and x row-major (tokens, K): the layout torch's grouped GEMM takes with
        # any group sizes on CUDA (mixprec.narrow.experts.fp8.grouped_mm)
        g_values, x_values = gt.values.t()[at].t(), xt.values.t()[at]
    out = grouped_mm(g_values, x_values, offs, _elements(gt), _elements(xt))  # (E, N, K)
    if r.nv:  # each expert's tensor scale, read at its last block; an empty expert has none: zeros
        last = (ends.long() // r.block - 1).clamp(min=0)
        g_ts, x_ts = (q.tensor_scale.reshape(-1)[last] for q in (gt, xt))
        out = cuda_compiled.compiled(_expert_scaled, out.device.type)(out, g_ts, x_ts, seg.sizes)
    return out


def _expert_scaled(out: torch.Tensor, g_ts: torch.Tensor, x_ts: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """The weight gradient's (E, N, K) times each expert's two tensor scales (E,), an empty expert's zero (one
    kernel on CUDA)."""
    scaled = out * g_ts[:, None, None] * x_ts[:, None, None]
    return torch.where(sizes[:, None, None] > 0, scaled, torch.zeros((), device=out.device))
