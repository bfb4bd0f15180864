"""Graph breaks of one compiled transformer block, forward and backward, in each dense narrow
recipe, on the CPU's route (CPU tensors, each GEMM where gemm.route_on puts it here) and on
CUDA's route traced on the meta device (every GEMM on torch's kernels, the block-wise backward's
Triton casts in as on a GPU whose probe passed): no GPU needed. 0 is the aim everywhere; a break
splits the step into graphs with the casts beside the GEMMs unfused.

    python benchmarks/graph_breaks.py [--recipes blockwise mxfp8]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import time
from collections import Counter

import torch
import torch._dynamo
from torch._dynamo.utils import counters

from mixprec.models.llama import build_model, model_args, rope_tables
from mixprec.narrow.formats import blockwise_cast
from mixprec.narrow.convert import convert_to_fp8
from mixprec.narrow.linear.fp8 import FP8Linear
from mixprec.narrow.formats.recipe import RECIPES, FP8Recipe


def on_cuda_route(module: torch.nn.Module) -> torch.nn.Module:
    """`module` on the meta device with its narrow layers planned as on CUDA: every GEMM on torch's kernels."""
    for m in module.modules():
        if isinstance(m, FP8Linear):
            m.plan = dataclasses.replace(m.plan, kernels=(True, True, True), device="cuda")
    return module.to("meta")


def block(recipe: str, device: str):
    """The first block of a 2-layer Llama (dim 256: whole 128-tiles) in `recipe`; on meta, CUDA's route."""
    args = model_args("debug", 256, dim=256, multiple_of=128)
    model = build_model(args, device="cpu", storage_dtype=torch.float32, seed=0)
    convert_to_fp8(model, FP8Recipe.from_name(recipe), compute_dtype=torch.bfloat16)
    blk = on_cuda_route(model.layers[0]) if device == "meta" else model.layers[0]
    T = 128
    x = torch.randn(2, T, args.dim, device=device, requires_grad=True)
    cos, sin = rope_tables(T, args.head_dim, args.rope_theta, device)
    return blk, (x, cos, sin, torch.ones(T, T, dtype=torch.bool, device=device).triu(1))


def breaks(recipe: str, device: str) -> tuple[int, Counter, float]:
    """(graph breaks, their reasons' first lines, seconds) of a forward and backward of the block."""
    blk, inputs = block(recipe, device)
    torch._dynamo.reset()
    counters.clear()
    start = time.perf_counter()
    y = torch.compile(blk, backend="aot_eager")(*inputs)
    y.float().square().mean().backward()
    reasons = Counter({k.splitlines()[0][:120]: v for k, v in counters["graph_break"].items()})
    return sum(reasons.values()), reasons, time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", nargs="*", default=list(RECIPES))
    args = p.parse_args()
    if importlib.util.find_spec("triton") is not None:
        blockwise_cast.register()
        blockwise_cast._PROBED["meta"] = None  # the Triton casts in, as on a GPU whose probe passed
    print(f"torch {torch.__version__}, cpu {torch.backends.cpu.get_cpu_capability()}")
    print(f"{'recipe':<12} {'CPU route':>10} {'CUDA route (meta)':>18}")
    for recipe in args.recipes:
        found = {device: breaks(recipe, device) for device in ("cpu", "meta")}
        print(f"{recipe:<12} {found['cpu'][0]:>10} {found['meta'][0]:>18}", flush=True)
        for device, (_, reasons, _) in found.items():
            for reason, n in reasons.items():
                print(f"    {device}: {n} x {reason}")


if __name__ == "__main__":
    main()
