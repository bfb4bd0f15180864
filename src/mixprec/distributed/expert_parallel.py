"""Expert parallelism: a mixture of experts' routed experts spread over the ranks of an
expert-parallel group, the tokens moved to them and back by torch.distributed's all-to-all
(TorchTitan's `ExpertParallel`, Megatron-Core's "alltoall" dispatcher).

    check(n_experts, dims, "moe-debug flavor")      # one line for a layout that cannot work
    apply_expert_parallel(model, mesh, "fp8")       # before activation checkpointing, compile, FSDP2

Layout (ParallelDims.mesh): the world is a (dp_mod_ep, ep) mesh; an expert-parallel group
is `ep` consecutive ranks, each holding E / ep whole experts (its experts' weights a DTensor
sharded along the experts over "ep": global shape (E, ...), so checkpoints hold every expert
and DCP reshards them to any degree); the ranks at the same place of the other groups shard
those experts' weights again with FSDP2 over "dp_mod_ep" (TorchTitan's layout). Everything
else is FSDP2-sharded over all ranks, which all take different data.

An MoE layer's pass on a rank (N local tokens, k experts each, S = N k routed rows):
1. the router's choices grouped by expert (`experts.dispatch`, on the device);
2. each expert's row count sent to the rank that owns it (an all-to-all of E integers), then
   the send and receive sizes read on the host: **one host read per MoE layer and step**
   (activation checkpointing's recompute replays the forward's dispatch and combine, recorded
   in the forward: no exchange, no read, no all-to-all again; the backward reads nothing);
3. the rows sent by one all-to-all with uneven splits (`expert_dispatch` "fp8": e4m3 bytes with
   their float32 scales, cast as a row- or block-wise up projection casts its input, whose GEMMs
   then take them as they arrived (mixprec::experts_mm_cast_input: no second cast, one process's
   bits); for the other recipes and the base mode, a power-of-two scale per token and
   128-element block, dequantised on arrival and cast again by the experts);
4. the received rows regrouped by local expert (a stable sort: each expert sees rank 0's rows,
   then rank 1's, ..., as one process sees the global batch) and run through the experts'
   grouped GEMMs in the layer's recipe, per-expert scales as without expert parallelism;
5. the outputs sent back by the reverse all-to-all (in their own dtype) and combined.
The backward runs the two all-to-alls in reverse with the forward's sizes.

Gradients: an expert's gradient on its rank sums the losses of every rank of its group (the
all-to-all's backward brings them): it is divided by the group's ranks in the backward, and
FSDP2 over dp_mod_ep averages across the groups, so every gradient is the mean over all
ranks' losses, as FSDP2 gives the other weights and one process gives all. (FSDP2's own
divide factor would say it in one place, but it reduces with PREMUL_SUM, which gloo lacks.)

Compiled blocks: the count exchange with its host read, and each all-to-all, run outside the
graph (`torch.compiler.disable`): two graph breaks per MoE layer (dispatch, combine); the
grouped GEMMs between them stay in the graph.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import logging

import torch
import torch.distributed as dist
from torch import nn

from mixprec.errors import UserError
from mixprec.narrow.experts import layer as grouped
from mixprec.narrow.formats.recipe import E4M3
from mixprec.narrow.formats.scaling import quantize

logger = logging.getLogger(__name__)

DISPATCH_BLOCK = 128  # elements a dispatch scale covers along the model dim (DeepSeek-V3's 1x128 tiles)
# inside an activation-checkpointed region: ("record" or "replay", the region's recorded dispatches)
_RECOMPUTE: contextvars.ContextVar = contextvars.ContextVar("mixprec_expert_parallel_recompute", default=None)


@contextlib.contextmanager
def _recompute_mode(mode: str, recorded: collections.deque):
    token = _RECOMPUTE.set((mode, recorded))
    try:
        yield
    finally:
        _RECOMPUTE.reset(token)


def check(n_experts: int, dims, model: str) -> None:
    """One line for an expert-parallel degree that cannot place `model`'s experts."""
    if not dims.ep_enabled:
        return
    ep = dims.ep
    if not n_experts:
        raise UserError(f"parallelism.expert_parallel_degree {ep}: the {model} has no experts (a dense model); "
                        "accepted: 1, or a mixture-of-experts flavor (moe-debug, moe-small, moe-16B)")
    if n_experts % ep:
        raise UserError(f"parallelism.expert_parallel_degree {ep} does not divide the {model}'s {n_experts} "
                        f"experts; accepted: a divisor of {n_experts} that divides data_parallel_shard_degree "
                        f"{dims.dp_shard}")
    local, shards = n_experts // ep, dims.dp_shard // ep
    if local % shards:
        raise UserError(f"parallelism.expert_parallel_degree {ep} on {dims.world_size} ranks: each rank's {local} "
                        f"experts do not split evenly over the {shards} ranks that shard them with FSDP2; accepted: "
                        f"a degree ep with n_experts / ep a multiple of {dims.dp_shard} / ep")


def apply_expert_parallel(model: nn.Module, mesh, dispatch: str = "base", worst_load: bool = False) -> int:
    """Spread every MoE layer's routed experts over mesh["ep"]; returns the number of layers. worst_load:
    the memory plan's layers (`ExpertParallel`), which route every rank's rows to this rank."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from mixprec.models.moe import moe_layers

    ep_mesh = mesh["ep"]
    group, degree, rank = ep_mesh.get_group(), ep_mesh.size(), ep_mesh.get_local_rank()
    layers = moe_layers(model)
    for layer in layers:
        experts = layer.experts
        local = experts.num_experts // degree
        for name in ("gate_up_proj", "down_proj"):
            p = getattr(experts, name)  # every rank built the same weights: each keeps its own experts, no copy
            setattr(experts, name, nn.Parameter(distribute_tensor(p.data, ep_mesh, [Shard(0)], src_data_rank=None),
                                                requires_grad=p.requires_grad))
        experts.mixprec_experts.keep_experts(rank * local, (rank + 1) * local)
        experts.ep = ExpertParallel(group, degree, local, dispatch, worst_load)
    if layers and not worst_load:
        how = "the activations' dtype"
        if dispatch == "fp8":
            direct = layers[0].experts.mixprec_experts.cast_input()
            how = ("e4m3 cast as the experts' recipe casts its input, taken by their GEMMs as it arrives" if direct
                   else "e4m3 with a power-of-two scale per token and 128-element block, cast again by the experts "
                   "(only row- and block-wise experts take the dispatched bytes as they are)")
        logger.info("parallelism: expert parallel over %d ranks: each holds %d of the %d experts of %d MoE layers; "
                    "tokens dispatched by all-to-all in %s, combined in the activations' dtype; the experts' weights "
                    "FSDP2-sharded over the %d ranks outside each group", degree, local,
                    layers[0].experts.num_experts, len(layers), how, mesh["dp_mod_ep"].size())
    return len(layers)


class ExpertParallel:
    """One MoE layer's dispatch and combine over an expert-parallel group. worst_load (the memory plan, on fake
    tensors, whose counts have no values): every rank sends all its rows to this rank's first expert, the most
    rows a rank can receive (no token is dropped: ep x its own), with no count exchange and no host read."""

    def __init__(self, group, degree: int, local: int, dispatch: str, worst_load: bool = False):
        self.group, self.degree, self.local, self.fp8 = group, degree, local, dispatch == "fp8"
        self.worst_load = worst_load

    @staticmethod
    def recompute_contexts():
        """torch.utils.checkpoint's context_fn for a region holding expert-parallel layers: the forward records
        each layer's dispatch and combine (the rows received, the outputs returned, the sizes), the recompute
        replays them in order instead of exchanging counts, reading them on the host and sending the rows again
        (what it recomputes is the experts' GEMMs, as without expert parallelism)."""
        recorded = collections.deque()
        return _recompute_mode("record", recorded), _recompute_mode("replay", recorded)

    def forward(self, experts: nn.Module, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The routed experts of tokens x (N, D) chosen by `index`, `weights` (N, k) -> (N, D)."""
        perm, _, offs = grouped.dispatch(index, experts.num_experts, stable=True)
        rows = x[perm // index.shape[1]]  # (S, D), grouped by expert, so by the rank that owns it
        # FP8: cast as the up projection casts its input where its GEMMs take such rows as they are
        # (row- and block-wise), else per token and 128-element block with power-of-two scales
        takes = experts.mixprec_experts.cast_input()
        cast = (takes or ((1, DISPATCH_BLOCK), True)) if self.fp8 else None
        received, data, order, local_offs, sizes = self.send(rows, offs, cast)
        # (E / ep, ...): this rank's experts, their gradients divided by the group's ranks (above)
        up, down = (_GradScale.apply(getattr(experts, n).to_local(), self.degree) for n in ("gate_up_proj",
                                                                                             "down_proj"))
        direct = tuple(t[order] for t in data) if data is not None and takes is not None else None
        out = experts.run(received[order], up, down, local_offs, direct)  # (R, D), grouped by local expert
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        out = self.receive(out[back], sizes)  # (S, D), in `rows`' order
        return grouped.combine(out, weights, perm, x.dtype)

    @torch.compiler.disable
    def send(self, rows: torch.Tensor, offs: torch.Tensor, cast: tuple | None):
        """rows (S, D) grouped by expert, offs (E,) their ends, cast: None (sent in their dtype) or the FP8 cast's
        (tile, power_of_2) -> (the rows this rank's experts received (R, D), with FP8 their (data, scale_inv) else
        None, the order grouping them by local expert, its experts' row ends (E / ep,) int32, the split sizes).
        In a checkpointed region's recompute, the forward's, as recorded (`recompute_contexts`)."""
        return _recorded(lambda: self._send(rows, offs, cast), lambda r: (_again(r[0], rows), *r[1:]))

    @torch.compiler.disable
    def receive(self, out: torch.Tensor, sizes) -> torch.Tensor:
        """The experts' outputs back to the ranks their rows came from: (S, D) in the activations' dtype (in a
        checkpointed region's recompute, the forward's, as recorded)."""
        send, recv = sizes
        return _recorded(lambda: _all_to_all(out, send, recv, self.group), lambda r: _again(r, out))

    def _send(self, rows: torch.Tensor, offs: torch.Tensor, cast: tuple | None):
        counts = torch.diff(offs, prepend=offs.new_zeros(1))  # (E,) rows for each expert from this rank
        got = torch.empty_like(counts)
        if self.worst_load:
            S = rows.shape[0]
            got = got.new_tensor([[S] + [0] * (self.local - 1)] * self.degree)
            send, recv = [S] + [0] * (self.degree - 1), [S] * self.degree
        else:
            dist.all_to_all_single(got, counts, group=self.group)  # block j: rank j's rows for each of my experts
            got = got.view(self.degree, self.local)
            sizes = torch.cat([counts.view(self.degree, self.local).sum(1), got.sum(1)]).tolist()  # the host read
            send, recv = sizes[:self.degree], sizes[self.degree:]
        if cast is None:
            received, data = _all_to_all(rows, recv, send, self.group), None
        else:
            received, *data = _FP8AllToAll.apply(rows, recv, send, self.group, *cast)
        expert = torch.arange(self.local, device=rows.device).repeat(self.degree)
        expert = expert.repeat_interleave(got.flatten(), output_size=sum(recv))  # (R,) each row's local expert
        order = torch.sort(expert, stable=True).indices
        return received, data, order, torch.cumsum(got.sum(0), 0, dtype=torch.int32), (send, recv)


def _recorded(communicate, replayed):
    """communicate(), recorded in a checkpointed region's forward; in its recompute, the forward's result, in order,
    through replayed (no exchange, no host read)."""
    mode, recorded = _RECOMPUTE.get() or (None, None)
    if mode == "replay":
        return replayed(recorded.popleft())
    result = communicate()
    if mode == "record":
        recorded.append(result)
    return result


def _again(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A recorded tensor in the recompute: its values, needing a gradient as `like` does (the recompute's graph
    ends where the communication was: what it saves is what the forward saved)."""
    return t.detach().requires_grad_(like.requires_grad)


class _GradScale(torch.autograd.Function):
    """The identity, its gradient divided by `ranks` (exact where it is a power of two)."""

    @staticmethod
    def forward(ctx, w, ranks: int):
        ctx.ranks = ranks
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        return grad / ctx.ranks, None


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """torch.distributed's functional all-to-all with uneven splits, differentiable (its backward sends back
    by the reverse), as TorchTitan's dispatch calls it."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    return wait_tensor(all_to_all_single_autograd(x.contiguous(), out_splits, in_splits, group))


def quantize_rows(x: torch.Tensor, tile: tuple[int, int] = (1, DISPATCH_BLOCK),
                  power_of_2: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """x (S, D) -> (e4m3 (S, D), float32 scale_inv (S, D / tile's columns)): a scale per token and tile (0
    columns: the whole row); with power-of-two scales the dequantised values are exact in bfloat16 as in float32."""
    if not x.shape[0]:
        columns = 1 if not tile[1] else -(-x.shape[1] // tile[1])
        return x.new_empty(x.shape, dtype=E4M3), x.new_empty(0, columns, dtype=torch.float32)
    q, _ = quantize(x, E4M3, tile, power_of_2=power_of_2)
    return q.data, q.scale_inv


def dequantize_rows(data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype,
                    tile: tuple[int, int] = (1, DISPATCH_BLOCK)) -> torch.Tensor:
    from mixprec.narrow.formats.scaling import Quantized, resolve_tile

    if not data.shape[0]:
        return data.new_empty(data.shape, dtype=dtype)
    return Quantized(data, scale_inv, resolve_tile(tile, data.shape)).dequantize().to(dtype)


class _FP8AllToAll(torch.autograd.Function):
    """The dispatch in FP8: each row's e4m3 bytes and its scales in one byte buffer, one all-to-all. Returns the
    rows dequantised in x's dtype, and the e4m3 data and scales as they arrived (not differentiable); the
    gradient goes back in its own dtype (the cast passes it straight through, as a recipe's casts do)."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, tile, power_of_2):
        ctx.sizes, ctx.group = (in_splits, out_splits), group
        data, scale_inv = quantize_rows(x, tile, power_of_2)
        D = x.shape[1]
        packed = torch.cat([data.view(torch.uint8), scale_inv.view(torch.uint8)], dim=1)  # (S, D + 4 x tiles)
        out = packed.new_empty(sum(out_splits), packed.shape[1])
        dist.all_to_all_single(out, packed, out_splits, in_splits, group=group)
        data, scale_inv = out[:, :D].view(E4M3), out[:, D:].contiguous().view(torch.float32)
        ctx.mark_non_differentiable(data, scale_inv)
        return dequantize_rows(data, scale_inv, x.dtype, tile), data, scale_inv

    @staticmethod
    def backward(ctx, grad, *_):
        (out_splits, in_splits), group = ctx.sizes, ctx.group
        back = grad.new_empty(sum(out_splits), grad.shape[1])
        dist.all_to_all_single(back, grad.contiguous(), out_splits, in_splits, group=group)
        return back, None, None, None, None, None
