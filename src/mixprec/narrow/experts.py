"""Grouped experts in a narrow recipe: the GEMMs of a mixture-of-experts layer, every expert
scaled on its own, by the same recipe objects as a converted Linear.

    out = experts_mm(x, weight, offs, layer)     # x (S, K) sorted by expert, weight (E, N, K)

`offs` holds the cumulative end of each expert's rows (int32, as torch's grouped GEMMs take
it: expert e owns rows offs[e-1]:offs[e]); rows past offs[-1] give zeros. Each pass casts
every expert at once, over the stacked tensors, with scales that never span two experts, and
runs each GEMM as one grouped GEMM with the offsets on the device (mixprec.narrow.experts_fp8
for the tensor-, row- and block-wise recipes, mixprec.narrow.experts_mx for the microscaled
ones; the per-expert bookkeeping in mixprec.narrow.segments): no loop over the experts, no
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

import torch
import torch.nn.functional as F

from mixprec.errors import UserError
from mixprec.narrow import experts_blockwise, experts_fp8, experts_mx
from mixprec.narrow.linear import Plan, linear_class, replan
from mixprec.narrow.recipe import Granularity


@dataclass(frozen=True)
class ExpertsGemm:
    """One projection of an experts layer (gate_up_proj, down_proj), fixed at conversion."""
    name: str  # the parameter's FQN, as the log and the audit name it
    plan: Plan  # the dense Linear's plan: recipe, tiles, compute dtype; its kernels the grouped route's (below)
    transposed: bool  # weight (E, K, N) (gpt-oss) rather than (E, N, K) (nn.Linear's per expert)
    salts: tuple[int, ...] = ()  # each expert's part of its stochastic-rounding keys (microscaled recipes)
    # the GEMMs on kernels (`uses_grouped`): row- and tensor-wise, forward and input gradient on torch's
    # grouped row-wise kernel (row-wise's weight gradient too); block-wise, all three on mixprec's
    # (mixprec.narrow.experts_blockwise)
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
        """The module computing this projection's passes: mixprec.narrow.experts_fp8 or experts_mx."""
        return experts_mx if self.plan.recipe.granularity is Granularity.MICROSCALED else experts_fp8


_GEMMS: list[ExpertsGemm] = []  # the operators take an index into this registry (an operator takes no plan object)


def register(gemm: ExpertsGemm) -> int:
    """The index an experts projection is known by to the operators."""
    _GEMMS.append(gemm)
    return len(_GEMMS) - 1


def gemm_of(key: int) -> ExpertsGemm:
    return _GEMMS[key]


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


def _no_autocast(device: torch.device):
    """The narrow GEMMs choose their own dtypes: autocast has no say inside (as FP8Linear.forward)."""
    return torch.autocast(device.type, enabled=False) if device.type in ("cpu", "cuda") else contextlib.nullcontext()


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
    from mixprec.narrow.recipe import RECIPES

    recipe = RECIPES["rowwise"]
    plan = Plan(recipe, recipe.tiles, torch.bfloat16, (True, True, True), device=device)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(112, 128, generator=gen).to(device, torch.bfloat16)
    w = torch.randn(4, 256, 128, generator=gen).to(device)
    offs = torch.tensor([48, 48, 95, 112], dtype=torch.int32, device=device)
    dy = torch.randn(112, 256, generator=gen).to(device, torch.bfloat16)

    def passes(grouped):
        g = ExpertsGemm("probe", plan, False, grouped=grouped)
        return (forward(x, w, offs, g), *backward(x, w, offs, dy, g))
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
        return experts_blockwise.route(plan.device) is None
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
               ("fp8.emulate = true" if plan.emulated else experts_blockwise.route(plan.device)))
    return f"the grouped emulation (each GEMM one torch grouped GEMM on the dequantised elements); {casts}{why}"


def _by_output(weight: torch.Tensor, g: ExpertsGemm) -> torch.Tensor:
    """(E, N, K): each expert's weight as an nn.Linear holds it."""
    return weight.transpose(1, 2) if g.transposed else weight


def forward(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, g: ExpertsGemm) -> torch.Tensor:
    """(S, K) -> (S, N) in the plan's compute dtype: every expert as its dense Linear, in grouped passes."""
    with _no_autocast(x.device):
        return g.passes.forward(x, _by_output(weight, g), offs, g)


def backward(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, dy: torch.Tensor,
             g: ExpertsGemm) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx (S, K) in x's dtype, dW in the weight's layout and dtype): every expert's dense backward, grouped."""
    with _no_autocast(x.device):
        dx, dw = g.passes.backward(x, _by_output(weight, g), offs, dy.contiguous(), g)
    return dx, (dw.transpose(1, 2) if g.transposed else dw)


@torch.library.custom_op("mixprec::experts_mm", mutates_args=())
def _experts_mm(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, key: int) -> torch.Tensor:
    return forward(x, weight, offs, gemm_of(key))


@_experts_mm.register_fake
def _(x, weight, offs, key):
    g = gemm_of(key)
    return x.new_empty(x.shape[0], _by_output(weight, g).shape[1], dtype=g.plan.compute_dtype)


@torch.library.custom_op("mixprec::experts_mm_backward", mutates_args=())
def _experts_mm_backward(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, dy: torch.Tensor,
                         key: int) -> tuple[torch.Tensor, torch.Tensor]:
    return backward(x, weight, offs, dy, gemm_of(key))


@_experts_mm_backward.register_fake
def _(x, weight, offs, dy, key):
    return torch.empty_like(x), torch.empty_like(weight)


def _setup_context(ctx, inputs, output):
    x, weight, offs, key = inputs
    ctx.save_for_backward(x, weight, offs)
    ctx.key = key


def _backward(ctx, dy):
    x, weight, offs = ctx.saved_tensors
    dx, dw = torch.ops.mixprec.experts_mm_backward(x, weight, offs, dy, ctx.key)
    return dx, dw, None, None


_experts_mm.register_autograd(_backward, setup_context=_setup_context)


def experts_mm(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, key: int) -> torch.Tensor:
    """The experts projection registered as `key` (`register`) on x (S, K), rows sorted by expert."""
    return torch.ops.mixprec.experts_mm(x, weight, offs, key)


# ---- a projection whose input arrived cast (expert parallelism's FP8 dispatch) --------------------------------
def takes_cast_input(g: ExpertsGemm) -> tuple[tuple[int, int], bool] | None:
    """(tile, power_of_2) of the input cast of a row- or block-wise projection, whose GEMMs take rows cast so
    as they are (one scale per token and K tile: nothing spans two experts); None for the other recipes."""
    r = g.plan.recipe
    if g.passes is not experts_fp8 or r.granularity not in (Granularity.ROWWISE, Granularity.BLOCKWISE):
        return None
    return g.plan.tiles.x, r.power_of_2_scales


def _cast_input(x_data: torch.Tensor, x_scale_inv: torch.Tensor, g: ExpertsGemm):
    from mixprec.narrow.scaling import Quantized, resolve_tile

    return Quantized(x_data, x_scale_inv, resolve_tile(g.plan.tiles.x, x_data.shape))


def experts_mm_cast_input(x: torch.Tensor, x_data: torch.Tensor, x_scale_inv: torch.Tensor, weight: torch.Tensor,
                          offs: torch.Tensor, key: int) -> torch.Tensor:
    """The forward of mixprec::experts_mm_cast_input (also what a narrow-gathered weight runs)."""
    g = gemm_of(key)
    with _no_autocast(x.device):
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
    with _no_autocast(dy.device):
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


# ---- an experts module's forward: the routing around the two projections ---------------------------------------
@dataclass
class ExpertsLayer:
    """An experts module's two projections: in a narrow recipe (operator keys of `register`),
    or on torch's grouped GEMM in the base compute dtype."""
    fqn: str
    up: int | None  # the operator key of gate_up_proj (or up_proj); None: the base mode
    down: int | None
    # the base mode's compute dtype (the recipe's GEMMs write it too); None: autocast's, else the weights'
    dtype: torch.dtype | None

    @property
    def gemms(self) -> tuple[ExpertsGemm, ExpertsGemm]:
        return gemm_of(self.up), gemm_of(self.down)

    @property
    def narrow(self) -> bool:
        return self.up is not None

    def on(self, device: str) -> None:
        """Its projections' GEMM routes chosen again for `device` (mixprec.narrow.linear.replan: said once
        per plan and device), where they were chosen for another."""
        if not self.narrow or device == "meta":
            return
        plans = [replan(g.plan, linear_class(g.plan.recipe), device) for g in self.gemms]
        if all(p is g.plan for p, g in zip(plans, self.gemms)):
            return
        self.up, self.down = (register(ExpertsGemm(g.name, p, g.transposed, g.salts, uses_grouped(p)))
                              for g, p in zip(self.gemms, plans))

    def cast_input(self) -> tuple[tuple[int, int], bool] | None:
        """How rows cast for the up projection (tile, power_of_2) go to its GEMMs as they are (`takes_cast_input`)."""
        return takes_cast_input(gemm_of(self.up)) if self.narrow else None

    def up_cast(self, x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, x_data: torch.Tensor,
                x_scale_inv: torch.Tensor) -> torch.Tensor:
        """The up projection on rows x that arrived cast as `cast_input` says (x_data, x_scale_inv): no cast."""
        return torch.ops.mixprec.experts_mm_cast_input(x, x_data, x_scale_inv, weight, offs, self.up)

    def projections(self, transposed: bool):
        """(up, down): each (x (S, K), weight, offs) -> (S, N)."""
        if self.narrow:
            return (functools.partial(experts_mm, key=k) for k in (self.up, self.down))
        return (functools.partial(base_mm, transposed=transposed, dtype=self.dtype) for _ in range(2))


def base_mm(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, transposed: bool,
            dtype: torch.dtype | None) -> torch.Tensor:
    """x (S, K) @ each expert's weight in `dtype` (None: autocast's where it is on, else the
    weights'), which autocast does not reach: the weights are cast as autocast casts a Linear's.
    bfloat16 on torch's grouped GEMM; other dtypes (torch's grouped GEMM takes bfloat16 only, on
    CUDA and compiled) and torch before 2.8 expert by expert (`mixprec::experts_mm_loop`)."""
    if dtype is None:
        on = torch.is_autocast_enabled(x.device.type)
        dtype = torch.get_autocast_dtype(x.device.type) if on else weight.dtype
    w = weight.to(dtype)
    w = w if transposed else w.transpose(-2, -1)  # (E, K, N)
    grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    with _no_autocast(x.device):
        if grouped_mm is not None and dtype == torch.bfloat16:
            (K, N), x = w.shape[1:], x.to(dtype)
            if K % 8 or N % 8:  # CUDA's grouped GEMM takes rows of 16 bytes: K and N padded with zeros (exact)
                x, w = F.pad(x, (0, -K % 8)), F.pad(w, (0, -N % 8, 0, -K % 8))
            return grouped_mm(x, w, offs=offs)[:, :N]
        return torch.ops.mixprec.experts_mm_loop(x.to(dtype), w, offs)


@torch.library.custom_op("mixprec::experts_mm_loop", mutates_args=())
def _loop_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x (S, K) @ w[e] (E, K, N) for each expert's rows: (S, N), rows past offs[-1] zero."""
    out = x.new_zeros(x.shape[0], w.shape[2])
    for e, (start, end) in enumerate(groups(offs)):
        out[start:end] = x[start:end] @ w[e]
    return out


@_loop_mm.register_fake
def _(x, w, offs):
    return x.new_empty(x.shape[0], w.shape[2])


@torch.library.custom_op("mixprec::experts_mm_loop_backward", mutates_args=())
def _loop_mm_backward(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor,
                      dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dx, dw = torch.zeros_like(x), torch.zeros_like(w)
    for e, (start, end) in enumerate(groups(offs)):
        dx[start:end] = dy[start:end] @ w[e].T
        dw[e] = x[start:end].T @ dy[start:end]
    return dx, dw


@_loop_mm_backward.register_fake
def _(x, w, offs, dy):
    return torch.empty_like(x), torch.empty_like(w)


def _loop_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _loop_backward(ctx, dy):
    return *torch.ops.mixprec.experts_mm_loop_backward(*ctx.saved_tensors, dy), None


_loop_mm.register_autograd(_loop_backward, setup_context=_loop_setup)


def tokens_per_expert(top_k_index: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Rows each expert received from a router's choices (tokens, top_k), on the host (the audit's and
    the planner's figure, never the step's)."""
    return torch.bincount(top_k_index.detach().flatten().cpu(), minlength=n_experts)


def dispatch(top_k_index: torch.Tensor, n_experts: int,
             stable: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A router's choices (tokens, top_k) -> (perm, the sorted expert ids, offs): row r of the
    grouped input is token perm[r] // top_k, each expert's rows ending at offs (int32). stable: each
    expert's rows in token order (mixprec's MoE: what lets an expert-parallel rank, which receives rank
    0's rows then rank 1's, see one process's rows in one process's order); otherwise torch.sort's
    order, as transformers' grouped_mm sorts."""
    expert_ids_g, perm = torch.sort(top_k_index.reshape(-1), stable=stable)  # (S,) = tokens x top_k, by expert
    # each expert's end found in the sorted ids: no bincount (its size depends on the largest id: a read of
    # the device), no histc (CUDA's refuses torch.use_deterministic_algorithms)
    experts = torch.arange(n_experts, device=expert_ids_g.device, dtype=expert_ids_g.dtype)
    offs = torch.searchsorted(expert_ids_g, experts, right=True, out_int32=True)
    return perm, expert_ids_g, offs


def combine(out: torch.Tensor, top_k_weights: torch.Tensor, perm: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The grouped rows out (S, H) weighted and summed back to each token's: (tokens, H) in `dtype`."""
    num_tokens, top_k = top_k_weights.shape
    weighted = out * top_k_weights.reshape(-1)[perm].unsqueeze(-1)  # (S, H)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    # each token's top_k rows summed as grouped_mm sums them (reshape and sum, not index_add_)
    return weighted[inverse].view(num_tokens, top_k, -1).sum(dim=1).to(dtype)
