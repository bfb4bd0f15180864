"""The mixture-of-experts feed-forward of mixprec's decoder, DeepSeek-V3's design: routed
experts (each a SwiGLU) chosen top-k per token by a router, plus shared experts every token
goes through; no token is dropped.

Shapes: N tokens (B * T), D model dim, E routed experts, k experts per token, I an expert's
hidden size, S = N * k routed rows.

Precision by role (mixprec.precision.layout recognises each by its place, not its class):
- the router (`Router`, one weight row per expert) keeps FP32 weights and computes its logits
  and scores in FP32 in every preset: a score that rounds the same for two experts decides
  the routing, and DeepSeek-V3 keeps its gating in higher precision;
- the routed experts (`Experts`, weights (E, 2I, D) and (E, D, I), transformers' grouped
  layout) run their GEMMs through mixprec.narrow.experts.ops: the preset's narrow recipe per
  expert, or torch's grouped GEMM in the base compute dtype;
- the shared experts are a plain SwiGLU of nn.Linear layers, converted as any Linear.

Balancing (`ModelArgs.balance`):
- "bias", DeepSeek-V3's auxiliary-loss-free balancing: the top-k are chosen on score + a
  per-expert bias, the weights taken from the scores alone; after each optimizer step the
  bias moves by `balance_rate` towards the under-loaded experts (`update_balance`), outside
  the gradient;
- "aux", the standard auxiliary loss (Switch Transformer's, over the micro-batch):
  aux_loss_coeff * E * sum_e f_e * P_e, f_e the share of routed rows expert e received and
  P_e its mean normalised score, added to the training loss (as transformers' MoE models add
  theirs); evaluation reports the language-model loss alone.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from mixprec.narrow.experts import layer as grouped


class Router(nn.Module):
    """tokens (N, D) -> (weights (N, k) FP32, expert ids (N, k)): sigmoid scores of FP32 logits,
    the top-k chosen on score + bias, their scores normalised to sum to one, times route_scale."""

    def __init__(self, dim: int, n_experts: int, top_k: int, route_scale: float, balance: str, rate: float):
        super().__init__()
        self.top_k, self.route_scale, self.balance, self.rate = top_k, route_scale, balance, rate
        self.weight = nn.Parameter(torch.empty(n_experts, dim))
        # FP32 whatever the model's storage dtype: a bias step of 1e-3 on a score near 1 is lost in bfloat16
        self.register_buffer("bias", torch.zeros(n_experts, dtype=torch.float32))
        # rows routed to each expert since the last update_balance (training passes only)
        self.register_buffer("tokens", torch.zeros(n_experts, dtype=torch.float32), persistent=False)
        self.aux_loss: torch.Tensor | None = None  # the last training pass's, under balance "aux"

    def reset(self) -> None:
        """No bias, nothing counted (buffers a model built on the meta device left empty)."""
        self.bias.zero_()
        self.tokens.zero_()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight).float()  # (N, E); the layout runs this module in FP32
        scores = logits.sigmoid()
        index = torch.topk(scores + self.bias, self.top_k, dim=-1, sorted=False).indices  # (N, k)
        weights = scores.gather(1, index)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.route_scale
        if torch.is_grad_enabled():
            # activation checkpointing recomputes the forward and counts it twice: the update
            # and the load figure depend on the counts' ratios only
            chosen = index.flatten()
            counts = torch.zeros_like(self.tokens).index_add_(0, chosen, torch.ones_like(chosen, dtype=torch.float32))
            with torch.no_grad():
                self.tokens.add_(counts)
            if self.balance == "aux":
                n_experts = scores.shape[1]
                share = counts / index.numel()  # f_e: the share of routed rows
                prob = (scores / scores.sum(dim=-1, keepdim=True)).mean(0)  # P_e
                self.aux_loss = n_experts * (share * prob).sum()
        return weights, index


class Experts(nn.Module):
    """The routed experts: x (N, D), the router's choices -> (N, D). Each expert is a SwiGLU
    whose gate and up projections are stacked in gate_up_proj (E, 2I, D), gate first, and
    whose down projection is down_proj (E, D, I), as transformers' MoE models hold them."""

    mixprec_seam = True  # mixprec.narrow.experts.hf: this module runs its ExpertsLayer itself
    has_gate, is_transposed, has_bias = True, False, False

    def __init__(self, dim: int, hidden: int, n_experts: int, top_k: int):
        super().__init__()
        self.num_experts, self.top_k = n_experts, top_k
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * hidden, dim))
        self.down_proj = nn.Parameter(torch.empty(n_experts, dim, hidden))
        # the precision policy sets this (a narrow recipe, or the base mode's dtype); unset: autocast's dtype
        self.mixprec_experts = grouped.ExpertsLayer("", None, None, None)
        # expert parallelism (mixprec.distributed.expert_parallel): this rank's share of the experts, the
        # tokens moved to them and back by all-to-all; None: every expert here
        self.ep = None

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.ep is not None:
            return self.ep.forward(self, x, index, weights)
        perm, _, offs = grouped.dispatch(index, self.num_experts, stable=True)
        rows = x[perm // index.shape[1]]  # (S, D), grouped by expert
        out = self.run(rows, self.gate_up_proj, self.down_proj, offs)
        return grouped.combine(out, weights, perm, x.dtype)

    def run(self, rows: torch.Tensor, gate_up: torch.Tensor, down_proj: torch.Tensor, offs: torch.Tensor,
            cast: tuple[torch.Tensor, torch.Tensor] | None = None):
        """rows (S, D) grouped by expert, each expert's ending at offs -> (S, D): the SwiGLU of each expert.
        cast: the rows as they arrived in FP8 (data, scale_inv), cast as the up projection casts its input."""
        up, down = self.mixprec_experts.projections(transposed=False)
        if cast is not None:
            up = functools.partial(self.mixprec_experts.up_cast, x_data=cast[0], x_scale_inv=cast[1])
        gate, value = up(rows, gate_up, offs=offs).chunk(2, dim=-1)  # (S, I) each
        return down(F.silu(gate) * value, down_proj, offs)  # (S, D)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # (..., D) -> (..., F) -> (..., D)


class MoE(nn.Module):
    """(B, T, D) -> (B, T, D): the routed experts' weighted sum plus the shared experts."""

    def __init__(self, args):
        super().__init__()
        self.router = Router(args.dim, args.n_experts, args.top_k, args.route_scale, args.balance, args.balance_rate)
        self.experts = Experts(args.dim, args.moe_hidden_dim, args.n_experts, args.top_k)
        self.shared = SwiGLU(args.dim, args.moe_hidden_dim * args.n_shared_experts) if args.n_shared_experts else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.flatten(0, 1)  # (N, D)
        weights, index = self.router(flat)
        out = self.experts(flat, index, weights).view_as(x)
        return out + self.shared(x) if self.shared is not None else out


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def aux_loss(layers: list[MoE], coeff: float) -> torch.Tensor | None:
    """The auxiliary balancing loss of the last training pass, summed over the MoE layers (None: none)."""
    losses = [m.router.aux_loss for m in layers if m.router.aux_loss is not None]
    clear_counts(layers, counts=False)
    return coeff * torch.stack(losses).sum() if losses else None


@torch.no_grad()
def update_balance(layers: list[MoE]) -> torch.Tensor | None:
    """After an optimizer step: move each router's bias towards its under-loaded experts (DeepSeek-V3:
    bias_e += rate * sign(mean load - load_e), centred to keep the scores' level), the loads summed over
    every rank's tokens so that ranks keep equal biases; clear the counts. Returns, on the device,
    (the worst layer's max / mean rows per expert, the biases' min, their max); None for a dense model."""
    if not layers:
        return None
    tokens = torch.stack([m.router.tokens for m in layers])  # (L, E)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(tokens)
    mean = tokens.mean(dim=1, keepdim=True)
    load = (tokens.amax(dim=1) / mean.squeeze(1).clamp(min=1e-9)).amax()
    for m, t, avg in zip(layers, tokens, mean):
        if m.router.balance == "bias":
            delta = m.router.rate * torch.sign(avg - t)
            m.router.bias.add_(delta - delta.mean())
        m.router.tokens.zero_()
    biases = torch.stack([m.router.bias for m in layers])
    return torch.stack([load, biases.min(), biases.max()])


def clear_counts(layers: list[MoE], counts: bool = True) -> None:
    """Forget the rows routed since the last update (passes that were not a training step's), and the last
    pass's auxiliary losses (counts False: those only)."""
    for m in layers:
        if counts:
            m.router.tokens.zero_()
        m.router.aux_loss = None
