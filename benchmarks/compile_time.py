"""Compile time of a flavor's transformer blocks (--layers of them, each block's forward compiled
as the trainer does), forward and backward, per dense narrow recipe, against bf16-mixed's in the
same run: Inductor on the CPU (the first call, which compiles, against a second), and CUDA's
route traced on the meta device (Dynamo and AOTAutograd,
every GEMM on torch's kernels: the share of a GPU's compile that does not depend on the GPU).
Every block should reuse the first block's graph: a recompile per block shows as a first call
that grows with --layers, and the graphs compiled are counted.

    python benchmarks/compile_time.py --flavor 1B --layers 16 --tokens 64 --recipes mxfp8 nvfp4
    python benchmarks/compile_time.py --flavor moe-debug --layers 8 --tokens 64 --recipes rowwise mxfp8
"""

from __future__ import annotations

import argparse
import importlib.util
import time

import torch
import torch._dynamo

from mixprec.models.llama import build_model, model_args, rope_tables
from mixprec.narrow.formats import blockwise_cast
from mixprec.narrow.convert import convert_to_fp8
from mixprec.narrow.experts import hf as hf_experts
from mixprec.narrow.formats.recipe import FP8Recipe

from graph_breaks import on_cuda_route  # benchmarks/


def blocks(flavor: str, recipe: str | None, device: str, tokens: int, layers: int):
    args = model_args(flavor, 256, n_layers=layers)
    model = build_model(args, device="cpu", storage_dtype=torch.float32, seed=0)
    if recipe:  # a MoE flavor's experts too
        convert_to_fp8(model, FP8Recipe.from_name(recipe), compute_dtype=torch.bfloat16)
    else:  # a MoE flavor's experts in bfloat16, as bf16-mixed's policy sets them
        hf_experts.in_base_mode(model, hf_experts.find_experts(model), torch.bfloat16)
    stack = on_cuda_route(model.layers) if device == "meta" else model.layers
    x = torch.randn(1, tokens, args.dim, device=device, requires_grad=True)
    cos, sin = rope_tables(tokens, args.head_dim, args.rope_theta, device)
    return stack, (x, cos, sin, torch.ones(tokens, tokens, dtype=torch.bool, device=device).triu(1))


def seconds(flavor: str, recipe: str | None, device: str, tokens: int, layers: int) -> tuple[float, float, int]:
    """(first call, second call) of a forward and backward through the blocks, each block's forward
    compiled as the trainer compiles it (parallelize.apply_compile), in seconds, and the graphs Dynamo
    compiled for the blocks."""
    from torch._dynamo.testing import CompileCounterWithBackend

    stack, (x, *rest) = blocks(flavor, recipe, device, tokens, layers)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor" if device == "cpu" else "aot_eager")
    for blk in stack:
        blk.forward = torch.compile(blk.forward, backend=counter)
    times = []
    for _ in range(2):
        start = time.perf_counter()
        with torch.autocast("cpu", torch.bfloat16, enabled=recipe is None and device == "cpu"):
            h = x
            for blk in stack:
                h = blk(h, *rest)
        h.float().square().mean().backward()
        times.append(time.perf_counter() - start)
    return times[0], times[1], counter.frame_count


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="1B")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--layers", type=int, default=1, help="blocks, each compiled as the trainer does")
    p.add_argument("--recipes", nargs="*", default=["tensorwise", "rowwise", "blockwise", "mxfp8", "nvfp4"])
    p.add_argument("--routes", nargs="*", default=["cpu", "meta"])
    args = p.parse_args()
    if importlib.util.find_spec("triton") is not None:
        blockwise_cast.register()
        blockwise_cast._PROBED["meta"] = None  # the Triton casts in, as on a GPU whose probe passed
    print(f"{args.flavor} flavor, {args.layers} block(s), {args.tokens} tokens; torch {torch.__version__}, "
          f"cpu {torch.backends.cpu.get_cpu_capability()}")
    print(f"{'recipe':<12} " + " ".join(f"{r + ' first (s)':>18} {r + ' second (s)':>18} {r + ' graphs':>10}"
                                        for r in args.routes))
    for recipe in [None, *args.recipes]:
        row = [seconds(args.flavor, recipe, route, args.tokens, args.layers) for route in args.routes]
        print(f"{recipe or 'bf16-mixed':<12} " + " ".join(f"{a:>18.1f} {b:>18.2f} {n:>10}" for a, b, n in row),
              flush=True)


if __name__ == "__main__":
    main()
