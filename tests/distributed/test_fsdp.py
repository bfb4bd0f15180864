"""FSDP2 and tensor parallel through the precision policy: two CPU processes (gloo)
against one process."""

import json
import math

import pytest
import torch
import torch.distributed as dist

import rank_pool
from gloo_worker import join
from mixprec import Policy, build_model, model_args
from mixprec.distributed import apply_fsdp
from mixprec.distributed.parallel import end_spawned_worker
from mixprec.distributed.tensor_parallel import apply_tensor_parallel

WORLD = 2
BATCHES = [(torch.randint(0, 64, (4, 1), generator=torch.Generator().manual_seed(i)) + 3 * torch.arange(33)) % 64
           for i in range(4)]


def fresh_model():
    return build_model(model_args("debug", 256), device="cpu", storage_dtype=torch.float32, seed=0)


def single_process_losses(preset: str) -> list[float]:
    policy = Policy.from_preset(preset)
    model = fresh_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    policy.setup(model, opt)
    losses = []
    for x in BATCHES:
        with policy.autocast():
            loss = model(x[:, :-1], x[:, 1:])
        policy.backward(loss)
        policy.step(opt, max_norm=1.0)
        losses.append(loss.item())
    return losses


def _worker(rank: int, store_path: str, preset: str, out: str, layout: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    messages = join(rank, store_path, WORLD)
    policy = Policy.from_preset(preset)
    mesh = init_device_mesh("cpu", (WORLD,))
    if layout == "fsdp":
        model = apply_fsdp(fresh_model(), mesh, policy)
    else:  # tensor parallel: every rank sees the whole batch and holds half of each projection
        model = apply_tensor_parallel(fresh_model(), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4 if preset == "fp16-true" else 1e-8, foreach=False)
    policy.setup(model, opt)
    seen = {}
    model.layers[0].feed_forward.w1.register_forward_hook(lambda m, i, o: seen.update(linear_out=str(o.dtype)))
    losses, grads = [], set()
    for x in BATCHES:
        # FSDP: equal shares, so the mean of the ranks' means is the global mean
        local = x.chunk(WORLD)[rank] if layout == "fsdp" else x
        with policy.autocast():
            loss = model(local[:, :-1], local[:, 1:])
        policy.backward(loss)
        grads |= {str(p.grad.dtype) for p in model.parameters()}
        policy.step(opt, max_norm=1.0)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / WORLD)
    p = model.layers[0].attention.wq.weight
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"losses": losses, "param_type": type(p).__name__, "param_dtype": str(p.dtype),
                       "local_rows": p.to_local().shape[0], "grads": sorted(grads),
                       "states": sorted({str(t.dtype) for s in opt.state.values() for k, t in s.items()
                                         if k != "step"}),
                       "autocast": policy.uses_autocast, "log": messages, **seen}, f)
    end_spawned_worker()


def run_fsdp(tmp_path, preset: str, layout: str = "fsdp") -> dict:
    out = tmp_path / "out.json"
    rank_pool.spawn(_worker, (str(tmp_path / "store"), preset, str(out), layout), WORLD)
    return json.loads(out.read_text())


def test_fsdp_fp32_matches_one_process(tmp_path):
    got = run_fsdp(tmp_path, "fp32")
    for a, b in zip(got["losses"], single_process_losses("fp32")):
        assert abs(a - b) / b < 1e-5
    assert got["param_type"] == "DTensor" and got["local_rows"] == 64 // WORLD


def test_fsdp_bf16_mixed_dtypes_on_the_real_objects(tmp_path):
    got = run_fsdp(tmp_path, "bf16-mixed")
    assert got["param_dtype"] == "torch.float32"  # sharded parameters
    assert got["linear_out"] == "torch.bfloat16"  # computed with all-gathered BF16 parameters
    assert got["grads"] == ["torch.float32"]  # reduce-scattered in reduce_dtype float32
    assert got["states"] == ["torch.float32"]
    assert got["autocast"] is False  # never autocast on top of fully_shard's casts
    assert any(m.startswith("Mixed precision training is handled by fully_shard") for m in got["log"])
    ref = single_process_losses("bf16-mixed")
    for a, b in zip(got["losses"], ref):
        assert abs(a - b) / b < 2e-2  # BF16 compute in both, different casts: close, not equal


def test_fsdp_bf16_true_keeps_everything_in_bf16(tmp_path):
    got = run_fsdp(tmp_path, "bf16-true")
    assert got["param_dtype"] == "torch.bfloat16" and got["linear_out"] == "torch.bfloat16"
    assert got["grads"] == ["torch.bfloat16"] and got["states"] == ["torch.bfloat16"]
    assert got["losses"][-1] < got["losses"][0]


def test_tensor_parallel_fp32_matches_one_process(tmp_path):
    got = run_fsdp(tmp_path, "fp32", "tp")
    for a, b in zip(got["losses"], single_process_losses("fp32")):
        assert abs(a - b) / b < 1e-5
    assert got["param_type"] == "DTensor" and got["local_rows"] == 64 // WORLD  # column-wise: half the rows


def test_tensor_parallel_without_fsdp_still_computes_in_bf16(tmp_path):
    # No fully_shard to cast: autocast over the DTensor model does it, never silent FP32.
    got = run_fsdp(tmp_path, "bf16-mixed", "tp")
    assert got["param_dtype"] == "torch.float32" and got["linear_out"] == "torch.bfloat16"
    assert got["grads"] == ["torch.float32"] and got["states"] == ["torch.float32"]
    assert got["autocast"] is True
    for a, b in zip(got["losses"], single_process_losses("bf16-mixed")):
        # row-wise partial products are rounded to BF16 and all-reduced in BF16: close, not equal
        assert abs(a - b) / b < 2e-2


@pytest.mark.parametrize("preset, sharded, gathered", [
    ("fp16-true", "torch.float16", "torch.float16"),
    ("bf16-master", "torch.float32", "torch.bfloat16"),  # the sharded FP32 parameters are the master weights
])
def test_fsdp_low_precision_storage_and_master_modes(tmp_path, preset, sharded, gathered):
    got = run_fsdp(tmp_path, preset)
    assert got["param_dtype"] == sharded and got["linear_out"] == gathered
    assert got["grads"] == [sharded] and got["states"] == [sharded]
    assert got["autocast"] is False
    assert all(math.isfinite(x) for x in got["losses"])
    first = single_process_losses(preset)[0]
    assert abs(got["losses"][0] - first) / first < 1e-2
    if preset == "bf16-master":
        assert any("(they are the master weights)" in m for m in got["log"])
        # the same computation as bf16-mixed under FSDP2: fully_shard casts, FP32 steps
        (tmp_path / "mixed").mkdir()
        assert got["losses"] == run_fsdp(tmp_path / "mixed", "bf16-mixed")["losses"]


def _overflow_worker(rank: int, store_path: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD)
    policy = Policy.from_preset("fp16-mixed")
    model = apply_fsdp(fresh_model(), init_device_mesh("cpu", (WORLD,)), policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    policy.setup(model, opt)
    applied, scales = [], []
    for i, x in enumerate(BATCHES):
        local = x.chunk(WORLD)[rank]
        with policy.autocast():
            loss = model(local[:, :-1], local[:, 1:])
        policy.backward(loss)
        if i == 1 and rank == 1:  # an overflow in rank 1's gradient shard only
            model.layers[0].attention.wq.weight.grad.to_local()[0, 0] = float("inf")
        applied.append(policy.step(opt, max_norm=1.0).applied)
        scales.append(policy.summary()["loss_scale"])
    weights = model.layers[0].attention.wq.weight.full_tensor()
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"applied": applied, "scales": scales, "checksum": float(weights.double().sum())}, f)
    end_spawned_worker()


def test_fp16_mixed_overflow_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    out = tmp_path / "out"
    rank_pool.spawn(_overflow_worker, (str(tmp_path / "store"), str(out)), WORLD)
    ranks = [json.loads((tmp_path / f"out.{r}").read_text()) for r in range(WORLD)]
    assert ranks[0]["applied"] == ranks[1]["applied"] == [True, False, True, True]
    assert ranks[0]["scales"] == ranks[1]["scales"] == [65536.0, 32768.0, 32768.0, 32768.0]
    assert ranks[0]["checksum"] == ranks[1]["checksum"]
