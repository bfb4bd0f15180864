import pytest
import torch

from mixprec.narrow.formats.recipe import E4M3, E5M2
from mixprec.narrow.gemm.fp8 import emulated_mm
from mixprec.narrow.formats.scaling import DelayedScales, amax_to_scale, cast, per_tile, quantize, sqnr, tile_amax

TILES = {"tensorwise": (0, 0), "rowwise": (1, 0), "block 1x128": (1, 128), "block 128x128": (128, 128)}


@pytest.mark.parametrize("tile", TILES.values(), ids=TILES.keys())
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_cast_round_trip_sqnr(tile, dtype):
    # torchao's bound for a cast and back: 25 dB (e4m3 keeps 3 mantissa bits, e5m2 2)
    x = torch.randn(256, 384, generator=torch.Generator().manual_seed(0)) * 3
    q, _ = quantize(x, dtype, tile)
    assert q.data.dtype == dtype
    assert sqnr(x, q.dequantize()) >= (25.0 if dtype == E4M3 else 20.0)


# shapes whose last row or column of tiles is partial (a 64-wide debug Linear in 128-blocks: issue 45)
PARTIAL = [(64, 192), (192, 64), (200, 72), (130, 300)]


@pytest.mark.parametrize("shape", PARTIAL + [(256, 384)])
@pytest.mark.parametrize("tile", [(128, 128), (1, 128), (128, 1), (1, 0), (0, 0)])
def test_per_tile_is_each_tile_against_its_own_value(shape, tile):
    x = torch.randn(*shape)
    tr, tc = (tile[0] or shape[0], tile[1] or shape[1])
    values = torch.rand(-(-shape[0] // tr), -(-shape[1] // tc)) + 0.5
    want = torch.empty(shape)
    for i in range(values.shape[0]):
        for j in range(values.shape[1]):
            rows, cols = slice(i * tr, (i + 1) * tr), slice(j * tc, (j + 1) * tc)
            want[rows, cols] = x[rows, cols] / values[i, j]
    assert torch.equal(per_tile(torch.div, x, values, (tr, tc)), want)


@pytest.mark.slow
def test_compiled_casts_equal_the_eager_ones_on_partial_tiles():
    """Inductor's CPU code once read past the scales and wrote only each row's first tile
    of an FP8 output where a tile was partial: compiled block-wise training was NaN."""
    def cast_and_multiply(x, w, tile):
        xq = quantize(x, E4M3, tile)[0]
        if tile == (128, 1):  # as the weight-gradient GEMM reads it: x^T (1 x 128 tiles along the rows it sums)
            a, b = xq.t(), quantize(w, E4M3, (128, 1))[0]
        else:
            a, b = xq, quantize(w, E4M3, (128, 128))[0].t()
        return xq.data.float(), xq.dequantize(), emulated_mm(a, b, torch.float32)

    # (64, 192) and (130, 300) miscompiled before; the others share their code paths (and cost ~3 s a compile).
    # The 128 x 1 tiles run the GEMM as training does, summing over x's rows; summed along x's
    # columns, each one its own K tile, the emulation unrolled 300 partial GEMMs: 172 s of C++ compile, cold
    cases = [(shape, tile, False) for shape in ((64, 192), (130, 300)) for tile in [(128, 128), (1, 128), (128, 1)]]
    cases += [((64, 64), (1, 128), True)]  # symbolic sizes (a recompile's): ~20 s a compile
    for shape, tile, dynamic in cases:
        x = torch.randn(*shape) * 3
        w = torch.randn(shape[0], 96) if tile == (128, 1) else torch.randn(96, shape[1])
        torch._dynamo.reset()
        compiled = torch.compile(cast_and_multiply, dynamic=dynamic)(x, w, tile)
        for eager, got in zip(cast_and_multiply(x, w, tile), compiled):
            assert torch.equal(got, eager), (shape, tile, dynamic)
    torch._dynamo.reset()


def test_tile_amax_covers_partial_edge_tiles():
    x = torch.zeros(3, 300)
    x[2, 299] = -7.0  # in the third column tile of 128, which has only 44 columns
    amax = tile_amax(x, (1, 128))
    assert amax.shape == (3, 3)
    assert amax[2, 2] == 7.0 and amax.sum() == 7.0


def test_each_tile_maps_its_amax_to_the_format_maximum():
    x = torch.randn(256, 256)
    q, amax = quantize(x, E4M3, (128, 128))
    assert q.scale_inv.shape == (2, 2)
    blocks = q.data.float().view(2, 128, 2, 128).abs().amax(dim=(1, 3))
    assert torch.equal(blocks, torch.full((2, 2), 448.0))


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("margin", [0, 2])
def test_scales_are_the_correctly_rounded_quotient(dtype, margin):
    # FP32 division correctly rounded = the FP64 quotient rounded once to FP32 (53 >= 2 x 24 + 2
    # bits: the double rounding is innocuous). A Python number over a tensor is two roundings
    # (amax.reciprocal() * max), 1 ulp off for about a quarter of these amaxes.
    g = torch.Generator().manual_seed(0)
    amax = torch.rand(1_000_000, generator=g) * torch.exp2(torch.randint(-30, 30, (1_000_000,), generator=g).float())
    amax = amax.clamp(min=1e-8)  # above the all-zero tile's floor
    expected = (torch.finfo(dtype).max / amax.double() / 2.0**margin).float()
    assert torch.equal(amax_to_scale(amax, dtype, margin=margin), expected)
    assert (torch.finfo(dtype).max / amax / 2.0**margin != expected).float().mean() > 0.2  # the two-rounding form is off


def test_power_of_two_scales_are_exact():
    x = torch.randn(64, 64) * 5
    scale = amax_to_scale(tile_amax(x, (1, 64)), E4M3, power_of_2=True)
    assert torch.equal(torch.log2(scale), torch.log2(scale).round())
    assert torch.all(x.abs().amax(1, keepdim=True) * scale <= 448)  # rounded down: never past the maximum


def test_values_past_the_scale_saturate_instead_of_overflowing():
    x = torch.tensor([[1.0, 100.0, -1000.0]])
    q = cast(x, torch.tensor([[1.0]]), (1, 3), E4M3)
    assert q.data.float().tolist() == [[1.0, 96.0, -448.0]]  # 100 rounds to 96 in e4m3; -1000 clamps


def test_delayed_scaling_follows_the_documented_algorithm():
    # Transformer Engine's DelayedScaling: scale_t = fp8_max / max(amax history up to t-1) / 2^margin,
    # written out by hand for a history of length 3 and a made-up amax sequence.
    history, pending, scale = torch.zeros(3, 3), torch.zeros(3), torch.zeros(3)
    amaxes = [2.0, 8.0, 1.0, 0.5, 0.25, 4.0]
    expected_max = [2.0, 8.0, 8.0, 8.0, 1.0, 4.0]  # max of the last 3
    expected_recent = amaxes
    for algo, expected in (("max", expected_max), ("most_recent", expected_recent)):
        history.zero_(), scale.zero_()
        for amax, ref in zip(amaxes, expected):
            pending.fill_(amax)
            DelayedScales.advance(history, pending, scale, (E4M3, E4M3, E5M2), algo, margin=1)
            assert scale.tolist() == pytest.approx([448 / ref / 2, 448 / ref / 2, 57344 / ref / 2])
            assert pending.tolist() == [0.0, 0.0, 0.0]


def test_a_nonfinite_amax_does_not_enter_the_history():
    history, pending, scale = torch.zeros(3, 4), torch.full((3,), 2.0), torch.zeros(3)
    DelayedScales.advance(history, pending, scale, (E4M3, E4M3, E5M2), "most_recent", 0)
    before = scale.clone()
    pending.fill_(float("inf"))
    DelayedScales.advance(history, pending, scale, (E4M3, E4M3, E5M2), "most_recent", 0)
    assert torch.equal(scale, before)  # an overflowing step keeps the last good scale
    assert torch.isfinite(history).all()
