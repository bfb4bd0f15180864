"""A step whose gradients are not all finite is never applied, in any mode: before a
loss scaler's fallback, after it, and in modes that never had a scaler."""

import copy
import math

import pytest
import torch

from mixprec import LossScaleConfig, Policy, build_model, model_args
from mixprec.precision.presets import FP32, PRESETS

X = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))


def setup(preset, **scaling):
    policy = Policy.from_preset(preset, loss_scale=LossScaleConfig(**scaling) if scaling else None)
    model = build_model(model_args("debug", 256), device="cpu", storage_dtype=FP32, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)  # 1e-8 is 0 in float16 (fp16-true)
    model, opt = policy.setup(model, opt)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (s + 1))
    return policy, model, opt, sched


def step(policy, model, opt, sched, bad=None):
    with policy.autocast():
        loss = model(X[:, :-1], X[:, 1:])
    policy.backward(loss)
    if bad is not None:
        model.layers[1].feed_forward.w2.weight.grad[0, 0] = bad
    applied = policy.step(opt, max_norm=1.0).applied
    if applied:
        sched.step()
    return applied


def snapshot(policy, model, opt, sched):
    return copy.deepcopy((policy.model_state_dict(model), opt.state_dict(), sched.state_dict()))


def same(a, b):
    if torch.is_tensor(a):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("bad", [math.inf, math.nan])
@pytest.mark.parametrize("preset", list(PRESETS))
def test_a_non_finite_gradient_is_never_applied(preset, bad):
    policy, model, opt, sched = setup(preset)
    assert step(policy, model, opt, sched)
    before = snapshot(policy, model, opt, sched)
    assert not step(policy, model, opt, sched, bad)
    assert same(snapshot(policy, model, opt, sched), before)  # weights, masters, Adam state and step, schedule
    assert policy.summary()["skipped_steps"] == 1
    assert step(policy, model, opt, sched)  # and training goes on
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("preset", ["fp16-mixed", "fp16-master"])
def test_after_a_fallback_too(preset):
    # one overflow at the minimum scale falls back to fp32: from then on no scaler guards the step
    policy, model, opt, sched = setup(preset, init_scale=1.0, min_scale=1.0, fallback_to="fp32")
    assert not step(policy, model, opt, sched, math.inf)
    assert policy.summary()["precision_final"] == "fp32" and policy.summary()["loss_scale"] is None
    assert step(policy, model, opt, sched)
    before = snapshot(policy, model, opt, sched)
    for bad in (math.nan, math.inf):
        assert not step(policy, model, opt, sched, bad)
        assert same(snapshot(policy, model, opt, sched), before)
    stats = policy.summary()
    assert stats["skipped_steps"] == 3 and stats["nonfinite_steps"] == 2 and stats["overflow_count"] == 1
