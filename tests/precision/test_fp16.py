"""FP16 modes: loss scaling against torch.amp.GradScaler, skipped steps, master
weights, O-levels and the automatic fallback. Tiny models: FP16 has no fast CPU kernel."""

import copy
import math

import pytest
import torch

from mixprec import APEX_LEVELS, LossScaleConfig, Policy, build_model, model_args
from mixprec.precision.presets import FP16, FP32

# Learnable sequences: each token is the previous one plus 3 (mod 64), from random starts.
BATCHES = [(torch.randint(0, 64, (2, 1), generator=torch.Generator().manual_seed(i)) + 3 * torch.arange(17)) % 64
           for i in range(8)]


def tiny(policy, seed=0, device="cpu"):
    model = build_model(model_args("debug", 256), device=device, storage_dtype=FP32, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return policy.setup(model, opt)


def train(policy, model, opt, batches, corrupt=lambda i, model: None):
    losses, applied = [], []
    for i, x in enumerate(batches):
        with policy.autocast():
            loss = model(x[:, :-1], x[:, 1:])
        policy.backward(loss)
        corrupt(i, model)
        applied.append(policy.step(opt, max_norm=1.0).applied)
        losses.append(loss.item())
    return losses, applied


def inf_grad(steps):
    def corrupt(i, model):
        if i in steps:
            model.layers[0].attention.wq.weight.grad[0, 0] = math.inf
    return corrupt


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fp16_mixed_equals_autocast_plus_gradscaler(device):
    """The same recipe written by hand with torch.autocast and torch.amp.GradScaler
    gives the same losses, skipped step and scale (native kernels on both sides)."""
    batches = [x.to(device) for x in BATCHES[:5]]
    policy = Policy.from_preset("fp16-mixed", emulate_matmul=False, loss_scale=LossScaleConfig(growth_interval=3))
    model, opt = tiny(policy, device=device)
    ours, applied = train(policy, model, opt, batches, inf_grad({2}))

    ref = build_model(model_args("debug", 256), device=device, storage_dtype=FP32, seed=0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler(device, growth_interval=3)
    theirs = []
    for i, x in enumerate(batches):
        with torch.autocast(device, dtype=torch.float16):
            loss = ref(x[:, :-1], x[:, 1:])
        scaler.scale(loss).backward()
        inf_grad({2})(i, ref)
        scaler.unscale_(ref_opt)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        scaler.step(ref_opt)
        scaler.update()
        ref_opt.zero_grad(set_to_none=True)
        theirs.append(loss.item())
    assert applied == [True, True, False, True, True]
    assert ours == theirs
    assert policy.summary()["loss_scale"] == scaler.get_scale()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))


@pytest.mark.parametrize("preset", ["fp16-mixed", "fp16-master"])
def test_a_skipped_step_changes_nothing(preset):
    policy = Policy.from_preset(preset, loss_scale=LossScaleConfig(fallback_after=0))
    model, opt = tiny(policy)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (s + 1))
    train(policy, model, opt, BATCHES[:2])
    before = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()),
              copy.deepcopy(policy.model_state_dict(model)))
    with policy.autocast():
        loss = model(BATCHES[2][:, :-1], BATCHES[2][:, 1:])
    policy.backward(loss)
    inf_grad({0})(0, model)
    if policy.step(opt, max_norm=1.0):
        sched.step()
    after = (model.state_dict(), opt.state_dict(), policy.model_state_dict(model))
    for a, b in zip(before[0].values(), after[0].values()):
        assert torch.equal(a, b)
    for a, b in zip(before[2].values(), after[2].values()):
        assert torch.equal(a, b)
    for s0, s1 in zip(before[1]["state"].values(), after[1]["state"].values()):
        assert all(torch.equal(s0[k], s1[k]) for k in s0)  # exp_avg, exp_avg_sq and the step count
    assert sched.last_epoch == 0 + 0 and policy.summary()["skipped_steps"] == 1
    assert policy.summary()["loss_scale"] == 32768.0


def test_fp16_master_keeps_norms_and_masters_in_fp32():
    policy = Policy.from_preset("fp16-master")
    model, opt = tiny(policy)
    for name, p in model.named_parameters():
        assert p.dtype == (FP32 if "norm" in name else FP16), name
    masters = [p for g in opt.param_groups for p in g["params"]]
    assert {p.dtype for p in masters} == {FP32}
    losses, applied = train(policy, model, opt, BATCHES[:4])
    # FP16 gradients of the scaled loss can overflow at the initial 65536: skipped, then fine.
    assert sum(applied) >= 3 and losses[-1] < losses[0]
    assert {t.dtype for s in opt.state.values() for k, t in s.items() if k != "step"} == {FP32}
    full = policy.model_state_dict(model)
    for name, p in model.named_parameters():
        assert full[name].dtype == FP32 and torch.equal(full[name].to(p.dtype), p.detach())


def test_master_weights_keep_updates_fp16_weights_cannot_hold():
    """An update below half an FP16 ulp of the weight vanishes without masters and
    accumulates with them."""
    for preset, moves in (("fp16-true", False), ("fp16-master", True)):
        policy = Policy.from_preset(preset, emulate_matmul=True)
        w = torch.nn.Linear(1, 1, bias=False)
        w.weight.data.fill_(1.0)
        opt = torch.optim.SGD(w.parameters(), lr=1e-4)
        policy.setup(w, opt)
        for _ in range(20):
            with policy.autocast():
                loss = w(torch.ones(1, 1, dtype=w.weight.dtype)).float().sum()
            policy.backward(loss)
            policy.step(opt)
        # fp16 spacing at 1.0 is 2^-10 ~ 1e-3: each 1e-4 step rounds back to 1
        assert (w.weight.item() < 1.0) == moves, preset


def test_apex_levels_have_their_documented_properties():
    for level, props in APEX_LEVELS.items():
        policy = Policy.from_preset(level)
        assert policy.name == props["mode"]
        cast = {None: FP32, "torch.float32": FP32, "torch.float16": FP16}[props["cast_model_type"]]
        assert policy.storage_dtype == cast
        assert policy.master_weights == bool(props["master_weights"])
        assert (policy.loss_scale is not None) == (props["loss_scale"] == "dynamic")
        model, _ = policy.setup(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2)),
                                torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1))
        norm_dtype = model[1].weight.dtype
        if props["keep_batchnorm_fp32"] is not None:
            assert (norm_dtype == FP32) == props["keep_batchnorm_fp32"]


@pytest.mark.parametrize("preset", ["fp16-mixed", "fp16-master"])
def test_fallback_after_persistent_overflow_keeps_training(preset, caplog):
    policy = Policy.from_preset(preset, loss_scale=LossScaleConfig(fallback_after=3, fallback_to="fp32"))
    model, opt = tiny(policy)
    train(policy, model, opt, BATCHES[:2])
    state = {k: v.clone() for k, v in policy.model_state_dict(model).items()}
    train(policy, model, opt, BATCHES[2:5], inf_grad({0, 1, 2}))
    stats = policy.summary()
    assert stats["fallback_triggered"] and stats["fallback_step"] == 5 and stats["precision_final"] == "fp32"
    assert stats["precision"] == preset and "[FALLBACK] step 5" in caplog.text
    assert {p.dtype for p in model.parameters()} == {FP32}
    # The FP32 weights (masters, for fp16-master) carried over unchanged by the skipped steps.
    assert all(torch.equal(p, state[n]) for n, p in model.named_parameters())
    losses, applied = train(policy, model, opt, BATCHES * 2)
    assert all(applied) and all(math.isfinite(v) for v in losses)
    assert sum(losses[-4:]) < sum(losses[:4])


def test_fallback_at_the_minimum_scale():
    policy = Policy.from_preset("fp16-mixed", loss_scale=LossScaleConfig(init_scale=4.0, min_scale=1.0,
                                                                        fallback_after=0, fallback_to="fp32"))
    model, opt = tiny(policy)
    train(policy, model, opt, BATCHES[:4], inf_grad({0, 1, 2, 3}))
    assert policy.summary()["fallback_step"] == 3  # 4 -> 2 -> 1, then an overflow at the minimum


def test_bf16_master_trains_with_fp32_masters_and_no_scaler():
    policy = Policy.from_preset("bf16-master")
    model, opt = tiny(policy)
    assert policy.summary()["loss_scale"] is None and policy.master_weights
    assert {p.dtype for n, p in model.named_parameters() if "norm" not in n} == {torch.bfloat16}
    losses, applied = train(policy, model, opt, BATCHES)
    assert all(applied) and losses[-1] < losses[0]
    assert {t.dtype for s in opt.state.values() for k, t in s.items() if k != "step"} == {FP32}
