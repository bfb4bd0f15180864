"""A framework's loop (Lightning, the Hugging Face Trainer) on two ranks: the non-finite repair
decides on every rank together (issue 55 item 12: it promoted a layer on the rank that saw the
NaN only, and the ranks then computed in different formats)."""

import json

import torch
from torch.nn.parallel import DistributedDataParallel

import rank_pool
from gloo_worker import join
from mixprec.distributed.parallel import end_spawned_worker
from mixprec.precision import Policy
from mixprec.stability.framework import FrameworkSteps

WORLD = 2


def _worker(rank: int, store: str, out: str) -> None:
    join(rank, store, WORLD)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 64))
    policy = Policy.from_preset("fp8-rowwise")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    policy.setup(model, opt)
    ddp = DistributedDataParallel(model)
    steps = FrameworkSteps(policy, read_every=1)
    steps.model = model
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(rank))
    if rank == 1:  # a NaN out of layer 2 on rank 1's batch only
        model[2].register_forward_hook(lambda m, a, out: out * float("nan"))

    def rerun():  # the step's forward and backward (DDP reduces the gradients: every rank sees the NaN)
        with policy.autocast():
            loss = ddp(x).float().square().mean()
        policy.backward(loss)

    rerun()
    steps.step(opt, rerun=rerun)
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"incidents": steps.incidents, "narrow": [n for n in ("0", "2", "4") if policy.narrow(n)]}, f)
    end_spawned_worker()


def test_every_rank_promotes_the_layer_one_rank_located(tmp_path):
    out = tmp_path / "out"
    rank_pool.spawn(_worker, (str(tmp_path / "store"), str(out)), WORLD)
    ranks = [json.loads(open(f"{out}.{r}").read()) for r in range(WORLD)]
    for got in ranks:
        (incident,) = got["incidents"]
        assert incident["finding"]["module"] == "2" and incident["finding"]["rank"] == 1, incident
        assert incident["action"].startswith("skipped; 2 promoted to"), incident
        assert "2" not in got["narrow"] and "0" in got["narrow"]
