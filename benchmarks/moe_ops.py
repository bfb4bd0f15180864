"""The work of one experts projection in a narrow recipe, counted on the CPU: the aten operators its
forward and backward dispatch outside the grouped GEMMs (a GPU launches one kernel or more per op), at
8 and at 64 experts, and the host reads among them. Flat in the experts is what a GPU needs.

    python benchmarks/moe_ops.py                      # the CPU's route
    python benchmarks/moe_ops.py --device meta        # the route CUDA takes, traced on the meta device
    python benchmarks/moe_ops.py --device meta --kernels  # with its kernels (row-, tensor-, block-wise)

300 tokens over three quarters of the experts, K 48, N 80 (off the 128 grid), bfloat16 tokens.
"""

from __future__ import annotations

import argparse
import zlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mixprec.narrow.experts import ops as experts
from mixprec.narrow.linear.fp8 import Plan
from mixprec.narrow.formats.recipe import RECIPES

GEMMS = ("mm", "grouped_mm", "_grouped_mm", "_scaled_mm", "_scaled_grouped_mm", "mx_mm", "blockwise_scaled_mm",
         "grouped_blockwise_mm", "grouped_blockwise_wgrad")
RECIPE_NAMES = ("tensorwise", "rowwise", "blockwise", "mxfp8", "nvfp4", "mxfp4")


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = self.gemms = self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        self.gemms += name in GEMMS
        self.ops += name not in GEMMS
        self.reads += name == "_local_scalar_dense"
        return func(*args, **(kwargs or {}))


def count(name: str, E: int, device: str, kernels: bool = False) -> Count:
    recipe = RECIPES[name]
    plan = Plan(recipe, recipe.tiles, torch.bfloat16, (False, False, False))
    salts = tuple(zlib.crc32(f"e.{e}".encode()) for e in range(E)) if hasattr(recipe, "element") else ()
    grouped = kernels and name in ("tensorwise", "rowwise", "blockwise")
    g = experts.ExpertsGemm("e.gate_up_proj", plan, False, salts, grouped=grouped)
    gen = torch.Generator().manual_seed(0)
    sizes = torch.zeros(E, dtype=torch.long)
    sizes[: 3 * E // 4] = torch.randint(1, 600 // E, (3 * E // 4,), generator=gen)
    offs = sizes.cumsum(0).to(torch.int32).to(device)
    x = torch.randn(300, 48, generator=gen).bfloat16().to(device)
    w = torch.randn(E, 80, 48, generator=gen).to(device)
    dy = torch.randn(300, 80, generator=gen).bfloat16().to(device)
    experts.forward(x, w, offs, g), experts.backward(x, w, offs, dy, g)  # first calls: what is kept, made once
    with Count() as c:
        experts.forward(x, w, offs, g)
        experts.backward(x, w, offs, dy, g)
    return c


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "meta"))
    parser.add_argument("--kernels", action="store_true", help="the kernels' routes (meta only: they run on CUDA)")
    args = parser.parse_args()
    print(f"# one experts projection, forward + backward, torch {torch.__version__}, device {args.device}"
          f"{', the kernels where a recipe has them' if args.kernels else ''}")
    print("| recipe | ops at 8 experts | ops at 64 experts | growth | grouped GEMMs | host reads |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in RECIPE_NAMES:
        few, many = count(name, 8, args.device, args.kernels), count(name, 64, args.device, args.kernels)
        print(f"| {name} | {few.ops} | {many.ops} | {many.ops / few.ops:.2f}x | {few.gemms} / {many.gemms} | "
              f"{few.reads + many.reads} |")


if __name__ == "__main__":
    main()
