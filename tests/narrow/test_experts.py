"""Grouped experts in every narrow recipe: bit for bit each expert's Linear run alone on its
own tokens, SQNR against the FP32 experts, padding, compile, the operators' registrations, the work
of a layer flat in the experts. CUDA's routes run on the CPU: test_experts_cuda_routes.py."""

import zlib

import pytest
import torch
import torch.nn.functional as F

from mixprec.errors import UserError
from mixprec.narrow.experts import ops as experts
from mixprec.narrow.experts.routes import uses_grouped
from mixprec.narrow.convert import Conversion  # noqa: F401 - registers the recipes
from mixprec.narrow.linear.fp8 import Plan, linear_class
from mixprec.narrow.formats.recipe import RECIPES
from mixprec.narrow.formats.scaling import sqnr

CURRENT = [name for name, r in RECIPES.items() if not r.delayed]


def gemm(recipe_name, transposed=False, compute=torch.bfloat16, name="layers.0.mlp.experts.gate_up_proj", E=4):
    recipe = RECIPES[recipe_name] if isinstance(recipe_name, str) else recipe_name
    routes = linear_class(recipe).routes(recipe, "cpu", compute)
    plan = Plan(recipe, recipe.tiles, compute, tuple(why is None for why in routes.values()))
    salts = tuple(zlib.crc32(f"{name}.{e}".encode()) for e in range(E)) if hasattr(recipe, "element") else ()
    return experts.ExpertsGemm(name, plan, transposed, salts)


def problem(E=4, K=48, N=80, sizes=(37, 0, 64, 19), seed=0, transposed=False):
    """x (S, K) sorted by expert, weight (E, N, K) (or (E, K, N)), offs; one expert empty, sizes off every grid."""
    gen = torch.Generator().manual_seed(seed)
    S = sum(sizes)
    x = torch.randn(S, K, generator=gen).bfloat16().requires_grad_()
    shape = (E, K, N) if transposed else (E, N, K)
    w = (torch.randn(shape, generator=gen) / K ** 0.5).requires_grad_()
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    dy = torch.randn(S, N, generator=gen).bfloat16()
    return x, w, offs, dy


# MXFP4 with NVFP4's options: 32-element blocks along tokens padded to 16 for the Hadamard transform
MXFP4_HADAMARD = RECIPES["mxfp4"].with_options(hadamard="random", stochastic_gradients=True)


@pytest.mark.parametrize("transposed,sizes,K,N", [(False, (37, 0, 64, 19), 48, 80), (True, (37, 0, 64, 19), 48, 80),
                                                  (False, (1, 130, 0, 33), 40, 56), (False, (0, 0, 17, 0), 24, 20),
                                                  (False, (0, 1, 0, 0), 20, 12)])
@pytest.mark.parametrize("name", CURRENT + [MXFP4_HADAMARD])
def test_experts_equal_each_expert_alone(name, transposed, sizes, K, N):
    """Every expert's outputs and gradients are its dense Linear's, alone on its tokens: empty experts,
    one-token experts, groups past a 128-token tile and off every tile multiple, K and N off 16/32/128."""
    g = gemm(name, transposed)
    key = experts.register(g)
    x, w, offs, dy = problem(transposed=transposed, sizes=sizes, K=K, N=N)
    out = experts.experts_mm(x, w, offs, key)
    out.backward(dy)
    bounds = [0] + offs.tolist()
    for e in range(w.shape[0]):
        s, t = bounds[e], bounds[e + 1]
        if t == s:
            continue
        xe = x.detach()[s:t].clone().requires_grad_()
        we = (w.detach()[e].t() if transposed else w.detach()[e]).clone().requires_grad_()
        ye = g.matmul.apply(xe, we, g.plan, g.state(e))  # the dense Linear's matmul, alone
        ye.backward(dy[s:t])
        assert torch.equal(out[s:t], ye), (name, e)
        assert torch.equal(x.grad[s:t], xe.grad), (name, e)
        want = we.grad.t() if transposed else we.grad
        assert torch.equal(w.grad[e], want), (name, e)
    assert out.dtype == torch.bfloat16 and w.grad.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
    for e in (e for e, n in enumerate(sizes) if n == 0):  # an expert without tokens gets a zero gradient
        assert torch.count_nonzero(w.grad[e]) == 0


@pytest.mark.parametrize("name,floors", [("rowwise", (23, 27, 21)), ("tensorwise", (23, 22, 21)),
                                          ("blockwise", (23, 27, 21)), ("mxfp8", (23, 27, 21)),
                                          ("nvfp4", (12, 10, 8)), ("mxfp4", (12, 10, 8))])
def test_experts_sqnr_against_fp32(name, floors):
    """torchao's floors for FP8 row-wise experts (output 23 dB, input gradient 27, weight
    gradient 21) hold for every recipe with e4m3 gradients; tensor-wise's e5m2 gradients carry
    one mantissa bit less (its input gradient measured 24.7 dB here); FP4's floors are its own
    (two mantissa bits less than e4m3)."""
    x, w, offs, dy = problem(K=128, N=256, sizes=(200, 57, 0, 143), seed=1)
    g = gemm(name)
    out = experts.experts_mm(x, w, offs, experts.register(g))
    out.backward(dy)
    xr, wr = x.detach().float().requires_grad_(), w.detach().clone().requires_grad_()
    ref = torch.cat([xr[s:t] @ wr[e].t() for e, (s, t) in enumerate(experts.groups(offs))])
    ref.backward(dy.float())
    got = (sqnr(ref, out), sqnr(xr.grad, x.grad), sqnr(wr.grad, w.grad))
    assert all(s >= f for s, f in zip(got, floors)), (name, got)


def test_rows_past_the_last_offset_are_zero():
    x, w, offs, dy = problem(sizes=(3, 4, 5, 6))
    offs = torch.tensor([3, 7, 12, 15], dtype=torch.int32)  # the last 3 rows belong to no expert
    out = experts.experts_mm(x, w, offs, experts.register(gemm("rowwise")))
    out.backward(dy)
    assert torch.count_nonzero(out[15:]) == 0 and torch.count_nonzero(x.grad[15:]) == 0


def test_an_empty_expert_after_one_holding_an_inf_gets_a_zero_gradient():
    """NVFP4's weight gradient reads each expert's tensor scale at its last block: an empty expert has none (it
    read the expert before's, inf there, and its zero sums became NaN). Zeros, as its dense Linear gives."""
    g = gemm("nvfp4")
    x, w, offs, dy = problem(sizes=(37, 0, 64, 19), seed=1)
    dy[5, 3] = float("inf")
    experts.experts_mm(x, w, offs, experts.register(g)).backward(dy)
    assert torch.count_nonzero(w.grad[1]) == 0
    assert torch.isfinite(w.grad[2:]).all()


def test_delayed_scaling_is_refused_for_experts():
    with pytest.raises(UserError, match="delayed scaling keeps one amax history per Linear"):
        experts.check_recipe(RECIPES["delayed"])


@pytest.mark.parametrize("name", ["rowwise", "mxfp8"])
def test_operators_opcheck(name):
    x, w, offs, dy = problem(sizes=(5, 0, 9, 2))
    key = experts.register(gemm(name))
    torch.library.opcheck(torch.ops.mixprec.experts_mm, (x, w, offs, *key))
    torch.library.opcheck(torch.ops.mixprec.experts_mm_backward, (x.detach(), w.detach(), offs, dy, *key))


@pytest.mark.parametrize("name", ["rowwise", "blockwise"])
def test_rows_that_arrive_cast_skip_the_cast_with_the_same_bits(name):
    """Expert parallelism's FP8 dispatch casts each row as a row- or block-wise projection casts its input; the
    projection takes those bytes and scales as they are (mixprec::experts_mm_cast_input): the outputs and
    gradients of casting them itself, the FP8 rows kept for the backward instead of the input."""
    from mixprec.narrow.formats.scaling import quantize

    x, w, offs, dy = problem(sizes=(5, 0, 9, 2))
    g = gemm(name)
    key = experts.register(g)
    tile, pow2 = experts.takes_cast_input(g)
    q, _ = quantize(x.detach(), torch.float8_e4m3fn, tile, power_of_2=pow2)
    a, b = x.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
    wa, wb = w.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    want = experts.experts_mm(a, wa, offs, key)
    got = torch.ops.mixprec.experts_mm_cast_input(b, q.data, q.scale_inv, wb, offs, key.index)
    want.backward(dy)
    got.backward(dy)
    assert torch.equal(got, want) and torch.equal(b.grad, a.grad) and torch.equal(wb.grad, wa.grad)
    # opcheck's schema test compares inputs with ops torch lacks for FP8: no mutation is checked on the bytes
    before = q.data.view(torch.uint8).clone()
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.mixprec.experts_mm_cast_input, (b.detach(), q.data, q.scale_inv, wb, offs, key.index),
                          test_utils=utils)
    torch.library.opcheck(torch.ops.mixprec.experts_mm_cast_input_backward,
                          (q.data, q.scale_inv, wb.detach(), offs, dy, key.index, torch.float32), test_utils=utils)
    assert torch.equal(q.data.view(torch.uint8), before)
    assert experts.takes_cast_input(gemm("tensorwise")) is None and experts.takes_cast_input(gemm("mxfp8")) is None


@pytest.mark.parametrize("name", CURRENT)
def test_compiled_equals_eager_without_graph_breaks(name):
    x, w, offs, dy = problem(K=64, N=96, sizes=(33, 0, 17, 50), seed=3)
    key = experts.register(gemm(name))

    def step(x, w):
        return F.silu(experts.experts_mm(x, w, offs, key).float()).sum()

    eager = torch.autograd.grad(step(x, w), (x, w))
    torch._dynamo.reset()
    explained = torch._dynamo.explain(step)(x, w)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.autograd.grad(torch.compile(step, fullgraph=True)(x, w), (x, w))
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b), name


def test_cuda_route_traced_on_meta():
    """What CUDA runs, traced on the meta device: the operators' fake functions give the sizes and dtypes."""
    g = gemm("rowwise")
    key = experts.register(g)
    x = torch.empty(40, 48, dtype=torch.bfloat16, device="meta", requires_grad=True)
    w = torch.empty(4, 80, 48, device="meta", requires_grad=True)
    offs = torch.empty(4, dtype=torch.int32, device="meta")
    out = experts.experts_mm(x, w, offs, key)
    assert out.shape == (40, 80) and out.dtype == torch.bfloat16 and out.device.type == "meta"
    dx, dw = torch.autograd.grad(out.sum(), (x, w))
    assert dx.shape == x.shape and dw.shape == w.shape and dw.dtype == torch.float32


@pytest.mark.parametrize("name", ["rowwise", "tensorwise", "blockwise"])
def test_an_expert_with_one_token(name):
    """A single token's row scale is also its tensor scale: the row-wise kernel takes it (it was refused)."""
    x, w, offs, dy = problem(K=32, N=48, sizes=(1, 0, 2, 1), seed=4)
    g = gemm(name)
    out = experts.experts_mm(x, w, offs, experts.register(g))
    out.backward(dy)
    xr, wr = x.detach().float(), w.detach()
    ref = torch.cat([xr[s:t] @ wr[e].t() for e, (s, t) in enumerate(experts.groups(offs))])
    assert sqnr(ref, out) > 20


def test_the_base_modes_expert_by_expert_gemm_is_each_experts_matmul():
    # mixprec::experts_mm_loop (float32 and float16 experts, torch without a grouped GEMM): each expert's rows
    # times its weight, the rows past the last group zero; gradients against autograd through a float64 loop
    from mixprec.narrow.experts.layer import base_mm

    gen = torch.Generator().manual_seed(0)
    offs = torch.tensor([5, 5, 26, 31], dtype=torch.int32)
    x = torch.randn(33, 24, generator=gen, requires_grad=True)
    w = torch.randn(4, 40, 24, generator=gen, requires_grad=True)  # (E, N, K), as nn.Linear per expert
    out = base_mm(x, w, offs, transposed=False, dtype=torch.float32)
    dy = torch.randn(33, 40, generator=gen)
    out.backward(dy)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ends = [0, *offs.tolist()]
    ref = torch.cat([x64[a:b] @ w64[e].T for e, (a, b) in enumerate(zip(ends, ends[1:]))] + [x64[31:] * 0 @ w64[0].T])
    ref.backward(dy.double())
    assert torch.equal(out[31:], torch.zeros(2, 40))
    torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-6, atol=1e-6)


class _Count(torch.utils._python_dispatch.TorchDispatchMode):
    """The aten ops an experts layer's passes dispatch, the grouped GEMMs (whose insides are the GEMM's) apart."""

    GEMMS = {"mixprec.grouped_mm.default", "aten._scaled_grouped_mm.default", "mixprec.grouped_blockwise_mm.default",
             "mixprec.grouped_blockwise_wgrad.default"}

    def __init__(self):
        super().__init__()
        self.ops, self.gemms, self.reads = 0, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        self.gemms += name in self.GEMMS
        self.ops += name not in self.GEMMS
        self.reads += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def _passes(name, E, device, grouped=False):
    """(ops, GEMMs, host reads) of one projection's forward and backward at E experts, 300 tokens over 3/4 of them."""
    g = gemm(name, E=E)
    g = experts.ExpertsGemm(g.name, g.plan, False, g.salts, grouped=grouped)
    gen = torch.Generator().manual_seed(0)
    sizes = torch.zeros(E, dtype=torch.long)
    sizes[: 3 * E // 4] = torch.randint(0, 2 * 300 // E, (3 * E // 4,), generator=gen)
    offs = sizes.cumsum(0).to(torch.int32).to(device)
    x = torch.randn(300, 48, generator=gen).bfloat16().to(device)
    w = torch.randn(E, 80, 48, generator=gen).to(device)
    dy = torch.randn(300, 80, generator=gen).bfloat16().to(device)
    with _Count() as count:
        experts.forward(x, w, offs, g)
        experts.backward(x, w, offs, dy, g)
    return count.ops, count.gemms, count.reads


@pytest.mark.parametrize("device,grouped", [("cpu", False), ("meta", False), ("meta", True)])
@pytest.mark.parametrize("name", CURRENT)
def test_the_work_of_an_experts_layer_does_not_grow_with_the_experts(name, device, grouped):
    """A GPU runs one kernel per op: the ops an experts projection dispatches in a forward and a backward
    are the same at 8 and at 64 experts, in every recipe, on the CPU and on the route CUDA takes (traced
    on the meta device, with and without the kernels: torch's grouped row-wise, mixprec's grouped
    block-wise), and none reads the host."""
    if grouped and name not in ("rowwise", "tensorwise", "blockwise"):
        pytest.skip("kernels serve the row-, tensor- and block-wise recipes (torch's grouped row-wise, mixprec's)")
    for E in (8, 64):  # first calls draw and copy what is kept (the Hadamard signs, the experts' salts)
        _passes(name, E, device, grouped)
    few, many = _passes(name, 8, device, grouped), _passes(name, 64, device, grouped)
    assert few == many and few[2] == 0, (few, many)
    assert few[1] >= 3  # forward, input gradient, weight gradient: grouped GEMMs, counted apart


@pytest.mark.gpu
@pytest.mark.parametrize("name", CURRENT)
def test_experts_on_cuda_track_each_expert_alone(name):
    """On a GPU, with the routes CUDA takes (torch's grouped row-wise kernel, mixprec's grouped block-wise
    kernels, torch's bfloat16 grouped GEMM for the emulation, whose group sums round to bfloat16 once):
    every expert's output and gradients within bfloat16 rounding of its dense Linear run alone, and no
    host read. The CPU twin: test_experts_equal_each_expert_alone (bit for bit there)."""
    recipe = RECIPES[name]
    routes = linear_class(recipe).routes(recipe, "cuda", torch.bfloat16)
    plan = Plan(recipe, recipe.tiles, torch.bfloat16, tuple(why is None for why in routes.values()), device="cuda")
    salts = tuple(zlib.crc32(f"e.{e}".encode()) for e in range(4)) if hasattr(recipe, "element") else ()
    g = experts.ExpertsGemm("e.gate_up_proj", plan, False, salts, uses_grouped(plan))
    x, w, offs, dy = (t.cuda() for t in problem(K=256, N=384, sizes=(130, 0, 1, 200), seed=6))
    key = experts.register(g)
    experts.experts_mm(x.detach().requires_grad_(), w.detach().requires_grad_(), offs, key).backward(dy)  # a first
    # step compiles the casts and copies what is kept (salts, signs) to the GPU; the next waits for nothing
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    torch.cuda.set_sync_debug_mode("error")  # any wait for the GPU raises
    try:
        out = experts.experts_mm(x, w, offs, key)
        out.backward(dy)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for e, (s, t) in enumerate(experts.groups(offs)):
        if t == s:
            assert torch.count_nonzero(w.grad[e]) == 0
            continue
        xe, we = x.detach()[s:t].clone().requires_grad_(), w.detach()[e].clone().requires_grad_()
        ye = g.matmul.apply(xe, we, g.plan, g.state(e))
        ye.backward(dy[s:t])
        for got, want in ((out[s:t], ye), (x.grad[s:t], xe.grad), (w.grad[e], we.grad)):
            err = float((got.float() - want.float()).norm() / want.float().norm())
            assert err < 2e-2, (name, e, err)
