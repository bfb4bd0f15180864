"""Two gloo ranks: each scenario trained with FSDP2 gathering the FP8/microscaled weights in
bfloat16 (quantised after the gather) and in their own format; losses, final weights, the
bytes of every collective and the log lines, written to a JSON file (tests/distributed/test_lowp_gather.py)."""

import json
import os
import tempfile

import torch
import torch.distributed as dist

import rank_pool
from gloo_worker import join
from mixprec import Policy, build_model, model_args
from mixprec.distributed import apply_fsdp
from mixprec.distributed.comm_bytes import CommBytes
from mixprec.distributed.parallel import end_spawned_worker

WORLD = 2
BATCHES = [(torch.randint(0, 64, (4, 1), generator=torch.Generator().manual_seed(i)) + 3 * torch.arange(33)) % 64
           for i in range(8)]
SHAPES = {"debug": {}, "aligned": dict(dim=256, n_kv_heads=4, multiple_of=256)}  # aligned: 128-row shards


def train(rank, preset, lowp, *, shape="debug", steps=8, recompute=False, promote_at=None, revert_at=None,
          compile=False, save=None, load=None, overrides=(), flavor="debug", promoted="layers.0.attention.wq"):
    from torch.distributed.device_mesh import init_device_mesh

    policy = Policy.from_preset(preset, overrides=overrides)
    model = build_model(model_args(flavor, 256, **SHAPES[shape]), device="cpu", storage_dtype=torch.float32, seed=0)
    policy.prepare_model(model, "cpu")
    for block in model.layers:
        block.checkpointed = recompute
        if compile:
            block.forward = torch.compile(block.forward)
    apply_fsdp(model, init_device_mesh("cpu", (WORLD,)), policy, lowp_all_gather=lowp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    policy.setup(model, opt)
    first = 0
    if load is not None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optimizer": optim_sd}
        dcp.load(state, checkpoint_id=load)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        first = 4
    losses, gathered = [], []
    for i in range(first, steps):
        if i == promote_at:
            policy.promote(promoted, i, "test")
        if i == revert_at:
            policy.unpromote(promoted)
        comm = CommBytes()
        with comm:
            local = BATCHES[i].chunk(WORLD)[rank]
            with policy.autocast():
                loss = model(local[:, :-1], local[:, 1:])
            policy.backward(loss)
        policy.step(opt, max_norm=1.0)
        losses.append(loss.item())
        gathered.append(comm.bytes["all_gather"])
        if save is not None and i == 3:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            model_sd, optim_sd = get_state_dict(model, opt)
            dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=save)
    weights = {n: p.full_tensor() for n, p in model.named_parameters()}
    return {"losses": losses, "gathered": gathered}, weights


def audited(rank, preset, own_fully_shard: bool) -> dict:
    """mixprec.audit of one step; own_fully_shard: the blocks wrapped by torch's fully_shard directly (the
    silent bfloat16 fallback), else by mixprec's apply_fsdp."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from mixprec import audit, format_audit

    policy = Policy.from_preset(preset)
    model = build_model(model_args("debug", 256), device="cpu", storage_dtype=torch.float32, seed=0)
    policy.prepare_model(model, "cpu")
    mesh = init_device_mesh("cpu", (WORLD,))
    if own_fully_shard:
        mp_policy = policy.fsdp_mixed_precision()
        for block in model.layers:
            fully_shard(block, mesh=mesh, mp_policy=mp_policy)
        fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    else:
        apply_fsdp(model, mesh, policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    policy.setup(model, opt)
    batches = [(b.chunk(WORLD)[rank][:, :-1], b.chunk(WORLD)[rank][:, 1:]) for b in BATCHES[:2]]
    report = audit(model, policy, opt, batches)
    return {"ok": report["ok"], "text": format_audit(report)}


def compare(rank, name, off, on, out):
    """off, on: (record, weights); a resumed run (on) has the last steps only."""
    (a, wa), (b, wb) = off, on
    same = all(torch.equal(wa[n], wb[n]) for n in wa)
    n = len(b["losses"])
    out[name] = {"off": {k: v[-n:] for k, v in a.items()}, "on": b, "weights_equal": same}


def _worker(rank, store_path, path):
    messages = join(rank, store_path, WORLD)
    out = {}
    tmp = tempfile.mkdtemp() if rank == 0 else None
    box = [tmp]
    dist.broadcast_object_list(box)
    tmp = box[0]
    if True:
        for preset in ("fp8-tensorwise", "fp8-delayed", "fp8-rowwise", "mxfp8", "nvfp4", "mxfp4"):
            compare(rank, preset, train(rank, preset, False), train(rank, preset, True), out)
        compare(rank, "fp8-blockwise aligned", train(rank, "fp8-blockwise", False, shape="aligned"),
                train(rank, "fp8-blockwise", True, shape="aligned"), out)
        mixed = ("layers.1.feed_forward.*=mxfp8", "layers.0.attention.wq=fp8-tensorwise", "layers.1.attention.wo=bfloat16")
        compare(rank, "per-layer", train(rank, "fp8-rowwise", False, overrides=mixed),
                train(rank, "fp8-rowwise", True, overrides=mixed), out)
        for preset in ("fp8-tensorwise", "fp8-rowwise"):
            compare(rank, f"{preset} recompute", train(rank, preset, False, steps=4, recompute=True),
                    train(rank, preset, True, steps=4, recompute=True), out)
        compare(rank, "promote", train(rank, "fp8-rowwise", False, steps=7, promote_at=3, revert_at=5),
                train(rank, "fp8-rowwise", True, steps=7, promote_at=3, revert_at=5), out)
        # DCP: written with narrow gathers, resumed with them off and on
        ckpt = os.path.join(tmp, "dcp")
        whole = train(rank, "fp8-rowwise", True, save=ckpt)
        compare(rank, "resume off", whole, train(rank, "fp8-rowwise", False, load=ckpt), out)
        compare(rank, "resume on", whole, train(rank, "fp8-rowwise", True, load=ckpt), out)
        for preset in ("fp8-tensorwise", "fp8-rowwise"):  # eager against compiled blocks, both gathering narrow
            compare(rank, f"{preset} compiled", train(rank, preset, True, steps=4),
                    train(rank, preset, True, steps=4, compile=True), out)
        # mixprec's MoE: each rank casts its own whole experts (8 experts, 4 a rank)
        for preset in ("fp8-tensorwise", "fp8-rowwise", "fp8-blockwise", "mxfp8", "nvfp4", "mxfp4"):
            compare(rank, f"moe {preset}", train(rank, preset, False, flavor="moe-debug", steps=4),
                    train(rank, preset, True, flavor="moe-debug", steps=4), out)
        experts = "layers.0.feed_forward.experts"
        compare(rank, "moe promote", train(rank, "fp8-rowwise", False, flavor="moe-debug", steps=7, promote_at=3,
                                           revert_at=5, promoted=experts),
                train(rank, "fp8-rowwise", True, flavor="moe-debug", steps=7, promote_at=3, revert_at=5,
                      promoted=experts), out)
        from torch._dynamo.utils import counters

        eager = train(rank, "fp8-rowwise", True, flavor="moe-debug", steps=4)
        counters.clear()
        compare(rank, "moe fp8-rowwise compiled", eager,
                train(rank, "fp8-rowwise", True, flavor="moe-debug", steps=4, compile=True), out)
        out["moe fp8-rowwise compiled"]["graph_breaks"] = sum(counters["graph_break"].values())
        out["audit ok"] = audited(rank, "fp8-rowwise", own_fully_shard=False)
        out["audit silent"] = audited(rank, "fp8-rowwise", own_fully_shard=True)
        if rank == 0:
            out["log"] = messages
            with open(path, "w") as f:
                json.dump(out, f)
    end_spawned_worker()


def run(path: str) -> None:
    with tempfile.TemporaryDirectory() as d:
        rank_pool.spawn(_worker, (os.path.join(d, "store"), path), WORLD)
