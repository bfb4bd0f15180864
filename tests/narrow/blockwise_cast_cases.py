"""The block-wise backward casts' Triton kernel (mixprec.narrow.formats.blockwise_cast) against the
pure-PyTorch casts it replaces on CUDA, on the CPU in Triton's interpreter: the same bytes
and the same scales, for values over the whole e4m3 range, subnormals, zeros of both signs
and ties, and for the re-cast of a dequantised input. Run by tests/narrow/test_blockwise_cast.py
in a process started with TRITON_INTERPRET=1 (Triton reads it when imported)."""

import pytest
import torch

from mixprec.narrow.formats import blockwise_cast
from mixprec.narrow.formats.recipe import E4M3
from mixprec.narrow.formats.scaling import quantize



def same(a, b) -> None:
    assert a.tile == b.tile
    assert a.data.shape == b.data.shape and a.scale_inv.shape == b.scale_inv.shape
    assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
    assert torch.equal(a.scale_inv, b.scale_inv)


def hard_values(M=256, N=384, seed=0) -> torch.Tensor:
    """Tiles of very different magnitudes; in each, values whose scaled copies fall on e4m3
    ties, near the largest value, in the subnormals, and zeros of both signs."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, N, generator=gen) * torch.logspace(-6, 6, N)[None, :] * torch.logspace(-3, 3, M)[:, None]
    x[::7, ::5] = 0.0
    x[3::11, 2::13] = -0.0
    x[1::9] *= 1e-6  # most of such a row far below its tile's largest: subnormal after scaling
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cast_transpose_equals_the_two_reference_casts(dtype):
    x = hard_values().to(dtype)
    rows, cols = blockwise_cast.cast_transpose(x, triton=True)
    same(rows, quantize(x, E4M3, (1, 128))[0])
    same(cols, quantize(x, E4M3, (128, 1))[0])
    assert cols.data.t().is_contiguous()  # what the weight-gradient GEMM reads, with no copy


def test_recast_transposed_equals_the_reference_recast():
    xq = quantize(hard_values(seed=1), E4M3, (1, 128))[0]
    same(blockwise_cast.recast_transposed(xq, triton=True), quantize(xq.dequantize(), E4M3, (128, 1))[0])


def test_ties_and_every_e4m3_value_round_as_torch_rounds():
    # every FP8 magnitude, and the midpoints between neighbours (ties to even), in one tile
    # whose amax is 448 (scale 1): the values reach the rounding unscaled
    codes = torch.arange(0, 127, dtype=torch.uint8).view(E4M3).float()  # 0 .. 448
    mids = (codes[:-1] + codes[1:]) / 2
    v = torch.cat([codes, mids, -codes, -mids])
    x = torch.zeros(128, 512)
    x.view(-1)[:v.numel()] = v
    x[:, 0] = 448.0
    rows, _ = blockwise_cast.cast_transpose(x, triton=True)
    same(rows, quantize(x, E4M3, (1, 128))[0])


def test_an_infinite_value_gives_the_references_nan_and_zeros():
    # amax inf: scale 0, the infinity times 0 is NaN (both signs), the rest of its tiles 0. (A NaN
    # input is not compared: torch's amax propagates it to its tile, Triton's max may not; the
    # step is non-finite and skipped either way.)
    x = hard_values(seed=2)
    x[5, 7], x[130, 200] = float("inf"), -float("inf")
    rows, cols = blockwise_cast.cast_transpose(x, triton=True)
    same(rows, quantize(x, E4M3, (1, 128))[0])
    same(cols, quantize(x, E4M3, (128, 1))[0])
    assert rows.data.float().isnan().sum() == 2


def test_a_blockwise_linear_backward_on_the_kernel_equals_the_reference(monkeypatch):
    """The FP8 Linear's backward with the kernel's casts (as on CUDA): the same dx and dW bits."""
    import functools

    from mixprec.narrow.convert import convert_to_fp8
    from mixprec.narrow.formats.recipe import FP8Recipe

    def grads():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 384, bias=False))
        convert_to_fp8(model, FP8Recipe.from_name("blockwise"), compute_dtype=torch.bfloat16, modules=["0"])
        x = (torch.randn(256, 256) * 3).requires_grad_()
        model(x).float().square().sum().backward()
        return x.grad, model[0].weight.grad

    reference = grads()
    calls = []
    real = blockwise_cast.applies
    monkeypatch.setattr(blockwise_cast, "applies", lambda *a, **k: calls.append(1) or real(*a, **k, triton=True))
    kernel = grads()
    assert len(calls) == 2  # dy's cast and x's re-cast took the kernel
    for a, b in zip(kernel, reference):
        assert torch.equal(a, b)
