import pytest
import torch

from mixprec.narrow.gemm import fp8 as gemm
from mixprec.narrow.gemm.fp8 import emulated_mm, kernel_mm, probe, scales_after
from mixprec.narrow.formats.recipe import E4M3, E5M2
from mixprec.narrow.formats.scaling import Quantized, quantize


def operands(M=192, K=384, N=256, a_tile=(0, 0), b_tile=(0, 0), a_dtype=E4M3, b_dtype=E4M3, device="cpu"):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=gen) * torch.logspace(-2, 2, K)  # columns over four decades
    y = torch.randn(K, N, generator=gen)
    a, _ = quantize(x.to(device), a_dtype, a_tile)
    b, _ = quantize(y.to(device), b_dtype, b_tile)
    return a, b


def reference(a, b):
    """Dequantise, then one FP64 GEMM."""
    return a.dequantize().double() @ b.dequantize().double()


LAYOUTS = {"tensorwise": ((0, 0), (0, 0)), "rowwise": ((1, 0), (0, 1))}


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUTS.keys())
@pytest.mark.parametrize("dtypes", [(E4M3, E4M3), (E5M2, E4M3)], ids=["e4m3xe4m3", "e5m2xe4m3"])
def test_emulation_matches_torchs_scaled_mm_on_the_cpu(layout, dtypes):
    reason = probe("cpu", *LAYOUTS[layout], *dtypes, torch.float32)
    if reason is not None:  # torch 2.11's CPU _scaled_mm takes tensor-wise scales only; mixprec then emulates
        assert layout == "rowwise" and "refused" in reason
        pytest.skip(reason)
    a, b = operands(a_tile=LAYOUTS[layout][0], b_tile=LAYOUTS[layout][1], a_dtype=dtypes[0], b_dtype=dtypes[1])
    kernel = kernel_mm(a, b, torch.float32)
    emulated = emulated_mm(a, b, torch.float32)
    # the same FP32 sums in another order: a few units of FP32 rounding
    torch.testing.assert_close(kernel, emulated, rtol=1e-5, atol=1e-5 * emulated.abs().max().item())


BLOCKS = {"1x128 x 128x128 (forward)": ((1, 128), (128, 128)), "1x128 x 128x1 (weight gradient)": ((1, 128), (128, 1))}


@pytest.mark.parametrize("tiles", BLOCKS.values(), ids=BLOCKS.keys())
@pytest.mark.parametrize("K", [384, 320])  # 320: a last K tile of 64
def test_blockwise_emulation_is_a_dequantised_fp32_gemm_within_fp32_rounding(tiles, K):
    a, b = operands(K=K, a_tile=tiles[0], b_tile=tiles[1])
    ref = reference(a, b)
    got = emulated_mm(a, b, torch.float32).double()
    # every partial sum is exact-product FP32 accumulation over 128 terms: error ~ K * 2^-24 of the magnitudes
    bound = K * 2**-24 * (a.dequantize().abs().double() @ b.dequantize().abs().double())
    assert torch.all((got - ref).abs() <= bound)


def test_blockwise_scales_are_applied_per_tile():
    # a tile of a scaled by 2^10 must not move the others: per-tile promotion, not one scale per row
    a, b = operands(a_tile=(1, 128), b_tile=(128, 128))
    a.scale_inv[:, 1] *= 1024
    ref = reference(a, b)
    got = emulated_mm(a, b, torch.float32).double()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6 * ref.abs().max().item())


def test_the_cpu_probe_finds_torchs_tensorwise_and_rowwise_kernels_and_no_blockwise_one():
    assert probe("cpu", (0, 0), (0, 0), E4M3, E4M3, torch.bfloat16) is None
    rowwise = probe("cpu", (1, 0), (0, 1), E5M2, E4M3, torch.float32)
    # torch 2.11's CPU kernel refuses row-wise scales (an internal assert), 2.13's takes them
    assert rowwise is None or ("refused" in rowwise and torch.__version__ < "2.13")
    assert "no block-wise" in probe("cpu", (1, 128), (128, 128), E4M3, E4M3, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", [((0, 0), (0, 0)), ((1, 0), (0, 1)), ((1, 128), (128, 128)), ((1, 128), (128, 1))],
                         ids=["tensorwise", "rowwise", "blockwise forward", "blockwise weight gradient"])
def test_cuda_kernels_match_the_emulation(tiles):
    a, b = operands(M=256, K=512, N=384, a_tile=tiles[0], b_tile=tiles[1], device="cuda")
    reason = probe("cuda", tiles[0], tiles[1], E4M3, E4M3, torch.bfloat16)
    if tiles[0] == (1, 128) and reason is not None:
        pytest.skip(f"no block-wise kernel here: {reason}")
    assert reason is None
    # Hopper's FP8 tensor cores sum with fewer bits than FP32 even without fast accumulation
    # (measured on an H100: 1e-4 relative to float64 at K = 8192, the emulation 1e-7)
    ref = reference(a, b)
    err = lambda out: float((out.double() - ref).norm() / ref.norm())  # noqa: E731
    assert err(emulated_mm(a, b, torch.float32)) < 1e-6
    assert err(kernel_mm(a, b, torch.float32)) < 1e-3


def _meta_scaled_mm(a, b, out_dtype, blockwise):
    """torch's scaled GEMM on meta copies of the operands and kernel_scales' arguments: torch's
    meta function checks every shape and stride rule its CUDA kernels state, on any machine."""
    import torch.nn.functional as F

    from mixprec.narrow.gemm.fp8 import kernel_scales

    scale_a, scale_b, types = kernel_scales(a, b, blockwise)
    meta = lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")  # noqa: E731
    A, B = meta(a.data.contiguous()), meta(b.data.t().contiguous().t())
    if types is None:
        return torch._scaled_mm(A, B, meta(scale_a), meta(scale_b), out_dtype=out_dtype)
    return F.scaled_mm(A, B, meta(scale_a), types[0], meta(scale_b), types[1], output_dtype=out_dtype)


# (M, K, N): one block, one row or column of blocks, K/128 not a multiple of 4, many
BLOCK_SHAPES = [(32, 128, 128), (256, 128, 384), (128, 384, 128), (256, 640, 256), (512, 1024, 768)]


@pytest.mark.parametrize("M, K, N", BLOCK_SHAPES)
def test_the_kernels_scale_arguments_follow_torchs_rules(M, K, N):
    """Issue 45: a 128 x 128 weight (one block, one scale) was handed to torch as tensor-wise
    beside a (32, 1) row-wise a: 'Invalid scaling configuration' on every GPU."""
    F = pytest.importorskip("torch.nn.functional")
    if not hasattr(F, "scaled_mm"):
        pytest.skip(f"torch {torch.__version__} has no F.scaled_mm")
    gen = torch.Generator().manual_seed(0)
    x, w, dy = torch.randn(M, K, generator=gen), torch.randn(N, K, generator=gen), torch.randn(M, N, generator=gen)
    xq, wq = quantize(x, E4M3, (1, 128))[0], quantize(w, E4M3, (128, 128))[0]
    gq, gq_w = quantize(dy, E4M3, (1, 128))[0], quantize(dy, E4M3, (128, 1))[0]
    xq_w = quantize(x, E4M3, (128, 1))[0]
    # the three GEMMs of a block-wise Linear: forward, input gradient, weight gradient
    from mixprec.narrow.gemm.fp8 import _whole_tiles

    checked = 0
    for a, b, out in ((xq, wq.t(), torch.bfloat16), (gq, wq, torch.bfloat16), (gq_w.t(), xq_w, torch.float32)):
        if _whole_tiles(a, b):  # a partial tile (the weight gradient's K = 32 rows) is emulated, never handed over
            assert _meta_scaled_mm(a, b, out, blockwise=True).shape == (a.data.shape[0], b.data.shape[1])
            checked += 1
    assert checked == (2 if M % 128 else 3)
    for tiles in LAYOUTS.values():  # tensor- and row-wise, for every shape
        a, b = quantize(x, E4M3, tiles[0])[0], quantize(w.t(), E4M3, tiles[1])[0]
        assert _meta_scaled_mm(a, b, torch.bfloat16, blockwise=False).shape == (M, N)


@pytest.mark.parametrize("power_of_2", [True, False], ids=["pow2-scales", "any-scales"])
def test_rowwise_scales_after_a_unit_scaled_gemm_equal_the_rowwise_kernel(power_of_2):
    """The route row-wise GEMMs take on CUDA (torch's tensor-wise kernel with unit scales, the
    row scales multiplied into its FP32 output) against torch's row-wise kernel and the
    emulation, on the CPU, where both kernels exist: the same FP32 sums times the same two
    scales. With the recipe's power-of-two scales the products are exact: equal bits. With
    other scales torch's CPU row-wise kernel scales the operands before its sums (79% of the
    FP32 outputs differ in the last bits from the unit-scaled route's): both within FP32
    rounding of the emulation."""
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(192, 384, generator=gen) * torch.logspace(-2, 2, 384), torch.randn(384, 256, generator=gen)
    a, _ = quantize(x, E4M3, (1, 0), power_of_2=power_of_2)
    b, _ = quantize(y, E5M2, (0, 1), power_of_2=power_of_2)
    for out in (torch.float32, torch.bfloat16):
        after = kernel_mm(a, b, out, after=True)
        emulated = emulated_mm(a, b, out)
        # bfloat16: one unit in the last place apart where a sum sits near a rounding boundary
        within = dict(rtol=1e-5 if out == torch.float32 else 2**-7, atol=1e-5 * emulated.abs().max().item())
        torch.testing.assert_close(after, emulated, **within)
        if probe("cpu", (1, 0), (0, 1), E4M3, E5M2, out) is None:
            rowwise = kernel_mm(a, b, out, after=False)
            if power_of_2:
                assert torch.equal(after, rowwise), out
            torch.testing.assert_close(rowwise, emulated, **within)
    assert not scales_after("cpu", False) and scales_after("cuda", False) and not scales_after("cuda", True)


@pytest.mark.parametrize("layout", ["tensorwise", "rowwise"])
def test_a_summed_dimension_off_the_16_grid_is_padded_with_zeros_exactly(layout):
    # the weight-gradient GEMM sums over the tokens, 200 here (2 x 100): torch._scaled_mm wants
    # that dimension a multiple of 16 (on CUDA; its meta function says so), so kernel_mm pads
    # both operands there with zero bytes (+0 in e4m3 and e5m2); the scales do not run along
    # it. The same sums as the unpadded GEMM (the CPU's kernel, which takes any K, is not
    # padded: its summation order would change the last bits)
    gen = torch.Generator().manual_seed(2)
    tiles = ((0, 0), (0, 0)) if layout == "tensorwise" else ((1, 0), (0, 1))
    if (reason := probe("cpu", *tiles, E5M2, E4M3, torch.float32)) is not None:
        pytest.skip(reason)  # torch 2.11's CPU _scaled_mm takes tensor-wise scales only (an internal assert)
    a = quantize(torch.randn(48, 200, generator=gen), E5M2, tiles[0], power_of_2=True)[0]
    b = quantize(torch.randn(200, 64, generator=gen), E4M3, tiles[1], power_of_2=True)[0]
    A, B = gemm._pad_k(a.data, b.data.t().contiguous().t())
    assert A.shape == (48, 208) and B.shape == (208, 64) and B.t().is_contiguous()
    assert not A[:, 200:].view(torch.uint8).any() and not B[200:].view(torch.uint8).any()
    assert torch.equal(A[:, :200].view(torch.uint8), a.data.view(torch.uint8))
    scale_a, scale_b, _ = gemm.kernel_scales(a, b)
    padded = torch._scaled_mm(A, B, scale_a, scale_b, out_dtype=torch.float32)
    torch.testing.assert_close(padded, emulated_mm(a, b, torch.float32), rtol=1e-5, atol=1e-5)
    assert torch.equal(kernel_mm(a, b, torch.float32, after=False),
                       torch._scaled_mm(a.data, b.data.t().contiguous().t(), scale_a, scale_b, out_dtype=torch.float32))
    # CUDA's rules, on the meta device: torch's meta function takes the padded operands
    meta = lambda q: Quantized(q.data.to("meta"), q.scale_inv.to("meta"), q.tile)  # noqa: E731
    assert kernel_mm(meta(a), meta(b), torch.bfloat16, after=False).shape == (48, 64)
    with pytest.raises(RuntimeError, match="divisible by 16"):
        _meta_scaled_mm(a, b, torch.bfloat16, blockwise=False)  # unpadded: refused


@pytest.mark.parametrize("kernel_ms, used", [(300.0, False), (1.0, True), (0.9, False)])
def test_a_cpu_route_is_chosen_by_speed_too_and_said_with_its_figures(monkeypatch, caplog, kernel_ms, used):
    """Where torch's CPU kernel is oneDNN's reference code (AMX CPUs: 2,028 ms against 16 ms) the emulation
    runs; the kernel only where it is CPU_MARGIN times faster (1 ms against 1.5 ms), and either way the
    figures are said."""
    import logging

    calls = iter([kernel_ms / 1e3, 1.5e-3])
    monkeypatch.setattr(gemm, "_seconds", lambda run: next(calls))
    monkeypatch.setattr(gemm, "CPU_MARGIN", 1.5 if kernel_ms != 0.9 else 2.0)
    gemm.cpu_speed.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="mixprec"):
            why = gemm.route_on("cpu", (0, 0), (0, 0), E4M3, E4M3, torch.bfloat16)
    finally:
        gemm.cpu_speed.cache_clear()
    figures = f"{kernel_ms:.2f} ms against the emulation's 1.50 ms"
    if used:
        assert why is None and any(figures in r.getMessage() for r in caplog.records)
    else:
        assert "not" in why and "faster than the emulation" in why and figures in why and gemm.cpu_name() in why
