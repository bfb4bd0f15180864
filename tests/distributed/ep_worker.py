"""gloo ranks, each running moe-debug's first MoE layer's routed experts expert-parallel on its
share of a batch, against the same layer whole on the whole batch in the same process: outputs,
input gradients and each expert's weight gradients, per preset and dispatch; the bytes of the
all-to-alls; the worst imbalance. Written to a JSON file (tests/distributed/test_expert_parallel.py)."""

import copy
import json

import torch
import torch.distributed as dist

import rank_pool
from gloo_worker import join
from mixprec import Policy, build_model, model_args
from mixprec.distributed.comm_bytes import CommBytes
from mixprec.distributed.expert_parallel import apply_expert_parallel
from mixprec.distributed.parallel import ParallelDims, end_spawned_worker

TOKENS = 12  # a rank's tokens


class HostReads:
    """Counts the reads of tensor values into Python (tolist, item) while it is entered."""

    def __enter__(self):
        self.count, self.saved = 0, (torch.Tensor.tolist, torch.Tensor.item)

        def counted(method):
            def read(t, *args):
                self.count += 1
                return method(t, *args)
            return read

        torch.Tensor.tolist, torch.Tensor.item = (counted(m) for m in self.saved)
        return self

    def __exit__(self, *exc):
        torch.Tensor.tolist, torch.Tensor.item = self.saved


def case(rank: int, world: int, preset: str, dispatch: str = "base", skew: bool = False,
         dtype=torch.float32, how: str = "eager") -> dict:
    policy = Policy.from_preset(preset)
    model = build_model(model_args("moe-debug", 256), device="cpu", storage_dtype=torch.float32, seed=0)
    policy.prepare_model(model, "cpu")
    reference = copy.deepcopy(model.layers[0].feed_forward)
    apply_expert_parallel(model, ParallelDims(1, world, 1, world, world).mesh("cpu"), dispatch)
    experts = model.layers[0].feed_forward.experts
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(world * TOKENS, 64, generator=gen).to(dtype)
    grad_out = torch.randn(world * TOKENS, 64, generator=gen)
    with torch.no_grad():
        weights, index = reference.router(x.float())
    if skew:  # every token to experts 0 and 1: rank 0 receives every row, the others none
        index = torch.stack([torch.zeros_like(index[:, 0]), torch.ones_like(index[:, 0])], 1)
    mine = slice(rank * TOKENS, (rank + 1) * TOKENS)
    whole = x.clone().requires_grad_()
    want = reference.experts(whole, index, weights)
    (want.float() * grad_out).sum().backward()
    part = x[mine].clone().requires_grad_()
    layer, extra = experts, {}
    if how == "compiled":
        explained = torch._dynamo.explain(experts)(part, index[mine], weights[mine])
        extra = {"graphs": explained.graph_count, "breaks": explained.graph_break_count,
                 "reasons": sorted({r.reason.splitlines()[0][:120] for r in explained.break_reasons})}
        torch._dynamo.reset()
        layer = torch.compile(experts)
    elif how == "checkpointed":  # as a checkpointed block runs it (mixprec.models.llama.TransformerBlock)
        def layer(*inputs):
            return torch.utils.checkpoint.checkpoint(experts, *inputs, use_reentrant=False,
                                                     context_fn=experts.ep.recompute_contexts)
    with CommBytes() as comm, HostReads() as reads:
        got = layer(part, index[mine], weights[mine])
        forward, forward_reads = list(comm.log), reads.count
        (got.float() * grad_out[mine]).sum().backward()
    local = experts.num_experts // world
    experts_here = slice(rank * local, (rank + 1) * local)

    def diff(a, b):
        return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0

    def rel(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))

    # each rank's expert gradient is divided by the group's ranks: times world, the whole layer's
    grads = [(getattr(experts, n).grad.to_local() * world, getattr(reference.experts, n).grad[experts_here])
             for n in ("gate_up_proj", "down_proj")]
    return {"out": diff(got, want[mine]), "out_rel": rel(got, want[mine]), "dx": diff(part.grad, whole.grad[mine]),
            "dw": max(diff(a, b) for a, b in grads), "dw_rel": max(rel(a, b) for a, b in grads),
            "forward_a2a": [size for kind, size in forward if kind == "all_to_all"],
            "a2a_bytes": comm.bytes["all_to_all"], "a2a_calls": comm.calls["all_to_all"],
            "host_reads": [forward_reads, reads.count - forward_reads], **extra}


CASES = {  # name: (preset, dispatch, skew, dtype, how)
    "fp32": ("fp32", "base", False, torch.float32),
    "fp32 checkpointed": ("fp32", "base", False, torch.float32, "checkpointed"),
    "fp8-rowwise fp8 checkpointed": ("fp8-rowwise", "fp8", False, torch.bfloat16, "checkpointed"),
    "fp32 compiled": ("fp32", "base", False, torch.float32, "compiled"),
    "fp8-rowwise compiled": ("fp8-rowwise", "base", False, torch.float32, "compiled"),
    "fp32 skew": ("fp32", "base", True, torch.float32),
    "bf16 base": ("bf16-mixed", "base", False, torch.bfloat16),
    "bf16 fp8": ("bf16-mixed", "fp8", False, torch.bfloat16),
    "fp32 fp8": ("fp32", "fp8", False, torch.float32),
    **{recipe: (recipe, "base", False, torch.float32) for recipe in
       ("fp8-tensorwise", "fp8-rowwise", "fp8-blockwise", "mxfp8", "nvfp4", "mxfp4")},
    **{f"{recipe} skew": (recipe, "base", True, torch.float32) for recipe in ("fp8-rowwise", "fp8-blockwise", "nvfp4")},
    # FP8 dispatch: row- and block-wise experts take the rows as they arrived, the others cast them again
    **{f"{recipe} fp8": (recipe, "fp8", False, torch.bfloat16) for recipe in
       ("fp8-rowwise", "fp8-blockwise", "fp8-tensorwise", "mxfp8")},
    "fp8-blockwise fp8 compiled": ("fp8-blockwise", "fp8", False, torch.bfloat16, "compiled"),
}


def worst_load_peak(rank: int, world: int, preset: str, batch: int, seq_len: int) -> int:
    """Rank 0's MemTracker peak of a steady training step of moe-debug, ep = world, every token routed to
    experts 0 and 1 (rank 0's): the most rows a rank can receive (`mixprec memory --ep` plans this)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from mixprec.distributed.fsdp import apply_fsdp
    from mixprec.models.moe import moe_layers

    policy = Policy.from_preset(preset)
    model = build_model(model_args("moe-debug", 256), device="cpu", storage_dtype=policy.storage_dtype, seed=0)
    policy.prepare_model(model, "cpu")
    mesh = ParallelDims(1, world, 1, world, world).mesh("cpu")
    apply_expert_parallel(model, mesh)
    apply_fsdp(model, ParallelDims.dp_mesh(mesh), policy, experts_mesh=mesh["dp_mod_ep"])
    for layer in moe_layers(model):
        layer.router.bias[:2] = 1e4
    _, opt = policy.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=False, foreach=False))
    x = torch.randint(0, 256, (batch, seq_len + 1), generator=torch.Generator().manual_seed(rank))

    def step():
        with policy.autocast():
            loss = model(x[:, :-1], x[:, 1:])
        policy.backward(loss)
        policy.step(opt, 1.0)

    step()
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        step()
    return next(v["Total"] for k, v in tracker.get_tracker_snapshot("peak").items() if k.type == "cpu")


PEAKS = [("fp32", 8, 64), ("bf16-mixed", 8, 64), ("fp8-rowwise", 8, 64)]


def worker(rank: int, world: int, store: str, out: str) -> None:
    join(rank, store, world)
    results = {name: case(rank, world, *args) for name, args in CASES.items()}
    results["peaks"] = [worst_load_peak(rank, world, *args) for args in PEAKS]
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    end_spawned_worker()


def run(out: str, store: str, world: int) -> None:
    rank_pool.spawn(worker, (world, store, out), world)
