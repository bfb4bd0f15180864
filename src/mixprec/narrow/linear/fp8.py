"""The FP8 Linear: an nn.Linear whose three GEMMs (forward, input gradient, weight
gradient) run on scaled FP8 operands.

    y  = x  @ W^T      x (M, K) e4m3,  W (N, K) e4m3             -> compute dtype
    dx = dy @ W        dy (M, N) in the recipe's gradient format  -> compute dtype
    dW = dy^T @ x                                                  -> FP32

Saved for backward: the FP8 input and its scales (half the bytes of a bfloat16 input)
and the weight as the module holds it (alive anyway: the parameter, or FSDP2's
all-gathered copy, which fully_shard gathers again for backward; gathered in FP8 by
mixprec.narrow.fsdp.linear, the copy is read as it is instead of cast). The input's FP8 copy
is cast along K; a recipe whose weight-gradient GEMM scales along M (row- and block-wise)
re-casts it from its dequantised value, as DeepSeek-V3 does with its cached activations.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, replace

import torch
from torch import nn

from mixprec.narrow.formats import blockwise_cast
from mixprec.narrow.formats.gathered import BACKWARD, FORWARD, gathered_copy
from mixprec.narrow.gemm.fp8 import choose_rowwise, route_on, rowwise_after, scaled_mm
from mixprec.narrow.formats.recipe import E4M3, GEMMS, FP8Recipe, Granularity, Tiles
from mixprec.narrow.formats.scaling import DelayedScales, Quantized, amax_to_scale, cast, quantize, resolve_tile, tile_amax

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    """Everything a converted Linear needs to know, fixed at conversion."""
    recipe: FP8Recipe
    tiles: Tiles
    compute_dtype: torch.dtype  # the base mode's matmul dtype: the forward's and dgrad's output
    kernels: tuple[bool, bool, bool]  # forward, dgrad, wgrad: torch's kernel, or the emulation
    device: str = "cpu"  # the device type the kernels were chosen for
    emulated: bool = False  # every GEMM on the emulation because the user asked (fp8.emulate): on any device

    def after(self, gemm: str, weight_shape) -> bool | None:
        """A row-wise GEMM's route on the plan's device (gemm.rowwise_after: as measured at conversion); None
        for the other recipes."""
        if self.recipe.granularity is not Granularity.ROWWISE:
            return None
        return rowwise_after(self.device, gemm, tuple(weight_shape), self.recipe.fast_accum)

    @property
    def blockwise(self) -> bool:
        """Said to the kernel: a weight of one block, or one row of blocks, reads as tensor- or row-wise otherwise."""
        return self.recipe.granularity is Granularity.BLOCKWISE


class _FP8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, plan: Plan, state):
        return _FP8Matmul.gemm(*_FP8Matmul.cast(ctx, x, weight, plan, state), plan)

    @staticmethod
    def gemm(xq: Quantized, wq: Quantized, plan: Plan) -> torch.Tensor:
        """The forward GEMM on `cast`'s operands: (M, K) x (N, K)^T -> (M, N) in the compute dtype."""
        return scaled_mm(xq, wq.t(), plan.compute_dtype, kernel=plan.kernels[0], fast_accum=plan.recipe.fast_accum,
                         blockwise=plan.blockwise, after=plan.after(GEMMS[0], wq.data.shape))

    @staticmethod
    def cast(ctx, x: torch.Tensor, weight: torch.Tensor, plan: Plan, state):
        """The forward GEMM's operands (x (M, K), W (N, K)), with what backward reads saved on ctx
        (an experts layer calls it and `backward` on each expert's slice: mixprec.narrow.experts.ops)."""
        r, t = plan.recipe, plan.tiles
        pow2 = r.power_of_2_scales
        wq = gathered_copy(weight, FORWARD)  # all-gathered in FP8 already (its amax recorded there)
        if r.delayed:
            xq = _delayed_cast(x, state, DelayedScales.INPUT, E4M3)
            wq = wq or _delayed_cast(weight, state, DelayedScales.WEIGHT, E4M3)
        else:
            xq, _ = quantize(x, E4M3, t.x, power_of_2=pow2)
            wq = wq or quantize(weight, E4M3, t.w, power_of_2=pow2)[0]
        ctx.plan, ctx.state, ctx.x_dtype = plan, state, x.dtype
        ctx.save_for_backward(xq.data, xq.scale_inv, weight, wq.data, wq.scale_inv)
        ctx.x_tile, ctx.w_tile = xq.tile, wq.tile
        return xq, wq

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        plan, state = ctx.plan, ctx.state
        r, t = plan.recipe, plan.tiles
        x_data, x_scale_inv, weight, w_data, w_scale_inv = ctx.saved_tensors
        xq, wq = Quantized(x_data, x_scale_inv, ctx.x_tile), Quantized(w_data, w_scale_inv, ctx.w_tile)
        pow2 = r.power_of_2_scales
        dy = dy.contiguous()
        # block-wise on CUDA: dy cast once into both layouts, and x re-cast straight into the
        # layout the weight-gradient GEMM reads (mixprec.narrow.formats.blockwise_cast)
        fused = blockwise_cast.applies(dy, r.grad_dtype, (t.g, t.g_wgrad), pow2)  # never for delayed (tensor-wise)
        gq_w = None
        if r.delayed:
            gq = _delayed_cast(dy, state, DelayedScales.GRAD, r.grad_dtype)
        elif fused:
            gq, gq_w = blockwise_cast.cast_transpose(dy, triton=True)
        else:
            gq, _ = quantize(dy, r.grad_dtype, t.g, power_of_2=pow2)
        if t.w_dgrad:  # W scaled along N: the backward's gathered copy, or a cast of the weight
            wq_d = gathered_copy(weight, BACKWARD) or quantize(weight, E4M3, t.w_dgrad, power_of_2=pow2)[0]
        else:
            wq_d = wq
        dx = scaled_mm(gq, wq_d, plan.compute_dtype, kernel=plan.kernels[1], blockwise=plan.blockwise,
                       after=plan.after(GEMMS[1], weight.shape)).to(ctx.x_dtype)
        return dx, _FP8Matmul.wgrad(ctx, dy, (x_data, x_scale_inv, weight), gq, gq_w, fused), None, None

    @staticmethod
    def wgrad(ctx, dy: torch.Tensor, saved, gq: Quantized | None = None, gq_w: Quantized | None = None,
              fused: bool = False) -> torch.Tensor:
        """The weight-gradient GEMM dy^T (N, M) x (M, K), FP32 sums, in the weight's dtype. saved: the
        input's FP8 data and scales and the weight, as the caller unpacked them (a ctx's saved tensors are
        read once: under activation checkpointing a second read recomputes or fails); gq, gq_w: dy's casts
        along N and along M where backward made them (a current-scaling recipe's made here)."""
        plan = ctx.plan
        r, t = plan.recipe, plan.tiles
        x_data, x_scale_inv, weight = saved
        xq = Quantized(x_data, x_scale_inv, ctx.x_tile)
        pow2 = r.power_of_2_scales
        if gq_w is None:
            if t.g_wgrad:
                gq_w = quantize(dy, r.grad_dtype, t.g_wgrad, power_of_2=pow2)[0]
            else:
                gq_w = gq if gq is not None else quantize(dy, r.grad_dtype, t.g, power_of_2=pow2)[0]
        if fused and blockwise_cast.applies(x_data, E4M3, (ctx.x_tile, t.x_wgrad), pow2):
            xq_w = blockwise_cast.recast_transposed(xq, triton=True)
        else:
            xq_w = quantize(xq.dequantize(), E4M3, t.x_wgrad, power_of_2=pow2)[0] if t.x_wgrad else xq
        return scaled_mm(gq_w.t(), xq_w, torch.float32, kernel=plan.kernels[2], blockwise=plan.blockwise,
                         after=plan.after(GEMMS[2], weight.shape)).to(weight.dtype)


def _delayed_cast(x: torch.Tensor, state, role: int, dtype: torch.dtype):
    """Cast with this step's delayed scale, recording the amax for the next. Before the
    first completed step (scale 0) the tensor is scaled by its own amax."""
    history, pending, scale = state
    tile = resolve_tile((0, 0), x.shape)
    amax = tile_amax(x, tile).reshape(())
    pending[role] = torch.maximum(pending[role], amax)
    current = amax_to_scale(amax, dtype)
    used = torch.where(scale[role] > 0, scale[role], current)
    return cast(x, used.reshape(1, 1), tile, dtype)


class FP8Linear(nn.Linear):
    """An nn.Linear whose matmuls run in FP8 under `plan`. It holds the original
    Parameter objects: the state_dict, the optimizer and FSDP2 see nothing new.
    A recipe class with other numerics subclasses it with its own `matmul` (an autograd
    Function taking (x (M, K), weight, plan, state)) and `routes`, and registers it
    (`register_linear`)."""

    plan: Plan
    matmul = _FP8Matmul

    @staticmethod
    def routes(recipe: FP8Recipe, device: str, compute_dtype: torch.dtype) -> dict[str, str | None]:
        """Each GEMM's route on `device`: None for torch's kernel, else why it is emulated."""
        return {name: route_on(device, a_tile, b_tile, *dtypes)
                for name, (a_tile, b_tile), dtypes in recipe.gemms(compute_dtype)}

    @classmethod
    def from_linear(cls, linear: nn.Linear, plan: Plan, fqn: str = "") -> "FP8Linear":
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias
        new.plan = plan
        new._choose_rowwise()
        new.fp8_enabled = True  # False: taken out of FP8 during a run (a promotion): a plain Linear's matmul
        if plan.recipe.delayed:
            dev, length = linear.weight.device, plan.recipe.amax_history_len
            # not persistent: the policy checkpoints them by module name (mixprec.narrow.convert)
            new.register_buffer("amax_history", torch.zeros(3, length, device=dev), persistent=False)
            new.register_buffer("amax_pending", torch.zeros(3, device=dev), persistent=False)
            new.register_buffer("scale", torch.zeros(3, device=dev), persistent=False)
        return new

    def _apply(self, fn, recurse=True):
        """Moved (.to, .cuda, to_empty): the GEMMs' routes are chosen again for the new device
        (a model converted on the CPU, then moved to a GPU, runs torch's kernels there), and a
        block-wise layer probes its Triton casts on it, outside any step."""
        out = super()._apply(fn, recurse)
        device = self.weight.device.type
        if device != "meta":
            self.plan = replan(self.plan, type(self), device)
            if self.plan.blockwise:
                blockwise_cast.probe(device)
            self._choose_rowwise()
        return out

    def _choose_rowwise(self) -> None:
        """A row-wise layer on CUDA: its GEMMs' routes measured for its weight's shape (gemm.choose_rowwise)."""
        plan = self.plan
        if (plan.device == "cuda" and plan.recipe.granularity is Granularity.ROWWISE and all(plan.kernels)
                and torch.cuda.is_available() and not blockwise_cast.tracing(self.weight)):  # fake: nothing to time
            choose_rowwise(plan.device, plan.recipe, plan.compute_dtype, tuple(self.weight.shape))

    def matmul_state(self):
        """What `matmul` takes besides the plan: delayed scaling's buffers."""
        return (self.amax_history, self.amax_pending, self.scale) if self.plan.recipe.delayed else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fp8_enabled:  # the module object stays (FSDP2 and hooks hold on to it), the GEMM is plain
            return super().forward(x)
        # (..., K) -> (..., N) in the compute dtype; autocast has no say over FP8 GEMMs
        with torch.autocast(x.device.type if x.device.type != "meta" else "cpu", enabled=False):  # meta: tracing (tests)
            out = self.matmul.apply(x.reshape(-1, x.shape[-1]), self.weight, self.plan, self.matmul_state())
            out = out.unflatten(0, x.shape[:-1])
            return out if self.bias is None else out + self.bias.to(out.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8={self.plan.recipe.name}{'' if self.fp8_enabled else ' (off: promoted)'}"


@functools.lru_cache(maxsize=None)
def replan(plan: Plan, cls: type, device: str) -> Plan:
    """`plan` for layers that compute on `device`: the same plan where it was made for it (or
    the user asked for the emulation everywhere), else each GEMM's route probed there; said
    once per plan and device."""
    if plan.device == device or plan.emulated:
        return plan
    routes = cls.routes(plan.recipe, device, plan.compute_dtype)
    new = replace(plan, kernels=tuple(why is None for why in routes.values()), device=device)
    said = ", ".join(f"{g}: " + ("torch's kernel" if why is None else f"emulated, {why}") for g, why in routes.items())
    logger.info("fp8: %s layers converted for %s compute on %s: their GEMMs' routes chosen there (%s)",
                plan.recipe.name, plan.device, device, said)
    return new


def runs_fp8(module: nn.Module) -> bool:
    """Whether `module` computes its GEMMs in FP8 now: an FP8Linear not promoted out of it."""
    return isinstance(module, FP8Linear) and module.fp8_enabled


LINEARS: dict[type, type] = {FP8Recipe: FP8Linear}  # recipe class -> the Linear that runs it


def register_linear(recipe_class: type, linear_class: type) -> None:
    LINEARS[recipe_class] = linear_class


def linear_class(recipe: FP8Recipe) -> type:
    return LINEARS[type(recipe)]
