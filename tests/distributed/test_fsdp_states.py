"""8-bit optimizer states held by two ranks (DTensor shards of dimension 0, as FSDP2 holds them)
against one process: the same bits, since a block never spans rows; and a DCP round trip of
the sharded state."""

import pytest
import torch

import rank_pool
from gloo_worker import join
from mixprec.distributed.parallel import end_spawned_worker
from mixprec.optim import AdamW

WORLD = 2
FORMATS = ("8bit", "fp8")
SHAPES = [(33, 300), (64, 512), (6, 4096)]  # uneven rows (17 + 16), whole blocks, a short last block


def tensors(step: int):
    gen = torch.Generator().manual_seed(step)
    return [torch.randn(shape, generator=gen) for shape in SHAPES]


def train(params, fmt: str, compile: bool, grads_of) -> AdamW:
    opt = AdamW(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, states=fmt, compile=compile)
    for step in range(1, 4):
        for p, g in zip(params, grads_of(step)):
            p.grad = g
        opt.found_inf, opt.grad_scale = torch.zeros(()), None
        opt.step()
    return opt


def gather_rows(t):
    """A DTensor sharded by rows, whole, through all_gather_object (gloo has no FP8 collectives, pickle no FP8)."""
    import torch.distributed as dist

    if not hasattr(t, "to_local"):
        return t
    parts = [None] * WORLD
    local = t.to_local()
    dist.all_gather_object(parts, local.view(torch.uint8) if local.dtype.itemsize == 1 else local)  # FP8 as bytes
    return torch.cat(parts).view(local.dtype)


def _worker(rank: int, store: str, compile: bool, out: str, folder: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    join(rank, store, WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    results = {fmt: _formats_run(rank, mesh, fmt, compile, f"{folder}-{fmt}") for fmt in FORMATS}
    if rank == 0:
        torch.save(results, out)
    end_spawned_worker()


def _formats_run(rank: int, mesh, fmt: str, compile: bool, folder: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import Shard, distribute_tensor

    shard = lambda t: distribute_tensor(t, mesh, [Shard(0)])
    params = [torch.nn.Parameter(shard(t)) for t in tensors(0)]
    opt = train(params, fmt, compile, lambda step: [shard(g) for g in tensors(step)])
    full = [{k: gather_rows(v) for k, v in opt.state[p].items()} for p in params]
    weights = [p.full_tensor() for p in params]
    # DCP: save the sharded state, load it into a fresh optimizer, the same bits
    dcp.save({"optimizer": opt.state_dict()}, checkpoint_id=folder)
    fresh = AdamW(params, lr=0.0, states=fmt, compile=compile)
    for p in params:
        p.grad = torch.zeros_like(p)
    fresh.step()  # state to load into, as DCP's helpers make it (a step at lr 0)
    loaded = {"optimizer": fresh.state_dict()}
    dcp.load(loaded, checkpoint_id=folder)
    fresh.load_state_dict(loaded["optimizer"])
    same = all(torch.equal(gather_rows(fresh.state[p][k]).view(torch.uint8), gather_rows(opt.state[p][k]).view(torch.uint8))
               for p in params for k in opt.state[p] if torch.is_tensor(opt.state[p][k]) and k != "step")
    return {"states": full, "weights": weights, "dcp_same": same,
            "placements": str(opt.state[params[0]]["exp_avg_absmax"].placements)}


@pytest.mark.slow  # its ranks compile (cold: 60 s on two cores)
def test_two_ranks_hold_the_bits_one_process_holds(tmp_path):
    out = tmp_path / "out.pt"
    rank_pool.spawn(_worker, (str(tmp_path / "store"), True, str(out), str(tmp_path / "dcp")), WORLD)
    results = torch.load(out, weights_only=False)
    for fmt in FORMATS:
        params = [torch.nn.Parameter(t) for t in tensors(0)]
        one, two = train(params, fmt, True, tensors), results[fmt]
        assert two["placements"] == "(Shard(dim=0),)"  # the block scales are sharded as their rows
        for p, state, weight in zip(params, two["states"], two["weights"]):
            assert torch.equal(weight, p.detach())
            for key, value in one.state[p].items():
                if torch.is_tensor(value) and key != "step":
                    assert torch.equal(state[key].view(torch.uint8), value.view(torch.uint8)), (fmt, key)
        assert two["dcp_same"], fmt
