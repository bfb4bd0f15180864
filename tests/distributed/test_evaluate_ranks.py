"""Validation under torchrun: each rank evaluates its rows of every global batch (issue 55 item
13: each evaluated all of them, dp times the compute and memory), and the loss reported is one
process's."""

import json

import torch

import rank_pool
from gloo_worker import join
from mixprec.data.loader import val_batches
from mixprec.distributed.parallel import end_spawned_worker
from mixprec.precision import Policy
from mixprec.train.trainer import evaluate

WORLD, LOCAL, SEQ = 2, 2, 8
TOKENS = torch.randint(0, 32, (10 * SEQ + 1,), generator=torch.Generator().manual_seed(0))  # 10 windows


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.out = torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32)

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.out(self.emb(x)).flatten(0, 1), y.flatten())


def batches(rank: int | None):
    rows = slice(None) if rank is None else slice(rank * LOCAL, (rank + 1) * LOCAL)
    return val_batches(TOKENS, SEQ, LOCAL * WORLD, 3, rows=rows)  # batches of 4, 4 and 2 windows


def test_each_rank_gets_its_rows_and_a_stand_in_for_an_empty_share():
    whole, ranks = batches(None), [batches(r) for r in range(WORLD)]
    assert [n for _, _, n in whole] == [4, 4, 2]
    assert [[n for _, _, n in b] for b in ranks] == [[2, 2, 2], [2, 2, 0]]
    for i, (x, _, _) in enumerate(whole):
        for r, b in enumerate(ranks):
            mine = x[r * LOCAL:(r + 1) * LOCAL]
            assert torch.equal(b[i][0], mine if len(mine) else x[:1])


def _worker(rank: int, store: str, out: str) -> None:
    join(rank, store, WORLD)
    loss = evaluate(Tiny(), Policy.from_preset("fp32"), batches(rank), WORLD)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(loss, f)
    end_spawned_worker()


def test_two_ranks_report_one_process_s_validation_loss(tmp_path):
    out = tmp_path / "out"
    rank_pool.spawn(_worker, (str(tmp_path / "store"), str(out)), WORLD)
    one = evaluate(Tiny(), Policy.from_preset("fp32"), batches(None))
    for r in range(WORLD):
        assert abs(json.loads(open(f"{out}.{r}").read()) - one) / one < 1e-6
