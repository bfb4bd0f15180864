"""Each FP8 recipe's transformer block compiles whole: one graph, forward and backward
(`fullgraph=True` raises at a graph break), on the route each device takes. The CPU's
(torch._scaled_mm for tensor- and row-wise, the emulation for block-wise) is trained
compiled against eager, with no graph break, in tests/train/test_compiled_presets.py;
CUDA's is traced here on the meta device (no GPU needed): every GEMM on torch's kernels,
  block-wise through the registered op mixprec::blockwise_scaled_mm, whose checks torch's
  meta functions run (tests/narrow/test_gemm.py). A log call inside the matmul, or a wrapper
  Dynamo cannot trace, would split the graph there."""

import dataclasses

import pytest
import torch
import torch._dynamo

from mixprec.narrow.convert import convert_to_fp8
from mixprec.narrow.gemm.fp8 import kernel_mm
from mixprec.narrow.linear.fp8 import FP8Linear
from mixprec.narrow.formats.recipe import E4M3, E5M2, GEMMS, FP8Recipe
from mixprec.narrow.formats.scaling import quantize
from mixprec.models.llama import build_model, model_args, rope_tables

RECIPES = ["tensorwise", "delayed", "rowwise", "blockwise"]


def block(recipe: str, dim: int, kernels: bool | None = None):
    """The first block of a 2-layer Llama in FP8 (kernels True: every GEMM on torch's kernel)."""
    args = model_args("debug", 256, dim=dim, multiple_of=128)
    model = build_model(args, device="cpu", storage_dtype=torch.float32, seed=0)
    convert_to_fp8(model, FP8Recipe.from_name(recipe), compute_dtype=torch.bfloat16)
    if kernels:
        for m in model.modules():
            if isinstance(m, FP8Linear):
                m.plan = dataclasses.replace(m.plan, kernels=(True, True, True))
    return model.layers[0], args


def inputs(args, T: int, device: str):
    x = torch.randn(2, T, args.dim, generator=torch.Generator().manual_seed(0)).to(device).requires_grad_()
    cos, sin = rope_tables(T, args.head_dim, args.rope_theta, device)
    return x, cos, sin, torch.ones(T, T, dtype=torch.bool, device=device).triu(1)


def forward_backward(fn, x, *rest):
    y = fn(x, *rest)  # the meta device has no autocast; the FP8 GEMMs are outside it anyway
    y.float().square().mean().backward()
    return y


@pytest.mark.slow  # cold (an empty Inductor cache) over 20 s beyond its code generation
@pytest.mark.parametrize("recipe, dim, T", [(r, 256, 128) for r in RECIPES] + [("blockwise", 64, 128)]
                         + [(r, 256, 100) for r in RECIPES if r != "blockwise"])
def test_the_cuda_route_traces_as_one_graph(recipe, dim, T):
    # dim 256: whole 128-tiles, block-wise on its kernel; 64: tiles cut short, emulated (its
    # log line once said so from inside the matmul: a graph break in every such layer).
    # T 100: 200 tokens, which torch._scaled_mm's weight-gradient GEMM (summing over them)
    # takes only padded to a multiple of 16 (block-wise emulates it: no whole tiles, the route of dim 64)
    blk, args = block(recipe, dim=dim, kernels=True)
    blk = blk.to("meta")
    x, *rest = inputs(args, T, "meta")
    torch._dynamo.reset()
    y = forward_backward(torch.compile(blk, backend="aot_eager", fullgraph=True), x, *rest)
    assert y.shape == x.shape and all(p.grad is not None for p in blk.parameters())


def test_the_rowwise_cuda_route_compiles_as_one_graph():
    """The unit-scaled GEMM and the scales after it, compiled, equal to the eager route."""
    gen = torch.Generator().manual_seed(0)
    a = quantize(torch.randn(256, 128, generator=gen), E4M3, (1, 0), power_of_2=True)[0]
    b = quantize(torch.randn(128, 192, generator=gen), E5M2, (0, 1), power_of_2=True)[0]
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b: kernel_mm(a, b, torch.bfloat16, after=True), fullgraph=True)
    assert torch.equal(compiled(a, b), kernel_mm(a, b, torch.bfloat16, after=True))


def graphs_of(blk, x, *rest) -> list:
    """The forward and backward graphs AOTAutograd hands a compiler for `blk` (one graph each: fullgraph)."""
    from torch._functorch.aot_autograd import aot_module_simplified

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    backend = lambda gm, ex: aot_module_simplified(gm, ex, fw_compiler=keep, bw_compiler=keep)  # noqa: E731
    forward_backward(torch.compile(blk, backend=backend, fullgraph=True), x, *rest)
    return graphs


def test_the_blockwise_cuda_route_with_its_triton_casts_traces_as_one_graph(monkeypatch):
    """CUDA's block-wise route as a GPU runs it: the backward's casts in mixprec's Triton ops (the probe
    passed), reached through torch.ops (registering them inside the trace split every backward: 15 graph
    breaks in one block). The only FP8 copies left in the backward are each weight's transpose, which the
    input-gradient GEMM needs K-major (Hopper's FP8 GEMMs read both operands K-major)."""
    pytest.importorskip("triton")
    from mixprec.narrow.formats import blockwise_cast

    blockwise_cast.register()
    monkeypatch.setitem(blockwise_cast._PROBED, "meta", None)  # as on a GPU whose probe passed
    blk, args = block("blockwise", dim=256, kernels=True)
    blk = blk.to("meta")
    x, *rest = inputs(args, 128, "meta")
    forward, backward = graphs_of(blk, x, *rest)  # fullgraph: a graph break raises
    calls = [n for n in backward.graph.nodes if n.op == "call_function"]
    linears = sum(isinstance(m, FP8Linear) for m in blk.modules())
    assert sum("triton_kernel_wrapper" in str(n.target) for n in calls) == 2 * linears  # dy's cast, x's recast
    fp8_copies = [n for n in calls if n.target in (torch.ops.aten.clone.default, torch.ops.aten.copy.default,
                                                   torch.ops.aten._to_copy.default)
                  and n.meta["val"].dtype in (torch.float8_e4m3fn, torch.float8_e5m2)]
    assert len(fp8_copies) == linears, [n.meta["val"].shape for n in fp8_copies]


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])  # the FP8 recipes' layers hold no per-layer constant
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_every_block_reuses_one_compiled_graph(recipe, device):
    """Each block's forward compiled as the trainer does (parallelize.apply_compile): one graph for all the
    blocks, on the CPU's route and CUDA's. A microscaled layer's int salt was a constant of the graph, so
    each block compiled again (8 at most: Dynamo's recompile limit, the rest eager), and its Hadamard signs,
    first copied to the device inside the trace, compiled the first block twice."""
    from torch._dynamo.testing import CompileCounter

    args = model_args("debug", 256, dim=256, multiple_of=128, n_layers=3)
    model = build_model(args, device="cpu", storage_dtype=torch.float32, seed=0)
    convert_to_fp8(model, FP8Recipe.from_name(recipe), compute_dtype=torch.bfloat16)
    if device == "meta":  # built elsewhere, then moved (to_empty on a GPU moves it the same way)
        model = model.to("meta")
    torch._dynamo.reset()
    counter = CompileCounter()
    for blk in model.layers:
        blk.forward = torch.compile(blk.forward, backend=counter)
    x, *rest = inputs(args, 64, device)
    for _ in range(2):
        h = x
        for blk in model.layers:
            h = blk(h, *rest)
        h.float().square().mean().backward()
    assert counter.frame_count == 1


@pytest.mark.parametrize("kernel_faster", [True, False])
def test_the_rowwise_cuda_route_follows_the_measurement(monkeypatch, caplog, kernel_faster):
    """Row-wise GEMMs on CUDA take the route measured faster for their weight's shape at conversion
    (gemm.choose_rowwise; the timing faked here, it needs a GPU): torch's row-wise kernel writes the
    compute dtype itself, the unit-scaled route an FP32 output the row scales multiply after."""
    from mixprec.narrow.gemm import fp8 as gemm

    monkeypatch.setattr(gemm, "_AFTER", {})
    timed = []
    monkeypatch.setattr(gemm, "_route_seconds", lambda device, m, k, n, dtypes: timed.append((m, k, n)) or (
        (1e-3, 2e-3) if kernel_faster else (2e-3, 1e-3)))
    blk, args = block("rowwise", dim=256)
    linears = [m for m in blk.modules() if isinstance(m, FP8Linear)]
    with caplog.at_level("INFO", logger="mixprec.narrow.gemm.fp8"):
        for m in linears:  # as FP8Linear._choose_rowwise on a GPU, when converted or moved there
            m.plan = dataclasses.replace(m.plan, kernels=(True, True, True), device="cuda")
            gemm.choose_rowwise("cuda", m.plan.recipe, m.plan.compute_dtype, tuple(m.weight.shape))
    shapes = {tuple(m.weight.shape) for m in linears}
    assert len(timed) == 3 * len(shapes)  # each GEMM of each shape once
    assert (gemm.ROWWISE_TOKENS, 256, 256) in timed
    assert all(gemm.rowwise_after("cuda", g, s, False) is not kernel_faster
               for g in GEMMS for s in shapes)
    assert gemm.rowwise_after("cuda", "forward", (1, 1), False)  # unmeasured: scales after, as before
    assert not gemm.rowwise_after("cuda", "forward", (256, 256), True)  # fast accumulation: the kernel
    assert not gemm.rowwise_after("cpu", "forward", (256, 256), False)
    chosen = "torch's row-wise kernel" if kernel_faster else "scales after"
    assert sum(chosen in r.getMessage() and "1.000 ms" in r.getMessage() for r in caplog.records) == 3 * len(shapes)
    x, *rest = inputs(args, 128, "meta")
    forward, backward = graphs_of(blk.to("meta"), x, *rest)
    outputs = [n.meta["val"].dtype for g in (forward, backward) for n in g.graph.nodes
               if n.target is torch.ops.aten._scaled_mm.default]
    assert len(outputs) == 3 * len(linears)
    # the weight gradient writes FP32 either way
    assert outputs.count(torch.float32) == (len(linears) if kernel_faster else 3 * len(linears))


@pytest.mark.gpu
def test_the_rowwise_routes_are_timed_on_cuda(monkeypatch):
    # the CPU twin: test_the_rowwise_cuda_route_follows_the_measurement (the timing faked)
    from mixprec.narrow.gemm import fp8 as gemm

    monkeypatch.setattr(gemm, "_AFTER", {})
    gemm.choose_rowwise("cuda", FP8Recipe.from_name("rowwise"), torch.bfloat16, (384, 256), tokens=1024)
    assert sorted(k[1] for k in gemm._AFTER) == sorted(GEMMS)
    kernel, after = gemm._route_seconds("cuda", 1024, 256, 384, (E4M3, E4M3, torch.bfloat16))
    assert 0 < kernel < 1 and 0 < after < 1
