"""What one MoE layer's experts cost on a GPU, estimated on the CPU from their work and their bytes:
both projections (gate_up_proj, down_proj), forward and backward, in every recipe along the route CUDA
takes, traced on the meta device, against the bfloat16 grouped layer.

    python benchmarks/moe_roofline.py                   # Qwen3-30B-A3B's layer: H 2048, I 768, 128 experts,
                                                        # top-8, 16,384 tokens (131,072 routed rows)
    python benchmarks/moe_roofline.py --tokens 4096     # a smaller batch
    python benchmarks/moe_roofline.py --ops             # and the largest operator kinds of each recipe
    python benchmarks/moe_roofline.py --weights bf16    # the weights as FSDP2 gathers them in bfloat16

Memory: the most bytes alive at once through both projections' passes (torch's MemTracker on meta: inputs,
weights, what each pass allocates inside mixprec's operators, outputs), against the bfloat16 layer's; with FP32
master weights, bf16-mixed's experts (the same FP32 weights and gradients, cast to bfloat16 each pass) are the
like-for-like reference of the narrow recipes' peaks.

Counted: every aten operator an experts pass dispatches, its tensors' bytes in and out (views free), its
GEMMs' FLOPs. mixprec's own operators are opened (what they run inside is counted), but for a Triton
kernel (one launch, its own inputs and outputs) and a function the code compiles on CUDA (`cuda_compiled`:
one fused kernel of its inputs and outputs). The user's torch.compile of the model is not assumed to
reach inside (custom operators are opaque to it, and eager users exist). Priced on an H100 SXM:
GEMMs at 720 TFLOP/s in bfloat16 and 1,350 in FP8 (measured cuBLAS rates), every other operator's
bytes at 3.0 TB/s, 5 us a kernel. The GEMMs' own operand bytes are in their FLOP time (compute-bound).
"""

from __future__ import annotations

import argparse
import collections
import zlib

import torch
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from mixprec.dtypes import parse_dtype
from mixprec.analysis.cuda_route import as_on_cuda, inside
from mixprec.narrow.experts import ops as experts
from mixprec.narrow.experts.layer import base_mm
from mixprec.narrow.experts.routes import on_hopper
from mixprec.narrow.linear.fp8 import Plan
from mixprec.narrow.formats.recipe import RECIPES

RECIPE_NAMES = ("tensorwise", "rowwise", "blockwise", "mxfp8", "nvfp4", "mxfp4")
BF16_FLOPS, FP8_FLOPS, BANDWIDTH, LAUNCH = 720e12, 1350e12, 3.0e12, 5e-6
aten = torch.ops.aten
VIEWS = {aten.view, aten._unsafe_view, aten.t, aten.transpose, aten.permute, aten.expand, aten.slice, aten.select,
         aten.alias, aten.unsqueeze, aten.squeeze, aten.as_strided, aten.narrow, aten.reshape, aten.detach,
         aten.split, aten.unbind, aten.view_as, aten.expand_as, aten.lift_fresh}
FP8_GEMMS = {"_scaled_grouped_mm", "grouped_blockwise_mm", "grouped_blockwise_wgrad"}
BF16_GEMMS = {"_grouped_mm", "bmm", "mm"}


def nbytes(tree) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(tree) if isinstance(t, torch.Tensor))


def _aliases(out, inputs) -> bool:
    """Whether an operator's output is one of its inputs (a .to that had nothing to do)."""
    ins = {id(t) for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)}
    return isinstance(out, torch.Tensor) and id(out) in ins


def gemm_flops(name: str, args, out) -> float:
    """2 x the multiply-adds of a GEMM, each row or summed element once (groups split one dimension)."""
    a, b = args[0], args[1]
    if name == "grouped_blockwise_mm":  # a (S, SUM), its scales, b (E, SUM, OUT), src (P,): each of the layout's
        return 2.0 * args[4].shape[0] * a.shape[1] * args[2].shape[2]  # P positions through its tile's expert
    if name == "grouped_blockwise_wgrad":  # g^T (N, P), its scales, x^T (K, P): every position's N x K products
        return 2.0 * a.shape[0] * a.shape[1] * args[2].shape[0]
    if a.dim() == 2 and b.dim() == 3:  # (S, K) x (E, K, N): each row through its expert
        return 2.0 * a.shape[0] * a.shape[1] * b.shape[2]
    if a.dim() == 2 and b.dim() == 2 and out.dim() == 3:  # (N, S) x (S, K) -> (E, N, K): the tokens split
        return 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
    return 2.0 * out.numel() * a.shape[-1]  # mm, bmm


class Cost(TorchDispatchMode):
    """Kernels, bytes and FLOPs of what runs under it, mixprec's operators opened (see the module doc)."""

    def __init__(self, stats=None):
        super().__init__()
        self.stats = stats if stats is not None else {"ops": 0, "bytes": 0, "bf16_flops": 0.0, "fp8_flops": 0.0,
                                                      "by_kind": collections.Counter()}

    def record(self, kind: str, moved: int) -> None:
        self.stats["ops"] += 1
        self.stats["bytes"] += moved
        self.stats["by_kind"][kind] += moved

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        fn = inside(func)
        if fn is not None:
            with Cost(self.stats):  # opened: its insides counted as what they dispatch
                return fn(*args, **kwargs)
        out = func(*args, **kwargs)
        if func.overloadpacket in VIEWS or (not name.endswith("_") and _aliases(out, (args, kwargs))):
            return out  # a view, or a .to that had nothing to do (an in-place op returns its input: it counts)
        if name in FP8_GEMMS or name in BF16_GEMMS:
            self.stats["fp8_flops" if name in FP8_GEMMS else "bf16_flops"] += gemm_flops(name, args, out)
            self.stats["ops"] += 1
            return out
        self.record(name, nbytes((args, kwargs)) + nbytes(out))
        return out


def fused(cost: Cost):
    """Told of each function the code compiles on CUDA (cuda_route.as_on_cuda): one Inductor kernel reading its
    inputs and writing its outputs once."""
    def on_kernel(fn, args, out):
        cost.record(f"compiled {fn.__name__}", nbytes(args) + nbytes(tuple(vars(out).values())
                                                                  if hasattr(out, "__dict__") else out))
    return on_kernel


def projection(name: str, E: int, N: int, K: int, which: str):
    """An experts projection as CUDA runs it: the GEMM kernels where the recipe has them on Hopper."""
    recipe = RECIPES[name]
    plan = Plan(recipe, recipe.tiles, torch.bfloat16, (False, False, False))
    salts = tuple(zlib.crc32(f"e.{which}.{e}".encode()) for e in range(E)) if hasattr(recipe, "element") else ()
    return on_hopper(experts.ExpertsGemm(f"e.{which}", plan, False, salts))


def layer_cost(name: str, tokens: int, top_k: int, E: int, H: int, I: int, weights=torch.float32) -> dict:
    """Both projections' forward and backward at a router-like, even load (each expert rows // E), the narrow
    recipes' weights (and so their gradients) in `weights`."""
    rows = tokens * top_k
    sizes = torch.full((E,), rows // E)
    sizes[: rows % E] += 1
    offs = sizes.cumsum(0).to(torch.int32).to("meta")
    cost, memory = Cost(), MemTracker()
    with memory:  # the most bytes alive at once: inputs, weights, what the passes allocate inside, outputs
        _projections(name, cost, rows, offs, E, H, I, weights)
    s = cost.stats
    gemm_s = s["bf16_flops"] / BF16_FLOPS + s["fp8_flops"] / FP8_FLOPS
    return {**s, "gemm_ms": gemm_s * 1e3, "ms": (gemm_s + s["bytes"] / BANDWIDTH + s["ops"] * LAUNCH) * 1e3,
            "peak": memory.get_tracker_snapshot("peak")[torch.device("meta")]["Total"]}


def _projections(name: str, cost: Cost, rows: int, offs: torch.Tensor, E: int, H: int, I: int, weights) -> None:
    for which, (N, K) in (("gate_up_proj", (2 * I, H)), ("down_proj", (H, I))):
        x = torch.empty(rows, K, dtype=torch.bfloat16, device="meta")
        # the narrow recipes cast their weights (FP32 masters, or bfloat16 as FSDP2 gathers them); the reference is
        # the bfloat16 layer's GEMMs, its weights held in bfloat16; bf16-mixed's experts cast FP32 masters to
        # bfloat16 each pass, as autocast casts a Linear's
        w = torch.empty(E, N, K, dtype=torch.bfloat16 if name == "bf16" else weights, device="meta")
        dy = torch.empty(rows, N, dtype=torch.bfloat16, device="meta")
        if name in ("bf16", "bf16-mixed"):
            with cost:
                out = base_mm(x.requires_grad_(), w.requires_grad_(), offs, transposed=False,
                                      dtype=torch.bfloat16)
                torch.autograd.grad(out, (x, w), dy)
            continue
        g = projection(name, E, N, K, which)
        with cost:
            out = experts.forward(x, w, offs, g)
            grads = experts.backward(x, w, offs, dy, g)
        del out, grads  # the next projection's inputs take their place


def estimate(tokens=16384, top_k=8, experts_=128, hidden=2048, intermediate=768, recipes=RECIPE_NAMES,
             weights=torch.float32) -> dict:
    """{recipe: cost} for bf16 and each recipe, with cuda_compiled and the GEMM operands' dtype as on CUDA."""
    out = {"bf16": layer_cost("bf16", tokens, top_k, experts_, hidden, intermediate)}
    if weights != torch.bfloat16:  # its FP32 masters, the narrow recipes' own: the peak to hold them to
        out["bf16-mixed"] = layer_cost("bf16-mixed", tokens, top_k, experts_, hidden, intermediate, weights)
    for name in recipes:
        probe = Cost()
        with as_on_cuda(fused(probe)):
            c = layer_cost(name, tokens, top_k, experts_, hidden, intermediate, weights)
        for key in ("ops", "bytes"):
            c[key] += probe.stats[key]
        c["by_kind"].update(probe.stats["by_kind"])
        c["ms"] += (probe.stats["bytes"] / BANDWIDTH + probe.stats["ops"] * LAUNCH) * 1e3
        out[name] = c
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--ops", action="store_true", help="the five largest operator kinds of each recipe")
    parser.add_argument("--weights", choices=("fp32", "bf16"), default="fp32",
                        help="the narrow recipes' expert weights and gradients: FP32 masters (default), or bfloat16 "
                             "as FSDP2 gathers them with param_dtype bfloat16 (the reference's own)")
    args = parser.parse_args(argv)
    weights = parse_dtype(args.weights, "--weights")
    table = estimate(args.tokens, args.top_k, args.experts, args.hidden, args.intermediate, weights=weights)
    base = table["bf16"]["ms"]
    print(f"MoE experts, H {args.hidden}, I {args.intermediate}, {args.experts} experts, top-{args.top_k}, "
          f"{args.tokens} tokens ({args.tokens * args.top_k} rows); both projections, forward and backward; "
          f"the narrow recipes' weights in {args.weights}; CUDA's route traced on meta, priced at H100 rates")
    mixed = table.get("bf16-mixed")  # with FP32 masters: the like-for-like reference, in two more columns
    print("| recipe | non-GEMM traffic | ops | GEMMs | estimate | vs bf16 | peak memory | vs bf16 |"
          + (" time vs bf16-mixed | peak vs bf16-mixed |" if mixed else ""))
    print("|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if mixed else ""))
    for name, c in table.items():
        print(f"| {name} | {c['bytes'] / 1e9:.1f} GB | {c['ops']} | {c['gemm_ms']:.2f} ms | {c['ms']:.2f} ms | "
              f"{base / c['ms']:.2f}x | {c['peak'] / 2**30:.2f} GiB | {c['peak'] / table['bf16']['peak']:.2f}x |"
              + (f" {mixed['ms'] / c['ms']:.2f}x | {c['peak'] / mixed['peak']:.2f}x |" if mixed else ""))
    if args.ops:
        for name, c in table.items():
            top = ", ".join(f"{k} {v / 1e9:.1f} GB" for k, v in c["by_kind"].most_common(5))
            print(f"{name}: {top}")


if __name__ == "__main__":
    main()
