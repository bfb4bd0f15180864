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
from mixprec.narrow.gemm import kernel_mm
from mixprec.narrow.linear import FP8Linear
from mixprec.narrow.recipe import E4M3, E5M2, FP8Recipe
from mixprec.narrow.scaling import quantize
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
    from mixprec.narrow import blockwise_cast

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
