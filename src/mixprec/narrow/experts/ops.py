"""Grouped experts in a narrow recipe: the GEMMs of a mixture-of-experts layer, every expert
scaled on its own, by the same recipe objects as a converted Linear.

    key = register(ExpertsGemm(name, plan, transposed, salts))
    out = experts_mm(x, weight, offs, key)       # x (S, K) sorted by expert, weight (E, N, K)

`offs` holds the cumulative end of each expert's rows (int32, as torch's grouped GEMMs take
it: expert e owns rows offs[e-1]:offs[e]); rows past offs[-1] give zeros. Each pass casts
every expert at once, over the stacked tensors, with scales that never span two experts, and
runs each GEMM as one grouped GEMM with the offsets on the device (mixprec.narrow.experts.fp8
for the tensor-, row- and block-wise recipes, mixprec.narrow.experts.mx for the microscaled
ones; the per-expert bookkeeping in mixprec.narrow.experts.segments): no loop over the experts, no
read of the group sizes on the host, and a number of operators that does not grow with the
experts (tests/narrow/test_experts.py counts them at 8 and 64 experts, on the CPU and traced
on the meta device as CUDA runs them). Every expert's outputs and gradients equal, bit for
bit on the CPU, its dense Linear run alone on its own tokens under the same plan.

Each projection is one operator per pass (mixprec::experts_mm, its backward
mixprec::experts_mm_backward): a compiled model keeps the layer in its graph with no break.
The backward casts the input again from the saved input (the casts are deterministic: the
same operands as the forward's), so what is kept between the passes is the layer's input in
its own dtype, as a grouped BF16 layer keeps it.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from mixprec.errors import UserError
from mixprec.narrow.experts import fp8 as experts_fp8
from mixprec.narrow.experts import mx as experts_mx
from mixprec.narrow.linear.fp8 import Plan, linear_class
from mixprec.narrow.formats.recipe import Granularity


@dataclass(frozen=True)
class ExpertsGemm:
    """One projection of an experts layer (gate_up_proj, down_proj), fixed at conversion."""
    name: str  # the parameter's FQN, as the log and the audit name it
    plan: Plan  # the dense Linear's plan: recipe, tiles, compute dtype; its kernels the grouped route's (below)
    transposed: bool  # weight (E, K, N) (gpt-oss) rather than (E, N, K) (nn.Linear's per expert)
    salts: tuple[int, ...] = ()  # each expert's part of its stochastic-rounding keys (microscaled recipes)
    # the GEMMs on kernels (`uses_grouped`): row- and tensor-wise, forward and input gradient on torch's
    # grouped row-wise kernel (row-wise's weight gradient too); block-wise, all three on mixprec's
    # (mixprec.narrow.experts.blockwise)
    grouped: bool = False

    def __post_init__(self):
        # the GEMMs on kernels (where `grouped`) or on the grouped emulation: the plan says so, and a dense
        # Linear under it is each expert's reference
        # (row-wise's weight gradient too: scaled per expert along its tokens, a 2-D x 2-D grouped GEMM)
        wgrad = self.plan.recipe.granularity in (Granularity.BLOCKWISE, Granularity.ROWWISE)
        kernels = (self.grouped, self.grouped, self.grouped and wgrad)
        if self.plan.kernels != kernels:
            object.__setattr__(self, "plan", replace(self.plan, kernels=kernels))

    @property
    def matmul(self) -> type:
        return linear_class(self.plan.recipe).matmul

    def state(self, e: int):
        """What the dense matmul takes besides the plan: the microscaled recipes' salt; None for current scaling."""
        return self.salts[e] if self.salts else None

    @property
    def passes(self):
        """The module computing this projection's passes: mixprec.narrow.experts.fp8 or experts_mx."""
        return experts_mx if self.plan.recipe.granularity is Granularity.MICROSCALED else experts_fp8


class Key(NamedTuple):
    """What the operators take for one layer's projection, their last two arguments (`*key`). `salts`: the
    layer's own part, a tensor (E + 1,) int64 on the layer's device (each expert's stochastic-rounding salt,
    0 for the rows past offs[-1]); None where the recipe draws none. `index`: the registry's entry for what
    the projection computes (its plan, layout and routes, named by its role, gate_up_proj or down_proj), one
    for every layer of a plan: a compiled model guards on a Python integer's value, and a key of its own per
    layer would compile each MoE block again (and run those past Dynamo's recompile limit eagerly)."""
    salts: torch.Tensor | None
    index: int


_GEMMS: list[ExpertsGemm] = []  # the operators take an index into this registry (an operator takes no plan object)
_INDEX: dict[ExpertsGemm, int] = {}


def register(gemm: ExpertsGemm, device: str = "cpu") -> Key:
    """The key a layer's projection is known by to the operators, its salts placed on `device`."""
    shared = replace(gemm, name=gemm.name.rpartition(".")[2], salts=())
    if shared not in _INDEX:
        _INDEX[shared] = len(_GEMMS)
        _GEMMS.append(shared)
    return Key(_salts(gemm.salts, device) if gemm.salts else None, _INDEX[shared])


@functools.lru_cache(maxsize=None)
def _salts(salts: tuple, device: str) -> torch.Tensor:
    """(E + 1,) int64: each expert's salt (the dense layer's `salt or 0`), 0 for the rows past offs[-1];
    made on the host once per layer and device (at conversion and when the layer moves, never in a step),
    outside any fake mode (a model built under the memory planner's), and copied to an accelerator without a
    wait (from pinned memory on CUDA)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        host = torch.tensor([s or 0 for s in salts] + [0], dtype=torch.long)
        kind = torch.device(device).type
        if kind == "cpu":
            return host
        return (host.pin_memory() if kind == "cuda" else host).to(device, non_blocking=True)


def gemm_of(index: int) -> ExpertsGemm:
    """What the projection registered at `index` computes (named by its role: the layer is the caller's)."""
    return _GEMMS[index]


DELAYED = "delayed scaling keeps one amax history per Linear layer and none for grouped experts"


def check_recipe(recipe) -> None:
    """Experts take every current-scaling recipe; delayed scaling keeps one amax history per Linear."""
    if recipe.delayed:
        raise UserError(f"fp8.recipe = {recipe.name!r}: {DELAYED}; accepted for experts: tensorwise, rowwise, "
                        "blockwise, mxfp8, nvfp4, mxfp4 (or keep the experts in the base mode with fp8.filter_fqns)")


def groups(offs: torch.Tensor) -> list[tuple[int, int]]:
    """Each expert's (start, end) rows, read on the host (the base mode's loop outside bfloat16, and tests)."""
    ends = offs.tolist()
    return list(zip([0] + ends[:-1], ends))


def no_autocast(device: torch.device):
    """The narrow GEMMs choose their own dtypes: autocast has no say inside (as FP8Linear.forward)."""
    return torch.autocast(device.type, enabled=False) if device.type in ("cpu", "cuda") else contextlib.nullcontext()


def _by_output(weight: torch.Tensor, g: ExpertsGemm) -> torch.Tensor:
    """(E, N, K): each expert's weight as an nn.Linear holds it."""
    return weight.transpose(1, 2) if g.transposed else weight


def forward(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, g: ExpertsGemm) -> torch.Tensor:
    """(S, K) -> (S, N) in the plan's compute dtype: every expert as its dense Linear, in grouped passes."""
    with no_autocast(x.device):
        return g.passes.forward(x, _by_output(weight, g), offs, g)


def backward(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, dy: torch.Tensor, g: ExpertsGemm,
             salts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx (S, K) in x's dtype, dW in the weight's layout and dtype): every expert's dense backward, grouped.
    salts: the layer's (`Key.salts`); None: g's own."""
    if g.passes is experts_mx:  # the FP8 recipes round to nearest: no salts
        extra = (salts if salts is not None or not g.salts else _salts(g.salts, str(x.device)),)
    else:
        extra = ()
    with no_autocast(x.device):
        dx, dw = g.passes.backward(x, _by_output(weight, g), offs, dy.contiguous(), g, *extra)
    return dx, (dw.transpose(1, 2) if g.transposed else dw)


# the forward needs no salts (the recipes round their forward casts to nearest); the operator takes them so
# that the autograd context holds them for the backward
@torch.library.custom_op("mixprec::experts_mm", mutates_args=())
def _experts_mm(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, salts: torch.Tensor | None,
                key: int) -> torch.Tensor:
    return forward(x, weight, offs, gemm_of(key))


@_experts_mm.register_fake
def _(x, weight, offs, salts, key):
    g = gemm_of(key)
    return x.new_empty(x.shape[0], _by_output(weight, g).shape[1], dtype=g.plan.compute_dtype)


@torch.library.custom_op("mixprec::experts_mm_backward", mutates_args=())
def _experts_mm_backward(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, dy: torch.Tensor,
                         salts: torch.Tensor | None, key: int) -> tuple[torch.Tensor, torch.Tensor]:
    return backward(x, weight, offs, dy, gemm_of(key), salts)


@_experts_mm_backward.register_fake
def _(x, weight, offs, dy, salts, key):
    return torch.empty_like(x), torch.empty_like(weight)


def _setup_context(ctx, inputs, output):
    x, weight, offs, salts, key = inputs
    ctx.save_for_backward(x, weight, offs, salts)
    ctx.key = key


def _backward(ctx, dy):
    x, weight, offs, salts = ctx.saved_tensors
    dx, dw = torch.ops.mixprec.experts_mm_backward(x, weight, offs, dy, salts, ctx.key)
    return dx, dw, None, None, None


_experts_mm.register_autograd(_backward, setup_context=_setup_context)


def experts_mm(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, key: Key) -> torch.Tensor:
    """The experts projection registered as `key` (`register`) on x (S, K), rows sorted by expert."""
    return torch.ops.mixprec.experts_mm(x, weight, offs, *key)


# ---- a projection whose input arrived cast (expert parallelism's FP8 dispatch) --------------------------------
def takes_cast_input(g: ExpertsGemm) -> tuple[tuple[int, int], bool] | None:
    """(tile, power_of_2) of the input cast of a row- or block-wise projection, whose GEMMs take rows cast so
    as they are (one scale per token and K tile: nothing spans two experts); None for the other recipes."""
    r = g.plan.recipe
    if g.passes is not experts_fp8 or r.granularity not in (Granularity.ROWWISE, Granularity.BLOCKWISE):
        return None
    return g.plan.tiles.x, r.power_of_2_scales


def _cast_input(x_data: torch.Tensor, x_scale_inv: torch.Tensor, g: ExpertsGemm):
    from mixprec.narrow.formats.scaling import Quantized, resolve_tile

    return Quantized(x_data, x_scale_inv, resolve_tile(g.plan.tiles.x, x_data.shape))


def experts_mm_cast_input(x: torch.Tensor, x_data: torch.Tensor, x_scale_inv: torch.Tensor, weight: torch.Tensor,
                          offs: torch.Tensor, key: int) -> torch.Tensor:
    """The forward of mixprec::experts_mm_cast_input (also what a narrow-gathered weight runs)."""
    g = gemm_of(key)
    with no_autocast(x.device):
        return g.passes.forward(x, _by_output(weight, g), offs, g, _cast_input(x_data, x_scale_inv, g))


@torch.library.custom_op("mixprec::experts_mm_cast_input", mutates_args=())
def _experts_mm_cast(x: torch.Tensor, x_data: torch.Tensor, x_scale_inv: torch.Tensor, weight: torch.Tensor,
                     offs: torch.Tensor, key: int) -> torch.Tensor:
    return experts_mm_cast_input(x, x_data, x_scale_inv, weight, offs, key)


@_experts_mm_cast.register_fake
def _(x, x_data, x_scale_inv, weight, offs, key):
    g = gemm_of(key)
    return x.new_empty(x.shape[0], _by_output(weight, g).shape[1], dtype=g.plan.compute_dtype)


def experts_mm_cast_input_backward(x_data: torch.Tensor, x_scale_inv: torch.Tensor, weight: torch.Tensor,
                                   offs: torch.Tensor, dy: torch.Tensor, key: int,
                                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward of mixprec::experts_mm_cast_input: (dx in `dtype`, dW)."""
    g = gemm_of(key)
    with no_autocast(dy.device):
        dx, dw = g.passes.backward(None, _by_output(weight, g), offs, dy.contiguous(), g,
                                   _cast_input(x_data, x_scale_inv, g), dtype)
    return dx, (dw.transpose(1, 2) if g.transposed else dw)


@torch.library.custom_op("mixprec::experts_mm_cast_input_backward", mutates_args=())
def _experts_mm_cast_backward(x_data: torch.Tensor, x_scale_inv: torch.Tensor, weight: torch.Tensor,
                              offs: torch.Tensor, dy: torch.Tensor, key: int,
                              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return experts_mm_cast_input_backward(x_data, x_scale_inv, weight, offs, dy, key, dtype)


@_experts_mm_cast_backward.register_fake
def _(x_data, x_scale_inv, weight, offs, dy, key, dtype):
    return x_data.new_empty(x_data.shape, dtype=dtype), torch.empty_like(weight)


def _cast_setup_context(ctx, inputs, output):
    x, x_data, x_scale_inv, weight, offs, key = inputs
    ctx.save_for_backward(x_data, x_scale_inv, weight, offs)  # the FP8 rows, not x: 1 byte an element
    ctx.key, ctx.dtype = key, x.dtype


def _cast_backward(ctx, dy):
    x_data, x_scale_inv, weight, offs = ctx.saved_tensors
    dx, dw = torch.ops.mixprec.experts_mm_cast_input_backward(x_data, x_scale_inv, weight, offs, dy, ctx.key,
                                                               ctx.dtype)
    return dx, None, None, dw, None, None


_experts_mm_cast.register_autograd(_cast_backward, setup_context=_cast_setup_context)


