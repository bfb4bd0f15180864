"""The microscaled recipes' operators (mixprec::mx_quantize, mx_transpose, mx_mm). On CUDA each
runs a function compiled by Inductor on the tensors' bytes; here the same functions are
compiled by Inductor's CPU backend and checked against their eager run (the CPU's route, the
reference), bit for bit: the elements, the scales and the dequantised bfloat16 operands, for
every recipe's casts (E8M0 rounded up, down and to even; e5m2 gradients; NVFP4 with 2-D
blocks, stochastic rounding and 4-over-6; NVFP4's 1-D casts run compiled in the last test)."""

import logging

import pytest
import torch
import torch._dynamo

from mixprec.narrow.kernels import cuda_compiled
from mixprec.narrow.formats import mx
from mixprec.narrow.gemm import mx as mx_gemm
from mixprec.narrow.formats.microscaling import E2M1, E4M3, E5M2

CASTS = {  # element, block, rounding, nv, square, four_over_six, stochastic
    "mxfp8-ceil": (E4M3, 32, "ceil", False, False, False, False),
    "mxfp8-floor-e5m2": (E5M2, 32, "floor", False, False, False, False),
    "mxfp4-even-stochastic": (E2M1, 32, "even", False, False, False, True),
    "nvfp4-2d-4over6-stochastic": (E2M1, 16, "ceil", True, True, True, True),
}


def values(R=96, C=160, seed=0) -> torch.Tensor:
    # partial blocks on both sides, magnitudes over twelve decades, zeros
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(R, C, generator=gen) * torch.logspace(-6, 6, C)
    x[::5, ::7] = 0.0
    return x


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8)) \
        if a.element_size() == 1 else torch.equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("name", CASTS)
def test_compiled_casts_and_dequantisation_equal_the_eager_ones(name):
    element, block, rounding, nv, square, four_over_six, stochastic = CASTS[name]
    x = values()
    key = torch.tensor(12345, dtype=torch.int32) if stochastic else None
    # with the GEMM operand dequantised in the same pass, as the operator asks on CUDA
    args = (x, element, block, rounding, nv, square, four_over_six, key, None, torch.bfloat16)
    torch._dynamo.reset()
    eager, compiled = mx._cast(*args), torch.compile(mx._cast, dynamic=True)(*args)
    assert same(eager.data, compiled.data) and same(eager.scale, compiled.scale)
    assert torch.equal(eager.values, compiled.values)
    if nv:
        assert torch.equal(eager.tensor_scale, compiled.tensor_scale)
    # bfloat16: the operands of CUDA's GEMM (FP32 ones only where its FP32-output GEMM is refused)
    want = mx_gemm._dequantize(eager.data, eager.scale, eager.block, None, eager.shape, torch.bfloat16)
    got = torch.compile(mx_gemm._dequantize, dynamic=True)(eager.data, eager.scale, eager.block, None, eager.shape,
                                                       torch.bfloat16)
    assert torch.equal(want, got)
    if square:
        want = mx._transpose(eager.data, eager.scale)
        got = torch.compile(mx._transpose, dynamic=True)(eager.data, eager.scale)
        assert all(same(w, g) for w, g in zip(want, got))


def test_the_operators_give_the_functions_results_in_torchs_dtypes():
    recipe = mx.MXRecipe.from_name("nvfp4")
    q = recipe.quantize(values(), square=True)
    assert q.data.dtype == E2M1 and q.scale.dtype == E4M3 and q.tensor_scale.shape == ()
    ref = mx._cast(values(), E2M1, 16, "ceil", True, True, False, None, None).typed()
    assert same(q.data, ref.data) and same(q.scale, ref.scale) and q.values is None
    with_values = recipe.quantize(values(), square=True, values=True)
    assert torch.equal(with_values.values, q.dequantize(with_tensor_scale=False))  # FP32 operands on a CPU
    t = mx.transpose(q)
    assert t.shape == q.shape[::-1] and torch.equal(t.dequantize(), q.dequantize().t())
    m = mx.MXRecipe.from_name("mxfp8").quantize(values())
    assert m.scale.dtype == torch.float8_e8m0fnu and m.tensor_scale is None


@pytest.mark.slow
def test_operators_with_compiled_insides_in_a_compiled_graph_equal_eager(monkeypatch):
    """CUDA's nesting on the CPU: a compiled graph calls the operators, and each operator calls
    its function compiled (mxfp8: the casts with their GEMM operands from the same pass, the
    GEMM, and a saved operand dequantised inside mx_mm). The same bits as the eager operators
    with eager insides (which the tests above compare function by function)."""
    recipe = mx.MXRecipe.from_name("mxfp8")
    x, w = values(128, 160, seed=3), values(96, 160, seed=4)

    def f(x, w):
        wq = recipe.quantize(w)  # no values: dequantised inside mx_mm, as a saved operand is
        return mx_gemm.mx_mm(recipe.quantize(x, values=True), wq, torch.bfloat16)

    eager = f(x, w)
    real = cuda_compiled.compiled
    monkeypatch.setattr(cuda_compiled, "compiled", lambda fn, device_type: real(fn, "cuda"))
    compiled = torch.compile(f, fullgraph=True)(x, w)
    # the operators ran their functions compiled
    assert {mx._cast, mx_gemm._dequantize} <= {fn for fn, _ in cuda_compiled._COMPILED}
    assert torch.equal(eager, compiled)


def _scaled(x, factor, key, square: bool):
    y = x * factor if key is None else x * factor + key[0] * key[1]
    return y.t() if square else y


@pytest.mark.slow  # cold (an empty Inductor cache) over 20 s beyond its code generation
def test_each_argument_variant_compiles_apart():
    """A recipe's casts (input, weight, gradient; dense and grouped; rounding keys and tensor amaxes present
    or not, per tensor, per row or per block) are more argument variants than Dynamo's recompile limit:
    each variant gets its own compiled copy of the function, none is refused (fail_on_recompile_limit_hit,
    at a limit of 1), and each gives the eager result."""
    torch._dynamo.reset()
    x, i = torch.randn(8, 16), torch.arange(16, dtype=torch.int32)
    variants = [(torch.tensor(2.0), None, False), (torch.ones(8, 1), None, False), (torch.ones(1, 16), None, True),
                (torch.tensor(2.0), (i, torch.tensor(3)), False), (torch.ones(8, 1), (i[None], i[:, None][:8]), True)]
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, recompile_limit=1):
        for factor, key, square in variants:
            got = cuda_compiled.compiled_variant(_scaled, x, factor, key, square)
            assert torch.equal(got, _scaled(x, factor, key, square))
    assert sum(fn is _scaled for fn, _ in cuda_compiled._COMPILED) == len(variants)


@pytest.mark.slow  # cold (an empty Inductor cache) over 20 s beyond its code generation
def test_any_row_count_runs_on_the_first_graph_and_a_recompile_is_said(caplog, monkeypatch):
    """An expert-parallel rank receives any number of rows, 0 and 1 included, which Dynamo specialises: those
    run eagerly (said once), so one compiled graph serves every other count with no recompile (refused here at
    a limit of 1); a recompile, forced by calling the compiled copy on one row, is logged with the limit."""
    monkeypatch.setattr(cuda_compiled, "_COMPILED", {})
    monkeypatch.setattr(cuda_compiled, "_SAID_EAGER", [])
    torch._dynamo.reset()
    caplog.set_level(logging.INFO, logger="mixprec.narrow.kernels.cuda_compiled")
    factor = torch.tensor(2.0)
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, recompile_limit=1):
        for rows in (5, 7, 0, 1, 130, 2):
            x = torch.randn(rows, 16)
            got = cuda_compiled.compiled_variant(_scaled, x, factor, None, False)
            assert torch.equal(got, _scaled(x, factor, None, False))
    assert len(cuda_compiled._COMPILED) == 1
    assert "a tensor of 0 rows runs eagerly" in caplog.text and "compiled again" not in caplog.text
    (copy,) = cuda_compiled._COMPILED.values()
    copy(torch.randn(1, 16), factor, None, False)  # what the eager route keeps away: Dynamo's size-1 graph
    assert "compiled again (2 times; past 8 it runs eagerly)" in caplog.text


@cuda_compiled.sized("n")
def _placed(x, pos, n: int):
    return x.new_zeros(n + 1, x.shape[1]).index_copy_(0, pos, x * 2)[:n]


def test_a_size_that_follows_the_rows_is_no_variant(monkeypatch):
    """A layout's length or a count of tiles moves with the rows (an expert-parallel rank's, every step): an
    integer argument marked a size (cuda_compiled.sized) is symbolic in one compiled copy, not a copy per value
    (each compiled anew: once a step); unmarked, each value is a variant of its own."""
    monkeypatch.setattr(cuda_compiled, "_COMPILED", {})
    torch._dynamo.reset()

    def unmarked(x, pos, n: int):
        return _placed(x, pos, n)

    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, recompile_limit=1):
        for rows in (5, 7, 130):
            x, pos = torch.randn(rows, 16), torch.randperm(rows + 3)[:rows]
            for fn in (_placed, unmarked):
                assert torch.equal(cuda_compiled.compiled_variant(fn, x, pos, rows + 3), _placed(x, pos, rows + 3))
    assert sum(fn is _placed for fn, _ in cuda_compiled._COMPILED) == 1
    assert sum(fn is unmarked for fn, _ in cuda_compiled._COMPILED) == 3
