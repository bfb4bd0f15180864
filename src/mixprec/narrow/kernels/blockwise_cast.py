"""The Triton kernel of mixprec.narrow.formats.blockwise_cast, in a module of its own: Triton is optional,
and its code generator resolves the names a kernel uses (`tl`) in the module's globals, so the
kernel's module imports Triton at its top and is imported only where Triton is installed.

COMPILE_CASES lists the signatures and constexpr combinations the casts launch it with;
tests/narrow/test_triton_compile.py compiles each for Hopper (sm_90) on the CPU (Triton's
compiler and its bundled ptxas need no GPU), as it does every kernel of the package.
"""

import triton
import triton.language as tl


@triton.jit
def cast_tiles(x_ptr, xs_ptr, q_ptr, qs_ptr, qt_ptr, qts_ptr, M, N, BLOCK: tl.constexpr, DEQUANT: tl.constexpr,
               ROWS: tl.constexpr):
    """One 128 x 128 tile of x (M, N): with ROWS its 1 x 128 casts (q (M, N) bytes, qs (M, N/128)
    scale_inv), always its 128 x 1 casts stored transposed (qt (N, M) bytes, qts (N, M/128)).
    DEQUANT: x holds e4m3 values in 1 x 128 tiles, xs their scale_inv: dequantised first.
    Offsets in int64: M x N reaches 2^31 at real sizes (131,072 tokens x 28,672 features)."""
    pm, pn = tl.program_id(0), tl.program_id(1)
    rows = (pm * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    cols = (pn * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    x = tl.load(x_ptr + rows[:, None] * N + cols[None, :]).to(tl.float32)
    if DEQUANT:
        x = x * tl.load(xs_ptr + rows * (N // BLOCK) + pn)[:, None]
    for axis in tl.static_range(2):
        if axis == 1 or ROWS:
            # scale = 448 / max(amax, EPS), correctly rounded, as amax_to_scale
            scale = tl.div_rn(tl.full([BLOCK], 448.0, tl.float32),
                              tl.maximum(tl.max(tl.abs(x), axis=1 - axis), 1e-12))
            s = x * (scale[:, None] if axis == 0 else scale[None, :])
            v = tl.minimum(tl.maximum(s, -448.0), 448.0)
            # e4m3fn by hand: normal values keep 3 of FP32's 23 mantissa bits (round to
            # nearest even, the carry may step the exponent); below 2^-6 the step is 2^-9
            a = tl.abs(v)
            bits = a.to(tl.int32, bitcast=True)
            normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - (120 << 3)
            sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
            code = tl.where(a >= 0.015625, normal, sub)
            code = tl.where(s != s, 0x7F, code)  # NaN stays NaN, as under torch.clamp
            code = code | ((s.to(tl.int32, bitcast=True) >> 24) & 0x80)  # the sign, NaN's and -0's too
            inv = tl.div_rn(tl.full([BLOCK], 1.0, tl.float32), scale)
            if axis == 0:
                tl.store(q_ptr + rows[:, None] * N + cols[None, :], code.to(tl.uint8))
                tl.store(qs_ptr + rows * (N // BLOCK) + pn, inv)
            else:
                tl.store(qt_ptr + cols[None, :] * M + rows[:, None], code.to(tl.uint8))
                tl.store(qts_ptr + cols * (M // BLOCK) + pm, inv)


def _signature(x: str, sizes: str) -> dict[str, str]:
    return {"x_ptr": x, "xs_ptr": "*fp32", "q_ptr": "*u8", "qs_ptr": "*fp32", "qt_ptr": "*u8", "qts_ptr": "*fp32",
            "M": sizes, "N": sizes, "BLOCK": "constexpr", "DEQUANT": "constexpr", "ROWS": "constexpr"}


# (kernel, signature, constexprs) of every launch: cast_transpose of a float32 or bfloat16
# gradient (both layouts), recast_transposed of an e4m3 input (the column layout only); sizes
# as Triton specialises them, int32 below 2^31 and int64 above
COMPILE_CASES = [(cast_tiles, _signature(x, sizes), {"BLOCK": 128, "DEQUANT": dequant, "ROWS": not dequant})
                 for x, dequant in (("*fp32", False), ("*bf16", False), ("*fp8e4nv", True))
                 for sizes in ("i32", "i64")]
