"""The microscaled casts (MXFP8, MXFP4, NVFP4) against torchao's mx_formats, an independent
implementation (a test-only reference): elements and scales bit for bit; the e2m1 rounding,
the stochastic rounding, the Hadamard transforms and the emulated GEMMs against FP64."""

import math
import warnings

import pytest
import torch

from mixprec.narrow.formats.microscaling import (E2M1, E4M3, E5M2, E8M0, E2M1_GRID, decode_e2m1, e8m0_exponent, hadamard,
                                      hadamard_signs, quantize_mx, quantize_nvfp4, rotate, round_e2m1)
from mixprec.narrow.formats.scaling import sqnr

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.kernels import f32_to_f4_unpacked
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale

MODES = {"ceil": ScaleCalculationMode.RCEIL, "floor": ScaleCalculationMode.FLOOR, "even": ScaleCalculationMode.EVEN}


def _tensors():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g) * torch.exp2(torch.randint(-20, 20, (64, 1), generator=g).float())
    outliers = x.clone()
    outliers[:, ::37] *= 1000
    tiny = torch.zeros(64, 256)
    tiny[1, :5] = 1e-40  # subnormal FP32 values
    tiny[2] = 448 * torch.exp2(torch.arange(256).div(16).floor() - 8)  # blocks whose amax is a power of two x 448
    top = (torch.rand(64, 256, generator=g) * 2 - 1) * 448 * 4  # blocks filled to the top of the range
    return {"randn": x, "outliers": outliers, "zeros-subnormals-powers": tiny, "top": top,
            "bf16-valued": x.bfloat16().float()}


TENSORS = _tensors()


def _codes(data: torch.Tensor) -> torch.Tensor:
    return data.view(torch.uint8)


@pytest.mark.parametrize("name", TENSORS)
@pytest.mark.parametrize("dtype", [E4M3, E5M2, E2M1], ids=["e4m3", "e5m2", "e2m1"])
@pytest.mark.parametrize("rounding", MODES)
def test_mx_elements_and_scales_equal_torchaos(name, dtype, rounding):
    x = TENSORS[name]
    scale, data = mx_tensor.to_mx(x.contiguous(), dtype, 32, MODES[rounding])
    q = quantize_mx(x, dtype, rounding=rounding)
    assert q.scale.dtype == E8M0 and q.data.dtype == dtype
    assert torch.equal(_codes(q.scale), _codes(scale))
    # torchao divides the blocks at the smallest scale (2^-127) by 2^-126: those are checked
    # against the definition (test_mx_blocks_decode_to_their_elements_times_the_stored_scale)
    theirs = (_codes(q.scale) > 0).repeat_interleave(32, 1)[:, :q.data.shape[1] * (2 if dtype == E2M1 else 1)]
    if dtype == E2M1:
        theirs = theirs[:, ::2]
    assert torch.equal(_codes(q.data)[theirs], _codes(data)[theirs])


def _nearest_e2m1(v: torch.Tensor) -> torch.Tensor:
    """The e2m1 value nearest to each of v (float64, saturating at 6), ties to the even code."""
    grid = torch.tensor(E2M1_GRID, dtype=torch.float64)
    dist = (v.abs().clamp(max=6.0)[..., None] - grid).abs()
    best = dist.min(dim=-1, keepdim=True).values
    tie_even = torch.where(dist == best, torch.arange(8) % 2, 2)  # an odd code only where it alone is nearest
    return grid[tie_even.argmin(dim=-1)] * v.sign()


@pytest.mark.parametrize("dtype", [E4M3, E5M2, E2M1], ids=["e4m3", "e5m2", "e2m1"])
@pytest.mark.parametrize("rounding", MODES)
def test_mx_blocks_decode_to_their_elements_times_the_stored_scale(dtype, rounding):
    """The definition, in float64: a decoded value is its element times its block's stored
    scale X, and the element is the nearest in the format to x / X (saturated). Blocks from
    2^40 down to FP32's subnormals, the smallest scale 2^-127 included (issue 45: floor and
    even divided those by 2^-126 and decoded half the value)."""
    g = torch.Generator().manual_seed(1)
    exponents = torch.arange(40, -150, -3).float()
    x = torch.randn(len(exponents), 64, generator=g) * torch.exp2(exponents)[:, None]
    q = quantize_mx(x, dtype, rounding=rounding)
    X = torch.exp2(_codes(q.scale).double() - 127).repeat_interleave(32, 1)
    elements = q.elements().double()
    assert torch.equal(q.dequantize().double(), elements * X)
    ratio = x.double() / X
    if dtype == E2M1:
        want = _nearest_e2m1(ratio)
    else:
        top = torch.finfo(dtype).max
        want = ratio.clamp(-top, top).to(dtype).double()
    assert torch.equal(elements, want)
    assert (_codes(q.scale) == 0).any()  # the smallest scale was exercised
    one = quantize_mx(torch.full((1, 32), 2.0**-120), dtype, rounding=rounding).dequantize()
    assert torch.equal(one, torch.full_like(one, 2.0**-120))  # exact in every element format


@pytest.mark.parametrize("name", TENSORS)
@pytest.mark.parametrize("tensor_scale", [True, False])
def test_nvfp4_elements_and_scales_equal_torchaos(name, tensor_scale):
    x = TENSORS[name]
    ts = per_tensor_amax_to_scale(x.abs().amax()) if tensor_scale else None
    scale, data = nvfp4_quantize(x.contiguous(), 16, ts)
    q = quantize_nvfp4(x, tensor_scale=tensor_scale)
    assert q.scale.dtype == E4M3 and q.data.dtype == E2M1 and q.data.shape == (64, 128)
    assert torch.equal(_codes(q.scale), _codes(scale))
    assert torch.equal(_codes(q.data), _codes(data))
    if tensor_scale:
        assert torch.equal(q.tensor_scale, ts)


def test_an_all_zero_or_tiny_nvfp4_tensor_decodes_finite():
    """Issue 45: a zero amax made the tensor scale 0 and every block 0/0 (NaN); an amax
    below ~7.9e-36 overflowed the cast's factor and decoded every element to +-6."""
    for block in ((1, 16), (16, 16)):
        zero = quantize_nvfp4(torch.zeros(32, 32), block=block)
        assert zero.tensor_scale == 1.0 and torch.equal(zero.dequantize(), torch.zeros(32, 32))
    g = torch.Generator().manual_seed(2)
    for magnitude in (1e-30, 1e-35, 1e-37):
        x = torch.randn(16, 64, generator=g) * magnitude
        got = quantize_nvfp4(x).dequantize().double() / magnitude  # relative to the magnitude: no underflow
        want = x.double() / magnitude
        assert torch.isfinite(got).all() and sqnr(want, got) > 15, magnitude  # ordinary tensors: ~20 dB
    tiny = quantize_nvfp4(torch.full((1, 16), 1e-40)).dequantize()
    assert torch.equal(tiny, torch.zeros_like(tiny))  # under 2^-127: flushed, not +-6


@pytest.mark.parametrize("zero", ["weight", "input", "output gradient"])
def test_an_nvfp4_linear_with_a_zero_operand_is_finite(zero):
    from mixprec.narrow import RECIPES, convert_to_fp8

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False))
    convert_to_fp8(model, RECIPES["nvfp4"], compute_dtype=torch.bfloat16)
    x, dy = torch.randn(16, 64), torch.randn(16, 32)
    if zero == "weight":
        torch.nn.init.zeros_(model[0].weight)  # a zero-initialised projection (adapters, a zeroed output layer)
    x = (x * (zero != "input")).requires_grad_()
    y = model(x)
    y.backward((dy * (zero != "output gradient")).to(y.dtype))
    dw = model[0].weight.grad
    for t in (y, x.grad, dw):
        assert torch.isfinite(t).all()
    assert (y == 0).all() == (zero in ("weight", "input"))
    assert (x.grad == 0).all() == (zero in ("weight", "output gradient"))
    assert (dw == 0).all() == (zero in ("input", "output gradient"))


def test_e2m1_rounds_to_nearest_even_like_torchao_on_every_midpoint():
    grid = torch.tensor(E2M1_GRID)
    mids = (grid[1:] + grid[:-1]) / 2
    near = torch.cat([mids, torch.nextafter(mids, grid[1:]), torch.nextafter(mids, grid[:-1])])
    v = torch.cat([torch.linspace(-7, 7, 4001), near, -near, torch.tensor([0.0, -0.0, 6.0, -6.0, 1e-30, -1e-30])])
    assert torch.equal(round_e2m1(v), f32_to_f4_unpacked(v))
    # ties go to the code whose mantissa bit is 0: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4
    assert decode_e2m1(_pack(round_e2m1(mids)))[0, :7].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]


def test_packing_puts_the_first_element_in_the_low_nibble():
    q = quantize_mx(torch.tensor([[0.5, 6.0] + [0.0] * 30]) * 2.0**-2, E2M1)  # scale 2^-2: codes 1 and 7
    assert _codes(q.data)[0, 0].item() == 0x71
    assert torch.equal(q.dequantize()[0, :2], torch.tensor([0.125, 1.5]))


@pytest.mark.parametrize("dtype", [E4M3, E5M2, E2M1], ids=["e4m3", "e5m2", "e2m1"])
def test_round_up_scales_are_exact_where_a_float32_log2_is_not(dtype):
    # amax = max x 2^k x (1 + 2^-22): log2 in FP32 returns k for |k| >= 2 (torchao's RCEIL then
    # picks 2^k and the amax saturates); the round-up scale is 2^(k+1), from the bits
    k = torch.arange(-60, 60).float()
    top = {E4M3: 448.0, E5M2: 57344.0, E2M1: 6.0}[dtype]
    amax = top * torch.exp2(k) * (1 + 2.0**-22)
    quotient = (amax / top).double()
    mantissa, exponent = zip(*(math.frexp(q) for q in quotient.tolist()))  # q = m 2^e, 0.5 <= m < 1
    want = torch.tensor([e - 1 + (m != 0.5) + 127 for m, e in zip(mantissa, exponent)])  # ceil(log2 q) + bias
    assert torch.equal(e8m0_exponent(amax, dtype, "ceil").long(), want)
    x = torch.zeros(len(k), 32)
    x[:, 0] = amax
    q = quantize_mx(x, dtype)
    assert (q.elements()[:, 0] < top).all()  # rounded up: the amax lands below the top, nothing saturates


@pytest.mark.parametrize("dtype", [E4M3, E5M2, E2M1], ids=["e4m3", "e5m2", "e2m1"])
def test_round_up_scales_are_the_smallest_power_of_two_that_fits_over_all_of_fp32(dtype):
    # every FP32 exponent, subnormals included, each with mantissas at and around the format
    # maximum's: the exponent is the smallest k with amax <= max 2^k (exact in float64), clamped
    top = {E4M3: 448.0, E5M2: 57344.0, E2M1: 6.0}[dtype]
    gen = torch.Generator().manual_seed(0)
    top_bits = torch.tensor(top).view(torch.int32).item() & 0x7FFFFF
    mantissas = torch.cat([torch.tensor([0, 1, top_bits - 1, top_bits, top_bits + 1, 0x7FFFFF]),
                           torch.randint(0, 1 << 23, (10,), generator=gen)])
    bits = (torch.arange(0, 255)[:, None] << 23 | mantissas[None, :]).flatten().to(torch.int32)
    amax = bits.view(torch.float32)
    want = []
    for a in amax.double().tolist():
        k = math.ceil(math.log2(a / top)) if a > 0 else -127
        while k > -200 and a <= top * 2.0**(k - 1):
            k -= 1
        while a > top * 2.0**k:
            k += 1
        want.append(min(max(k, -127), 127) + 127)
    assert torch.equal(e8m0_exponent(amax, dtype, "ceil").long(), torch.tensor(want))


@pytest.mark.parametrize("rounding", ["ceil", "floor", "even"])
def test_mx_casts_divide_nothing(rounding):
    # a division is approximate in Triton's code on CUDA unless asked otherwise: the MX casts
    # scale by powers of two built from bits, the same on every backend by construction
    from torch.fx.experimental.proxy_tensor import make_fx

    from mixprec.narrow.formats.microscaling import quantize_mx_bits

    graph = make_fx(lambda x: quantize_mx_bits(x, E4M3, rounding=rounding))(torch.randn(40, 48)).graph
    ops = {str(n.target) for n in graph.nodes if n.op == "call_function"}
    assert not {op for op in ops if "div" in op or "reciprocal" in op}, ops


def test_nonfinite_inputs_make_their_block_or_tensor_nonfinite():
    x = torch.randn(4, 64)
    x[0, 3], x[1, 40], x[2, 5] = float("nan"), float("inf"), -float("inf")
    for rounding in MODES:
        for dtype in (E4M3, E2M1):
            q = quantize_mx(x, dtype, rounding=rounding)
            assert _codes(q.scale)[0, 0] == 255  # OCP: a block holding a NaN gets the NaN scale
            deq = q.dequantize()
            assert not torch.isfinite(deq[0, :32]).any() and torch.isfinite(deq[3]).all()
            assert torch.isfinite(deq[0, 32:]).all()
    deq = quantize_nvfp4(x).dequantize()
    assert not torch.isfinite(deq).all(dim=1).any()  # the tensor scale carries it to every row


def test_stochastic_rounding_is_unbiased_and_reproducible():
    v = torch.linspace(-6, 6, 977)
    n = 2000
    draws = torch.stack([decode_e2m1(_pack(round_e2m1(v, _bits(v, key))))[0, :v.numel()] for key in range(n)])
    assert torch.isin(draws.abs(), torch.tensor(E2M1_GRID)).all()  # only the two neighbours are drawn
    # the mean of n draws is within 4 standard errors (largest step 2: sd <= 1) of v, at every point
    assert (draws.mean(0) - v).abs().max() < 4 / math.sqrt(n)
    assert torch.equal(round_e2m1(v, _bits(v, 7)), round_e2m1(v, _bits(v, 7)))
    assert not torch.equal(round_e2m1(v, _bits(v, 7)), round_e2m1(v, _bits(v, 8)))


def _bits(v, key):
    from mixprec.rounding import random_bits16

    return random_bits16(v.numel(), torch.tensor(key, dtype=torch.int32), v.device)


def _pack(codes):
    codes = codes.reshape(1, -1)
    if codes.shape[1] % 2:
        codes = torch.cat([codes, torch.zeros(1, 1, dtype=torch.uint8)], 1)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4))


@pytest.mark.parametrize("seed", [None, 0, 1])
def test_hadamard_is_orthonormal_and_cancels_in_the_gemm(seed):
    signs = hadamard_signs(16, seed)
    h = hadamard(16, signs)
    torch.testing.assert_close(h @ h.t(), torch.eye(16), rtol=0, atol=1e-6)
    a, b = torch.randn(24, 64, dtype=torch.float64), torch.randn(40, 64, dtype=torch.float64)
    # the fast transform is the block-diagonal product, and cancels between the two operands
    torch.testing.assert_close(rotate(a, signs), (a.view(24, 4, 16) @ h.double()).view(24, 64), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(rotate(a, signs) @ rotate(b, signs).t(), a @ b.t(), rtol=1e-12, atol=1e-12)

def test_random_signs_change_the_cast_and_deterministic_ones_do_not_cancel_it():
    # signs applied after the mixing would cancel in the product and leave every cast as it was
    x = torch.randn(8, 64)
    plain, random = (quantize_mx(rotate(x, hadamard_signs(16, seed)), E2M1) for seed in (None, 0))
    assert not torch.equal(plain.dequantize().abs(), random.dequantize().abs())


def test_two_d_blocks_serve_the_weight_and_its_transpose():
    w = torch.randn(48, 80)  # not whole 16-blocks along either side: padded
    q = quantize_nvfp4(w, block=(16, 16))
    assert q.scale.shape == (3, 5)
    torch.testing.assert_close(q.t().dequantize(), q.dequantize().t(), rtol=0, atol=0)
    blocks = q.scales().view(3, 16, 5, 16)
    assert (blocks == blocks[:, :1, :, :1]).all()  # one scale per 16x16 tile


def test_four_over_six_never_reconstructs_a_block_worse():
    x = torch.randn(64, 256) * torch.rand(64, 1) * 10
    plain, chosen = quantize_nvfp4(x), quantize_nvfp4(x, four_over_six=True)
    err = lambda q: ((q.dequantize() - x) ** 2).view(64, 16, 16).sum(-1)  # noqa: E731
    assert sqnr(x, chosen.dequantize()) > sqnr(x, plain.dequantize()) + 0.5
    # per block, the better of two candidates under the 448 x 4 tensor scale: never worse than 6 alone there
    six_only = err(quantize_nvfp4(x * 1.0, four_over_six=False))
    assert (err(chosen) <= six_only * 1.5 + 1e-6).float().mean() > 0.95


# SQNR (dB) of a GEMM against FP64 on N(0, 1) operands of 256 x 512 x 384, four seeds: MXFP8
# 28.5 (27.6 with floor scales), NVFP4 17.4 (18.2 with 4-over-6), MXFP4 15.7-15.8 (the same with
# floor scales). The floors sit ~1 dB below (the minimums: 26, 16, 13).
FLOORS = {"mxfp8": 27.5, "nvfp4": 16.5, "mxfp4": 15.0}


@pytest.mark.parametrize("recipe", FLOORS)
def test_gemm_sqnr_floors_against_fp64(recipe):
    from mixprec.narrow.gemm.mx import mx_mm
    from mixprec.narrow.formats.recipe import RECIPES

    r = RECIPES[recipe]
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(256, 512, generator=g), torch.randn(384, 512, generator=g)
    exact = a.double() @ b.double().t()
    got = mx_mm(r.quantize(a), r.quantize(b), torch.float32)
    assert sqnr(exact, got) >= FLOORS[recipe]
    # the emulation is the dequantised operands' FP64 product, to FP32 rounding
    qa, qb = r.quantize(a), r.quantize(b)
    torch.testing.assert_close(got.double(), qa.dequantize().double() @ qb.dequantize().double().t(),
                               rtol=1e-5, atol=1e-4)


# ---- the bfloat16 route of the emulated GEMM (CUDA) -------------------------------------------
QUANTIZERS = {"mxfp8": lambda x: quantize_mx(x, E4M3), "mxfp8 e5m2": lambda x: quantize_mx(x, E5M2),
              "mxfp4": lambda x: quantize_mx(x, E2M1), "nvfp4": lambda x: quantize_nvfp4(x),
              "nvfp4 16x16": lambda x: quantize_nvfp4(x, block=(16, 16))}
# the smallest E8M0 exponent whose blocks are exact in bfloat16: the element's finest step times
# the scale stays at or above 2^-133 (e4m3's 2^-9, e5m2's 2^-16; e2m1's 2^-1 at E8M0's 2^-127 is
# 2^-128: every e2m1 block is exact)
EXACT_FROM = {E4M3: -124, E5M2: -117, E2M1: -127}


@pytest.mark.parametrize("name", QUANTIZERS)
def test_bfloat16_dequantisation_is_exact_above_the_documented_floor(name):
    # what lets CUDA run the emulated GEMM in bfloat16: the operands lose nothing
    g = torch.Generator().manual_seed(3)
    for source in (*TENSORS.values(), torch.randn(64, 256, generator=g) * torch.exp2(
            torch.randint(-110, 110, (64, 1), generator=g).float())):
        q = QUANTIZERS[name](source)
        narrow, wide = q.dequantize(False, torch.bfloat16).float(), q.dequantize(False)
        if q.scale.dtype == E8M0:  # the claim: blocks at or above the floor (below it, checked after)
            floor = EXACT_FROM[q.data.dtype] + 127
            above = (_codes(q.scale) >= floor).repeat_interleave(32, 1)[:, :wide.shape[1]]
            narrow, wide = narrow[above], wide[above]
        assert torch.equal(narrow, wide)
    if name.startswith("nvfp4"):
        return  # e4m3 block scales are kept at or above 2^-6: no floor to cross
    # at the floor and below it: exact down to 2^-133, the bits under it rounded away
    q = QUANTIZERS[name](torch.ones(2, 32) * 2.0**-100)
    element = q.data.dtype
    finest = {E4M3: 2.0**-9, E5M2: 2.0**-16, E2M1: 0.5}[element]
    below = [] if element == E2M1 else [(EXACT_FROM[element] - 2, False)]
    for exp, exact in ((EXACT_FROM[element], True), *below):
        scale = torch.full_like(q.scale.view(torch.uint8), exp + 127).view(E8M0)
        # a block of the finest element step (the code 1), times the scale
        data = torch.full_like(q.data.view(torch.uint8), 0x11 if element == E2M1 else 1).view(element)
        b = q._replace(data=data, scale=scale)
        wide, narrow = b.dequantize(False), b.dequantize(False, torch.bfloat16).float()
        assert torch.equal(wide, torch.full_like(wide, finest * 2.0**exp))
        assert torch.equal(narrow, wide) == exact
        assert (narrow - wide).abs().max() <= 2.0**-134  # rounded to bfloat16's nearest subnormal


def test_the_cpu_runs_the_emulated_gemm_in_fp32_and_says_so():
    from mixprec.narrow.formats.mx import gemm_route
    from mixprec.narrow.formats.recipe import RECIPES

    assert "no bfloat16 GEMM with an FP32 output on cpu" in gemm_route("cpu")
    assert RECIPES["mxfp8"].emulation("cpu").startswith("FP32 GEMMs on the dequantised operands")
