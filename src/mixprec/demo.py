"""`mixprec demo reduction`: why gradients are reduced in FP32, shown on numbers and
measured on a real two-rank FSDP2 reduction."""

from __future__ import annotations

import json
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mixprec.distributed.parallel import end_spawned_worker
from mixprec.models.llama import build_model, model_args

BF16 = torch.bfloat16


def sequential_sum(values: list[float], dtype: torch.dtype) -> float:
    """Each value rounded to BF16 (the gradients), summed left to right in `dtype`."""
    acc = torch.zeros((), dtype=dtype)
    for v in values:
        acc = acc + torch.tensor(v).to(BF16).to(dtype)
    return acc.item()


def examples() -> list[dict]:
    """Seed 001's examples, computed."""
    cases = {"4 ranks: 1e7, 1, -1e7, 1": [1e7, 1.0, -1e7, 1.0],
             "8 ranks: 1e-4 x 6 with 1e7 and -1e7": [1e-4, 1e-4, 1e7, 1e-4, -1e7, 1e-4, 1e-4, 1e-4]}
    return [{"case": name, "bfloat16": sequential_sum(v, BF16), "float32": sequential_sum(v, torch.float32),
             "exact": float(sum(torch.tensor(x).to(BF16).double() for x in v))} for name, v in cases.items()]


def _model():
    return build_model(model_args("debug", 256, dim=128, n_layers=2, n_heads=4, n_kv_heads=2),
                       device="cpu", storage_dtype=torch.float32, seed=0)


def _batch(ranks: int) -> torch.Tensor:
    return torch.randint(0, 256, (4 * ranks, 65), generator=torch.Generator().manual_seed(0))


def _worker(rank: int, ranks: int, store: str, reduce_name: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dist.init_process_group("gloo", store=dist.FileStore(store, ranks), rank=rank, world_size=ranks)
    model = _model()
    reduce = {"bfloat16": BF16, "float32": torch.float32}[reduce_name]
    # float32 compute: only the reduction's dtype differs from the reference.
    policy = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=reduce)
    mesh = init_device_mesh("cpu", (ranks,))
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    x = _batch(ranks).chunk(ranks)[rank]
    model(x[:, :-1], x[:, 1:]).backward()
    grads = [p.grad.full_tensor() for p in model.parameters()]
    if rank == 0:
        torch.save(grads, out)
    end_spawned_worker()


def measure(ranks: int = 2) -> dict[str, float]:
    """Relative error of the reduced gradients against one FP32 process on the same global
    batch, with FSDP2's reduce_dtype bfloat16 and float32."""
    ref_model = _model()
    x = _batch(ranks)
    ref_model(x[:, :-1], x[:, 1:]).backward()
    ref = [p.grad for p in ref_model.parameters()]
    errors = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("float32", "bfloat16"):
            out, store = os.path.join(tmp, f"{name}.pt"), os.path.join(tmp, f"store-{name}")
            mp.spawn(_worker, args=(ranks, store, name, out), nprocs=ranks, join=True)
            got = torch.load(out)
            num = sum(float((g - r).double().pow(2).sum()) for g, r in zip(got, ref))
            errors[name] = (num / sum(float(r.double().pow(2).sum()) for r in ref)) ** 0.5
    return errors


def run(as_json: bool) -> int:
    report = {"examples": examples(), "fsdp2_two_ranks_relative_error": measure(2)}
    if as_json:
        print(json.dumps(report, indent=2))
        return 0
    print("Summing BF16 gradients in order, as a reduction across ranks does:")
    for e in report["examples"]:
        print(f"  {e['case']:<38} bfloat16 {e['bfloat16']:<12.6g} float32 {e['float32']:<12.6g} exact {e['exact']:.6g}")
    print("\nFSDP2 over 2 CPU ranks, gradients reduce-scattered in reduce_dtype; relative error of the reduced")
    print("gradients against one float32 process on the same global batch:")
    for name, err in report["fsdp2_two_ranks_relative_error"].items():
        print(f"  reduce_dtype {name:<9} {err:.2e}")
    return 0
