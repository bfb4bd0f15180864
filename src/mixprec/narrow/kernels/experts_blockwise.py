"""The Triton kernels of mixprec.narrow.experts.blockwise: grouped block-wise FP8 GEMMs on the
contiguous layout DeepGEMM trains with (each expert's tokens from a multiple of 128, zero rows
between), DeepSeek-V3's scheme: FP8 products summed in FP32 over one 128-wide tile of the summed
dimension, each partial sum times its two scales and added into an FP32 accumulator.

    m_grouped   out (S, OUT) = a (S, SUM) @ b_e, each 128-position tile of the layout one expert's
                (forward, input gradient), a's rows read and out's written through the layout's map;
                a in 1 x 128 tiles, b (E, ., .) in 128 x 128 blocks, SUM its unit stride
    k_grouped   dW_e (OUT_N, OUT_K) = g_e^T @ x_e over the expert's 128-token tiles (weight gradient);
                g and x in 128 x 1 tiles along the tokens, laid out transposed (the tokens contiguous)

In a module of its own: Triton is optional, and its code generator resolves `tl` in the module's
globals. COMPILE_CASES lists the signatures the routes launch them with; tests/narrow/
test_triton_compile.py compiles each for Hopper (sm_90) on the CPU.
"""

import triton
import triton.language as tl


@triton.jit
def m_grouped(a_ptr, sa_ptr, b_ptr, sb_ptr, src_ptr, tile_expert_ptr, out_ptr, S, E, SUM, OUT, ST, b_stride_e,
              b_stride_sum, b_stride_out, sb_stride_e, sb_stride_sum, sb_stride_out, BLOCK: tl.constexpr):
    """One 128 x 128 tile of out: the rows at positions of tile program_id(0) of the contiguous layout
    (src: each position's row of a and out, S for a zero row between experts), which belong to expert
    tile_expert[it] (E: no expert, zeros), columns of tile program_id(1). a (S, SUM) row-major, read and
    written through src (no copy in the layout); sa (S, ST): a's scale_inv per row and tile of SUM; b with
    SUM its unit stride (b_stride_sum 1): both operands K-major, as Hopper's FP8 wgmma reads them; sb: b's
    per expert, tile of SUM and tile of OUT."""
    pm, pn = tl.program_id(0), tl.program_id(1)
    e = tl.load(tile_expert_ptr + pm).to(tl.int64)
    n_st = tl.where(e < E, ST, 0)  # a tile of no expert sums nothing: zeros
    e = tl.minimum(e, E - 1)
    rows = tl.load(src_ptr + pm * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    present = rows < S
    cols = (pn * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for st in range(0, n_st):
        ks = (st * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
        a = tl.load(a_ptr + rows[:, None] * SUM + ks[None, :], mask=present[:, None] & (ks[None, :] < SUM),
                    other=0.0)
        b = tl.load(b_ptr + e * b_stride_e + ks[:, None] * b_stride_sum + cols[None, :] * b_stride_out,
                    mask=(ks[:, None] < SUM) & (cols[None, :] < OUT), other=0.0)
        partial = tl.dot(a, b, out_dtype=tl.float32)  # (BLOCK, BLOCK): FP8 products, FP32 sums
        s_a = tl.load(sa_ptr + rows * ST + st, mask=present, other=0.0)
        s_b = tl.load(sb_ptr + e * sb_stride_e + tl.cast(st, tl.int64) * sb_stride_sum
                      + tl.cast(pn, tl.int64) * sb_stride_out)
        acc += partial * s_a[:, None] * s_b
    out = acc.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne")  # bfloat16: rounded once, to nearest
    tl.store(out_ptr + rows[:, None] * OUT + cols[None, :], out, mask=present[:, None] & (cols[None, :] < OUT))


@triton.jit
def k_grouped(g_ptr, sg_ptr, x_ptr, sx_ptr, tile_start_ptr, out_ptr, N, K, P, BLOCK: tl.constexpr):
    """One 128 x 128 tile (program_id(1), program_id(2)) of expert program_id(0)'s dW (N, K): the sum over
    its 128-token tiles tile_start[e]:tile_start[e + 1] of g_t^T x_t times sg[t] (per column n) and sx[t]
    (per column k), in order. g^T (N, P), x^T (K, P): the contiguous layout transposed, the tokens (the
    summed dimension) the unit stride of both operands, as Hopper's FP8 wgmma reads them; sg (., N),
    sx (., K) per tile."""
    e, pn, pk = tl.cast(tl.program_id(0), tl.int64), tl.program_id(1), tl.program_id(2)  # e*N*K: past 2^31
    t0, t1 = tl.load(tile_start_ptr + e).to(tl.int64), tl.load(tile_start_ptr + e + 1).to(tl.int64)
    ns = (pn * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    ks = (pk * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for t in range(t0, t1):
        ms = (t * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
        g = tl.load(g_ptr + ns[:, None] * P + ms[None, :], mask=ns[:, None] < N, other=0.0)  # g_t^T (BLOCK n, m)
        x = tl.load(x_ptr + ks[None, :] * P + ms[:, None], mask=ks[None, :] < K, other=0.0)  # x_t (m, BLOCK k)
        partial = tl.dot(g, x, out_dtype=tl.float32)
        s_g = tl.load(sg_ptr + t * N + ns, mask=ns < N, other=0.0)
        s_x = tl.load(sx_ptr + t * K + ks, mask=ks < K, other=0.0)
        acc += partial * s_g[:, None] * s_x[None, :]
    out = acc.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne")  # FP32, or bfloat16 rounded to nearest
    tl.store(out_ptr + e * N * K + ns[:, None] * K + ks[None, :], out, mask=(ns[:, None] < N) & (ks[None, :] < K))


_SIZES = ("S", "E", "SUM", "OUT", "ST", "b_stride_e", "b_stride_sum", "b_stride_out", "sb_stride_e",
          "sb_stride_sum", "sb_stride_out")
_M = {"a_ptr": "*fp8e4nv", "sa_ptr": "*fp32", "b_ptr": "*fp8e4nv", "sb_ptr": "*fp32", "src_ptr": "*i32",
      "tile_expert_ptr": "*i32", "out_ptr": "*bf16", **{n: "i32" for n in _SIZES}, "BLOCK": "constexpr"}
_K = {"g_ptr": "*fp8e4nv", "sg_ptr": "*fp32", "x_ptr": "*fp8e4nv", "sx_ptr": "*fp32", "tile_start_ptr": "*i32",
      "out_ptr": "*fp32", "N": "i32", "K": "i32", "P": "i32", "BLOCK": "constexpr"}
COMPILE_CASES = [(m_grouped, _M, {"BLOCK": 128}), (m_grouped, {**_M, "out_ptr": "*fp32"}, {"BLOCK": 128}),
                 (k_grouped, _K, {"BLOCK": 128}), (k_grouped, {**_K, "out_ptr": "*bf16"}, {"BLOCK": 128})]
# As the routes launch them at a model's sizes: Triton specialises a pointer or an integer argument divisible
# by 16 (torch's allocations, K and N of a model) and an integer equal to 1 (b's unit stride) at launch; so
# compiled, the loads are vectorised and pipelined (tests/narrow/test_triton_compile.py checks it).
LAUNCHED_CASES = [
    (m_grouped, {**_M, "b_stride_sum": "constexpr"}, {"BLOCK": 128, "b_stride_sum": 1},
     ("a_ptr", "sa_ptr", "b_ptr", "sb_ptr", "src_ptr", "tile_expert_ptr", "out_ptr", "SUM", "OUT", "b_stride_e",
      "b_stride_out")),
    (k_grouped, _K, {"BLOCK": 128}, ("g_ptr", "sg_ptr", "x_ptr", "sx_ptr", "tile_start_ptr", "out_ptr", "N", "K", "P")),
]
LAUNCH_OPTIONS = {"num_warps": 8, "num_stages": 3}  # 8 warps: the 128 x 128 FP32 accumulator and partial sum
# in registers without spilling (4 warps spill 300-650 bytes); 3 stages: the next two tiles loaded while one is summed
