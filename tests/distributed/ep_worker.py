"""gloo ranks, each running moe-debug's first MoE layer's routed experts expert-parallel on its
share of a batch, against the same layer whole on the whole batch in the same process: outputs,
input gradients and each expert's weight gradients, per preset and dispatch; the bytes of the
all-to-alls; the worst imbalance. Written to a JSON file (tests/distributed/test_expert_parallel.py)."""

import copy
import json
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gloo_worker import join
from mixprec import Policy, build_model, model_args
from mixprec.distributed.comm_bytes import CommBytes
from mixprec.distributed.expert_parallel import apply_expert_parallel
from mixprec.distributed.parallel import ParallelDims, end_spawned_worker

TOKENS = 12  # a rank's tokens


def case(rank: int, world: int, preset: str, dispatch: str = "base", skew: bool = False,
         dtype=torch.float32) -> dict:
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
    with CommBytes() as comm:
        got = experts(part, index[mine], weights[mine])
        forward = list(comm.log)
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
            "a2a_bytes": comm.bytes["all_to_all"], "a2a_calls": comm.calls["all_to_all"]}


CASES = {  # name: (preset, dispatch, skew, dtype)
    "fp32": ("fp32", "base", False, torch.float32),
    "fp32 skew": ("fp32", "base", True, torch.float32),
    "bf16 base": ("bf16-mixed", "base", False, torch.bfloat16),
    "bf16 fp8": ("bf16-mixed", "fp8", False, torch.bfloat16),
    "fp32 fp8": ("fp32", "fp8", False, torch.float32),
    **{recipe: (recipe, "base", False, torch.float32) for recipe in
       ("fp8-tensorwise", "fp8-rowwise", "fp8-blockwise", "mxfp8", "nvfp4", "mxfp4")},
}


def worker(rank: int, world: int, store: str, out: str) -> None:
    join(rank, store, world)
    results = {name: case(rank, world, *args) for name, args in CASES.items()}
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    end_spawned_worker()


def run(out: str, store: str, world: int) -> None:
    mp.spawn(worker, args=(world, store, out), nprocs=world, join=True)


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2], int(sys.argv[3]))
