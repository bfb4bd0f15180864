import contextlib

import pytest
import torch

from mixprec.precision.emulation import EmulatedMatmul

BF16 = torch.bfloat16


@pytest.mark.parametrize("op", [
    lambda a, b, c: a @ b,
    lambda a, b, c: torch.addmm(c, a, b),
    lambda a, b, c: torch.nn.functional.linear(a, b.t(), c[0]),
    lambda a, b, c: torch.bmm(a.unsqueeze(0).expand(3, -1, -1), b.unsqueeze(0).expand(3, -1, -1)),
])
def test_matches_the_native_bf16_kernel(op):
    torch.manual_seed(0)
    a, b, c = torch.randn(48, 96, dtype=BF16), torch.randn(96, 40, dtype=BF16), torch.randn(48, 40, dtype=BF16)
    native = op(a, b, c)
    with EmulatedMatmul():
        emulated = op(a, b, c)
    assert emulated.dtype == BF16
    # Both accumulate in FP32 and round once: at most one BF16 ulp apart (2^-7 relative).
    assert torch.allclose(emulated.float(), native.float(), rtol=2**-7, atol=1e-6)


def test_leaves_other_dtypes_alone():
    a = torch.randn(8, 8)
    with EmulatedMatmul():
        assert torch.equal(a @ a, a @ a) and (a @ a).dtype == torch.float32


def test_products_are_exact_in_fp32():
    """Why emulation is faithful: a product of two BF16 numbers needs 16 significand bits."""
    a = torch.randn(10000).to(BF16)
    b = torch.randn(10000).to(BF16)
    exact = a.double() * b.double()
    assert torch.equal((a.float() * b.float()).double(), exact)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_fused_attention_is_emulated_as_float32_on_the_rounded_inputs(dtype):
    gen = torch.Generator().manual_seed(0)
    q, k, v, g = (torch.randn(2, 4, 64, 16, generator=gen).to(dtype) for _ in range(4))

    def run(cast, mode):
        leaves = [t.detach().to(cast).requires_grad_() for t in (q, k, v)]
        with mode:
            out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True)
            out.backward(g.to(cast))
        return [out.detach(), *(t.grad for t in leaves)]

    emulated = run(dtype, EmulatedMatmul())
    native = run(dtype, contextlib.nullcontext())
    # the forward is float32 attention on the rounded inputs, rounded once
    exact = run(torch.float32, contextlib.nullcontext())[0].to(dtype)
    assert emulated[0].dtype == dtype and torch.equal(emulated[0], exact)
    # the backward reads the rounded output, as the native kernel does: within the format's
    # rounding of float64, and no further from it than the native kernel
    reference = run(torch.float64, contextlib.nullcontext())
    for got, mine, ref in zip(emulated, native, reference):
        assert got.dtype == dtype
        err = lambda t: float((t.double() - ref).norm() / ref.norm())  # noqa: E731
        assert err(got) < 1e-2 and err(got) <= 1.2 * err(mine)
