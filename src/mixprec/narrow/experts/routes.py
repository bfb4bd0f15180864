"""Which GEMM route experts take on a device, each kernel probed once against the grouped emulation before it
is used: torch's grouped row-wise kernel (row- and tensor-wise recipes) and mixprec's grouped block-wise Triton
kernels; the conversion's log line of the route taken, and a projection as a Hopper GPU runs it (for tracing
CUDA's route on meta)."""

from __future__ import annotations

import functools
from dataclasses import replace

import torch

from mixprec.narrow.experts import fp8 as experts_fp8
from mixprec.narrow.experts import ops
from mixprec.narrow.experts.ops import ExpertsGemm
from mixprec.narrow.formats.recipe import RECIPES, Granularity
from mixprec.narrow.linear.fp8 import Plan


# ---- the grouped row-wise kernel (CUDA, SM90 and SM100) -------------------------------------------------------
# Row-wise scales run along the dimension a GEMM sums over, and tensor-wise ones are one scale per
# expert held per row: the forward's and the input gradient's operands are scaled per row of a and
# per expert and column of b, as torch's grouped row-wise kernel takes them. Row-wise's weight gradient,
# scaled per expert and column along the expert's tokens, is the kernel's 2-D x 2-D form (each expert's
# tokens padded to 16); tensor-wise's, on e5m2 gradients, runs on the grouped emulation.
def grouped_route(device: str, compute_dtype: torch.dtype) -> str | None:
    """None where the row-wise experts' forward and input-gradient GEMMs run on torch's grouped
    row-wise kernel; otherwise why they run on the grouped emulation."""
    if device != "cuda":
        return "torch's grouped scaled GEMM runs on CUDA GPUs only"
    if compute_dtype != torch.bfloat16:
        return "torch's grouped scaled GEMM writes bfloat16 only"
    if not hasattr(torch, "_scaled_grouped_mm"):
        return f"torch {torch.__version__} has no torch._scaled_grouped_mm"
    if torch.cuda.get_device_capability() not in ((9, 0), (10, 0)):
        return "torch's grouped row-wise kernel needs compute capability 9.0 or 10.0"
    return _probe_grouped(device)


@functools.lru_cache(maxsize=None)
def _probe_grouped(device: str) -> str | None:
    """The grouped kernel's forward, input and weight gradients against the grouped emulation on a
    4-expert problem with an empty and an odd group: None when they agree within bfloat16 rounding,
    else why the kernel is not used."""
    recipe = RECIPES["rowwise"]
    plan = Plan(recipe, recipe.tiles, torch.bfloat16, (True, True, True), device=device)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(112, 128, generator=gen).to(device, torch.bfloat16)
    w = torch.randn(4, 256, 128, generator=gen).to(device)
    offs = torch.tensor([48, 48, 95, 112], dtype=torch.int32, device=device)
    dy = torch.randn(112, 256, generator=gen).to(device, torch.bfloat16)

    def passes(grouped):
        g = ExpertsGemm("probe", plan, False, grouped=grouped)
        return (ops.forward(x, w, offs, g), *ops.backward(x, w, offs, dy, g))
    try:
        got = passes(True)
    except Exception as e:  # noqa: BLE001 - whatever the kernel raises, the experts run emulated and say why
        return f"torch's grouped row-wise kernel refused the layout ({str(e).splitlines()[0][:160]})"
    err = max(float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(got, passes(False)))
    return None if err < 1e-2 else f"torch's grouped row-wise kernel disagrees with the grouped emulation ({err:.2g})"


def uses_grouped(plan: Plan) -> bool:
    """Whether experts under `plan` run GEMMs on kernels: the grouped row-wise kernel (forward and input
    gradient), or for block-wise mixprec's grouped block-wise kernels (all three)."""
    if plan.emulated:
        return False
    if plan.recipe.granularity is Granularity.BLOCKWISE:
        return blockwise_route(plan.device) is None
    return (plan.recipe.granularity in (Granularity.ROWWISE, Granularity.TENSORWISE) and plan.kernels[0]
            and grouped_route(plan.device, plan.compute_dtype) is None)


def on_hopper(g: ExpertsGemm) -> ExpertsGemm:
    """g as a Hopper GPU runs it, for tracing CUDA's route on meta (the roofline, the memory plan): row- and
    tensor-wise on torch's grouped row-wise kernel, block-wise on mixprec's grouped block-wise kernels, the
    microscaled recipes (and fp8.emulate) on the grouped emulation."""
    grouped = not g.plan.emulated and g.plan.recipe.granularity in (
        Granularity.TENSORWISE, Granularity.ROWWISE, Granularity.BLOCKWISE)
    return replace(g, plan=replace(g.plan, device="cuda"), grouped=grouped)


def describe(plan: Plan) -> str:
    """How experts under `plan` run their GEMMs, for the conversion's log line."""
    casts = "every expert's casts in one pass over the stacked tensors, no host read"
    if uses_grouped(plan) and plan.recipe.granularity is Granularity.BLOCKWISE:
        return (f"all three GEMMs on mixprec's grouped block-wise Triton kernels (DeepGEMM's contiguous layout, "
                f"each expert's tokens from a multiple of 128); {casts}")
    if uses_grouped(plan):
        if plan.recipe.grad_dtype != torch.float8_e4m3fn:
            on_kernel, rest = "forward", "the e5m2 gradients' GEMMs on the grouped emulation (the kernel takes e4m3 only)"
        elif plan.recipe.granularity is Granularity.ROWWISE:
            on_kernel, rest = "all three GEMMs", "the weight gradient 2-D x 2-D, each expert's tokens padded to 16"
        else:
            on_kernel, rest = "forward and input gradient", "the weight gradient on the grouped emulation"
        return f"{on_kernel} on torch's grouped row-wise kernel (torch._scaled_grouped_mm), {rest}; {casts}"
    why = ""
    if plan.recipe.granularity in (Granularity.ROWWISE, Granularity.TENSORWISE):
        why = "; not torch's grouped row-wise kernel: " + (
            "fp8.emulate = true" if plan.emulated else grouped_route(plan.device, plan.compute_dtype) or
            "the recipe's dense kernel is not used on this device")
    elif plan.recipe.granularity is Granularity.BLOCKWISE:
        why = ("; torch has no grouped block-wise scaled GEMM, and mixprec's kernels are not used: " +
               ("fp8.emulate = true" if plan.emulated else blockwise_route(plan.device)))
    return f"the grouped emulation (each GEMM one torch grouped GEMM on the dequantised elements); {casts}{why}"


# ---- mixprec's grouped block-wise kernels (CUDA, Triton) ---------------------------------------------------------
def blockwise_route(device: str) -> str | None:
    """None where block-wise experts run on the kernels on `device`; otherwise why the grouped emulation runs."""
    if device != "cuda":
        return "mixprec's grouped block-wise kernels run on CUDA GPUs only"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed (mixprec's grouped block-wise kernels are Triton kernels)"
    if torch.cuda.get_device_capability() < (8, 9):
        return "FP8 tensor cores need compute capability 8.9 or more"
    return _probe_blockwise(device)


@functools.lru_cache(maxsize=None)
def _probe_blockwise(device: str) -> str | None:
    """The kernels against the grouped emulation on a 4-expert problem (an empty expert, sizes off 128):
    None when forward, input and weight gradients agree within bfloat16 rounding, else why not used."""
    recipe = RECIPES["blockwise"]
    plan = Plan(recipe, recipe.tiles, torch.bfloat16, (True, True, True), device=device)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(300, 256, generator=gen).to(device, torch.bfloat16)
    w = torch.randn(4, 384, 256, generator=gen).to(device)
    dy = torch.randn(300, 384, generator=gen).to(device, torch.bfloat16)
    offs = torch.tensor([130, 130, 257, 300], dtype=torch.int32, device=device)
    results = []
    for kernel in (True, False):
        g = ExpertsGemm("probe", plan, False, grouped=kernel)
        try:
            results.append((experts_fp8.forward(x, w, offs, g), *experts_fp8.backward(x, w, offs, dy, g)))
        except Exception as e:  # noqa: BLE001 - whatever the kernels raise, the emulation runs and says why
            return f"mixprec's grouped block-wise kernels failed here ({str(e).splitlines()[0][:160]})"
    for got, want in zip(*results):
        err = float((got.float() - want.float()).norm() / want.float().norm())
        if not err < 1e-2:
            return f"mixprec's grouped block-wise kernels disagree with the grouped emulation ({err:.2g})"
    return None
