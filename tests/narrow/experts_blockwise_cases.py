"""mixprec's grouped block-wise kernels (mixprec.narrow.experts.blockwise) against the grouped
emulation, on the CPU in Triton's interpreter: the forward, the input gradient and the weight
gradient of a block-wise experts projection, with an empty expert, one-token experts, experts past
a 128-token tile, rows past the last offset and K, N off 128; the operators opchecked. Both sum FP32
partial sums over 128-wide tiles times the same scales, in another order: close to FP32 rounding.
Run by tests/narrow/test_experts_blockwise.py in a process started with TRITON_INTERPRET=1."""

import pytest
import torch

from mixprec.narrow.experts import blockwise as experts_blockwise
from mixprec.narrow.experts import fp8 as experts_fp8
from mixprec.narrow.experts.ops import ExpertsGemm
from mixprec.narrow.linear.fp8 import Plan
from mixprec.narrow.formats.recipe import RECIPES
from mixprec.narrow.experts.segments import Segments

RECIPE = RECIPES["blockwise"]
PLAN = Plan(RECIPE, RECIPE.tiles, torch.bfloat16, (False,) * 3)


def problem(sizes, K, N, past=0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    S = sum(sizes) + past
    x = torch.randn(S, K, generator=gen).bfloat16()
    w = torch.randn(len(sizes), N, K, generator=gen) / K ** 0.5
    dy = torch.randn(S, N, generator=gen).bfloat16()
    return x, w, torch.tensor(sizes).cumsum(0).to(torch.int32), dy


def relative(got, want) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-30))


@pytest.mark.parametrize("sizes,K,N,past", [((130, 0, 1, 37), 256, 384, 0), ((1, 1, 200, 5), 200, 136, 3),
                                            ((0, 64, 0, 0), 128, 128, 0)])
def test_the_kernels_equal_the_grouped_emulation(sizes, K, N, past):
    x, w, offs, dy = problem(sizes, K, N, past)
    results = []
    for kernel in (True, False):
        g = ExpertsGemm("e.gate_up_proj", PLAN, False, grouped=kernel)
        assert g.plan.kernels == (kernel,) * 3
        results.append((experts_fp8.forward(x, w, offs, g), *experts_fp8.backward(x, w, offs, dy, g)))
    (out, dx, dw), (out_e, dx_e, dw_e) = results
    assert out.dtype == out_e.dtype and dx.dtype == dx_e.dtype and dw.dtype == dw_e.dtype
    # bfloat16 outputs: the emulation's and the kernel's FP32 sums round alike but at ties of the order
    assert relative(out, out_e) < 1e-3 and relative(dx, dx_e) < 1e-3
    assert relative(dw, dw_e) < 1e-5  # FP32 out: the order of the sums alone
    assert torch.count_nonzero(out[sum(sizes):]) == 0 and torch.count_nonzero(dx[sum(sizes):]) == 0
    for e in (e for e, n in enumerate(sizes) if n == 0):
        assert torch.count_nonzero(dw[e]) == 0


def test_the_operators_opcheck():
    x, w, offs, dy = problem((130, 0, 1, 37), 256, 384, past=3)
    seg = Segments(offs, x.shape[0])
    src, tile_expert, P = experts_blockwise.layout(seg)
    xq, _ = experts_fp8.cast_tokens(x, seg, (1, 128), torch.float8_e4m3fn, False)
    wq = experts_fp8.transposed(experts_fp8.cast_stacked(w, (128, 128), torch.float8_e4m3fn, False))
    utils = ("test_autograd_registration", "test_faketensor")  # FP8 inputs: no schema test's copies (test_custom_ops)
    for dtype in (torch.bfloat16, torch.float32):
        torch.library.opcheck(torch.ops.mixprec.grouped_blockwise_mm,
                              (xq.data, xq.scale_inv, wq.data, wq.scale_inv, src, tile_expert, dtype), test_utils=utils)
    group, n = seg.tiles(128)[0], seg.rows // 128 + seg.n + 1
    tsrc, ends, P = seg.sources(128, nonempty=False)
    g_t, g_inv = experts_fp8._along_placed(dy, group, n, tsrc, torch.float8_e4m3fn, False)
    x_t, x_inv = experts_fp8._along_placed(x, group, n, tsrc, torch.float8_e4m3fn, False)
    tile_start = torch.cat([ends.new_zeros(1), ends // 128]).to(torch.int32)
    for dtype in (torch.float32, torch.bfloat16):
        torch.library.opcheck(torch.ops.mixprec.grouped_blockwise_wgrad, (g_t, g_inv, x_t, x_inv, tile_start, dtype),
                              test_utils=utils)


def test_the_layout_map_places_each_expert_from_a_tile_and_the_rows_past_the_last_after_it():
    """experts_blockwise.layout: each expert's rows in order from a multiple of 128 (the tile its expert's),
    zero rows (S) between, the rows past offs[-1] after the last expert in tiles of no expert (E)."""
    sizes, past = (130, 0, 1, 37), 3
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    S = sum(sizes) + past
    src, tile_expert, P = experts_blockwise.layout(Segments(offs, S))
    want, start, experts_of_tiles = [], 0, []
    for e, n in enumerate(sizes):
        tiles = -(-n // 128)
        want += list(range(start, start + n)) + [S] * (tiles * 128 - n)
        experts_of_tiles += [e] * tiles
        start += n
    want += list(range(start, S))
    assert src[:len(want)].tolist() == want and (src[len(want):] == S).all() and P % 128 == 0
    assert tile_expert[:len(experts_of_tiles)].tolist() == experts_of_tiles
    assert (tile_expert[len(experts_of_tiles):] == len(sizes)).all()
