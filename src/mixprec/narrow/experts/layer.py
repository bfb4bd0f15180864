"""An experts module's forward around its two projections: the routing (dispatch: tokens sorted by expert;
combine: weighted back), the projections in a narrow recipe (mixprec.narrow.experts.ops) or, in the base mode,
on torch's grouped GEMM (a loop of GEMMs where torch's grouped GEMM does not take the dtype)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from mixprec.narrow.experts.ops import ExpertsGemm, Key, experts_mm, groups, no_autocast, register, takes_cast_input
from mixprec.narrow.linear.fp8 import linear_class, replan
from mixprec.narrow.experts.routes import uses_grouped


# ---- an experts module's forward: the routing around the two projections ---------------------------------------
@dataclass
class ExpertsLayer:
    """An experts module's two projections: in a narrow recipe (each an ExpertsGemm, known to the operators
    by its `Key`), or on torch's grouped GEMM in the base compute dtype."""
    fqn: str
    up: ExpertsGemm | None  # gate_up_proj (or up_proj) in the recipe; None: the base mode
    down: ExpertsGemm | None
    # the base mode's compute dtype (the recipe's GEMMs write it too); None: autocast's, else the weights'
    dtype: torch.dtype | None
    device: str = "cpu"  # where the keys' salts are (the layer's weights, `on`)
    keys: tuple[Key, Key] | None = field(init=False, default=None)

    def __post_init__(self):
        if self.narrow:
            self.keys = (register(self.up, self.device), register(self.down, self.device))

    @property
    def gemms(self) -> tuple[ExpertsGemm, ExpertsGemm]:
        return self.up, self.down

    @property
    def narrow(self) -> bool:
        return self.up is not None

    def keep_experts(self, start: int, end: int) -> None:
        """Experts start:end only (expert parallelism's share of a rank): each keeps the salt it has with
        every expert here."""
        if self.narrow and self.up.salts:
            self.up, self.down = (replace(g, salts=g.salts[start:end]) for g in self.gemms)
            self.__post_init__()

    def on(self, device: str) -> None:
        """Its projections' GEMM routes chosen again for `device`'s type (mixprec.narrow.linear.fp8.replan: said
        once per plan and device), where they were chosen for another; its salts moved to `device` ("cuda:1")."""
        kind = torch.device(device).type
        if not self.narrow or kind == "meta":  # salts stay real: a meta copy could not be moved back
            return
        plans = [replan(g.plan, linear_class(g.plan.recipe), kind) for g in self.gemms]
        self.up, self.down = (g if p is g.plan else replace(g, plan=p, grouped=uses_grouped(p))
                              for g, p in zip(self.gemms, plans))
        self.device = device
        self.__post_init__()

    def cast_input(self) -> tuple[tuple[int, int], bool] | None:
        """How rows cast for the up projection (tile, power_of_2) go to its GEMMs as they are (`takes_cast_input`)."""
        return takes_cast_input(self.up) if self.narrow else None

    def up_cast(self, x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, x_data: torch.Tensor,
                x_scale_inv: torch.Tensor) -> torch.Tensor:
        """The up projection on rows x that arrived cast as `cast_input` says (x_data, x_scale_inv): no cast."""
        return torch.ops.mixprec.experts_mm_cast_input(x, x_data, x_scale_inv, weight, offs, self.keys[0].index)

    def projections(self, transposed: bool):
        """(up, down): each (x (S, K), weight, offs) -> (S, N)."""
        if self.narrow:
            return (functools.partial(experts_mm, key=k) for k in self.keys)
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
    with no_autocast(x.device):
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
