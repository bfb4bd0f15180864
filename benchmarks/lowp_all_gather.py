"""Bytes on the wire and unsharded weight memory of FSDP2's all-gathers: FP8 and microscaled
weights gathered in bfloat16 (quantised after the gather: parallelism.lowp_all_gather =
false) against gathered in their own format, per recipe, on gloo ranks (CPU).

    python benchmarks/lowp_all_gather.py                  # debug and small flavors, 1 and 2 ranks
    python benchmarks/lowp_all_gather.py --flavors small --ranks 2 --out table.json

Per step (the second; the first allocates): the bytes of every all-gather's output (each
rank's shards together: what a rank holds after it; a ring sends and receives (n-1)/n of it)
counted at torch's c10d operators (mixprec.distributed.comm_bytes); the bytes of the largest
transformer block all-gathered (FSDP2's buffers); and the peak of the bytes FSDP2 holds in
all-gathered parameters, sampled at every operator of the step (on gloo FSDP2 holds one unit
at a time; on a GPU it prefetches the next, so `mixprec memory` plans two blocks). The "FP8
layers" column counts the low-precision Linear weights only; the step's, every gather, the
embeddings and the bfloat16 output layer included. `mixprec memory` plans the step's gathers
and the block (planned/measured beside them). Bytes do not depend on the CPU: no timing here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

RECIPES = ("fp8-tensorwise", "fp8-delayed", "fp8-rowwise", "fp8-blockwise", "mxfp8", "nvfp4", "mxfp4")


def measure(rank: int, world: int, flavor: str, preset: str, lowp: bool) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.utils._python_dispatch import TorchDispatchMode

    from mixprec import Policy, build_model, model_args
    from mixprec.distributed import apply_fsdp
    from mixprec.distributed.comm_bytes import CommBytes
    from mixprec.distributed.fsdp import unsharded_bytes
    from mixprec.narrow.linear.fp8 import FP8Linear

    policy = Policy.from_preset(preset)
    model = build_model(model_args(flavor, 256), device="cpu", storage_dtype=torch.float32, seed=0)
    policy.prepare_model(model, "cpu")
    apply_fsdp(model, init_device_mesh("cpu", (world,)), policy, lowp_all_gather=lowp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    policy.setup(model, opt)
    tokens = torch.randint(0, 256, (world, 65), generator=torch.Generator().manual_seed(0))[rank:rank + 1]

    class Peak(TorchDispatchMode):
        peak = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            Peak.peak = max(Peak.peak, unsharded_bytes(model))
            return out

    record = {}
    for step in range(2):
        comm, peak = CommBytes(), Peak()
        with comm, peak:
            with policy.autocast():
                loss = model(tokens[:, :-1], tokens[:, 1:])
            policy.backward(loss)
        policy.step(opt, max_norm=1.0)
        record = {"all_gather": comm.bytes["all_gather"], "peak_unsharded": Peak.peak}
    # the FP8 layers' share: one gather of each is the FSDPParam's buffers; the step gathers each twice
    # (forward, and backward after the reshard)
    from mixprec.narrow.fsdp.linear import fsdp_params

    per_gather, units = 0, {}
    for unit, _, p in fsdp_params(model):
        size = sum(t.numel() * t.element_size() for t in p.all_gather_outputs)
        units[unit] = units.get(unit, 0) + size
        if p._module_info.param_name == "weight" and isinstance(p._module_info.module, FP8Linear):
            per_gather += size
    record["fp8_layers"] = 2 * per_gather
    record["block"] = max(units[b] for b in model.layers)  # the largest transformer block, all-gathered
    return record


def worker(rank: int, world: int, store: str, flavors: list[str], out: str) -> None:
    import logging

    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    logging.getLogger("mixprec").setLevel(logging.WARNING)
    rows = []
    for flavor in flavors:
        for preset in RECIPES:
            wide, narrow = (measure(rank, world, flavor, preset, lowp) for lowp in (False, True))
            rows.append({"flavor": flavor, "ranks": world, "preset": preset, "bf16": wide, "narrow": narrow})
            if rank == 0:
                print(f"  {flavor} {world} rank(s) {preset}: done", file=sys.stderr, flush=True)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


def planned(flavor: str, preset: str, world: int, lowp: bool) -> dict:
    from mixprec.analysis.memory import Setup, plan
    from mixprec.models.llama import model_args

    p = plan(Setup(model_args(flavor, 256), preset, batch=1, seq_len=64, dp_shard=world, lowp_all_gather=lowp))
    frac = (world - 1) / world
    return {"all_gather": p["communication_bytes"]["all_gather"] / frac if world > 1 else None,
            "block": p["bytes"]["unsharded_parameters"] / 2 if world > 1 else None}  # the block and the prefetched


def main() -> None:
    import torch.multiprocessing as mp

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--flavors", nargs="+", default=["debug", "small"])
    ap.add_argument("--ranks", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    rows = []
    for world in args.ranks:
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "rows.json")
            mp.spawn(worker, args=(world, os.path.join(d, "store"), args.flavors, path), nprocs=world)
            with open(path) as f:
                rows += json.load(f)
    print("| flavor | ranks | recipe | FP8 layers' gathers per step, bf16 -> narrow | all the step's gathers "
          "| largest block unsharded | peak unsharded (gloo) | planned/measured: gathers, block |")
    print("|---|---|---|---|---|---|---|---|")

    def mib(a: dict, b: dict, k: str) -> str:
        if not a[k]:
            return "no all-gather (one rank)"
        return f"{a[k] / 2**20:.2f} -> {b[k] / 2**20:.2f} MiB ({b[k] / a[k]:.3f}x)"

    for r in rows:
        a, b = r["bf16"], r["narrow"]
        p = r["planned"] = planned(r["flavor"], r["preset"], r["ranks"], True)
        plan_ratio = "-" if p["all_gather"] is None else (f"{p['all_gather'] / b['all_gather']:.3f}, "
                                                          f"{p['block'] / b['block']:.3f}")
        print(f"| {r['flavor']} | {r['ranks']} | {r['preset']} | {mib(a, b, 'fp8_layers')} | {mib(a, b, 'all_gather')} "
              f"| {mib(a, b, 'block')} | {mib(a, b, 'peak_unsharded')} | {plan_ratio} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)  # with the planned figures


if __name__ == "__main__":
    main()
