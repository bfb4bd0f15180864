"""LossScaler against torch.amp.GradScaler, including PyTorch's own documented cases."""

import math
import random

import pytest
import torch

from mixprec import UserError
from mixprec.precision.loss_scaling import LossScaleConfig, LossScaler

UNBOUNDED = dict(min_scale=0.0, max_scale=math.inf)


def drive(scaler, overflows, param=None, opt=None):
    """One backward per entry of `overflows` (True: an inf gradient); the scale after each update."""
    param = param if param is not None else torch.nn.Parameter(torch.ones(3))
    opt = opt if opt is not None else torch.optim.SGD([param], lr=0.0)
    scales = []
    for overflow in overflows:
        scaler.scale(param.sum()).backward()
        if overflow:
            param.grad[1] = math.inf
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return scales


@pytest.mark.parametrize("seed", range(5))
def test_scale_trajectory_equals_gradscaler(seed):
    rng = random.Random(seed)
    overflows = [rng.random() < 0.3 for _ in range(60)]
    kw = dict(init_scale=2.0**rng.randint(2, 20), growth_factor=rng.choice([2.0, 1.5, 4.0]),
              backoff_factor=rng.choice([0.5, 0.25]), growth_interval=rng.randint(1, 4))
    ref = drive(torch.amp.GradScaler("cpu", **kw), overflows)
    assert drive(LossScaler("cpu", **kw, **UNBOUNDED), overflows) == ref


def test_default_settings_equal_gradscaler_within_bounds():
    rng = random.Random(0)
    overflows = [rng.random() < 0.5 for _ in range(40)]
    kw = dict(growth_interval=3)
    ref = drive(torch.amp.GradScaler("cpu", **kw), overflows)
    ours = drive(LossScaler("cpu", **kw), overflows)
    assert ours == [min(max(s, 1.0), 2.0**24) for s in ref]


def test_pytorch_documented_cases():
    # growth 2, backoff 0.25, interval 2, from 4: two clean steps grow to 8, an overflow backs off to 2.
    kw = dict(init_scale=4.0, growth_factor=2.0, backoff_factor=0.25, growth_interval=2, **UNBOUNDED)
    assert drive(LossScaler("cpu", **kw), [False, False, True]) == [4.0, 8.0, 2.0]
    # 128 * 2^clean * 0.5^skipped, with growth on every clean step.
    pattern = [False, True, False, False, True, False, False, False]
    final = drive(LossScaler("cpu", init_scale=128.0, growth_interval=1, **UNBOUNDED), pattern)[-1]
    assert final == 128.0 * 2.0 ** pattern.count(False) * 0.5 ** pattern.count(True)
    # Growth from 1e38 never reaches inf.
    scales = drive(LossScaler("cpu", init_scale=1e38, growth_interval=1, **UNBOUNDED), [False] * 5)
    assert all(math.isfinite(s) for s in scales) and scales[0] == pytest.approx(2e38)


def test_gradients_corrupted_after_unscale_are_not_caught():
    """As GradScaler: the inf check happens in unscale_, not again in step."""
    param = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([param], lr=1.0)
    for scaler in (torch.amp.GradScaler("cpu"), LossScaler("cpu")):
        param.data.fill_(1.0)
        scaler.scale(param.sum()).backward()
        scaler.unscale_(opt)
        param.grad[0] = math.inf
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        assert math.isinf(param[0].item())


def test_bounds_hold():
    assert min(drive(LossScaler("cpu", init_scale=4.0), [True] * 10)) == 1.0
    assert max(drive(LossScaler("cpu", init_scale=2.0**23, growth_interval=1), [False] * 5)) == 2.0**24


def test_hysteresis_backs_off_on_the_nth_overflow():
    scaler = LossScaler("cpu", init_scale=1024.0, growth_interval=3, hysteresis=2)
    assert drive(scaler, [True, True, True, False, False, False, True, True]) == \
        [1024.0, 512.0, 256.0, 256.0, 256.0, 512.0, 512.0, 256.0]


def test_unscaled_gradients_and_state_dict_match_gradscaler():
    torch.manual_seed(0)
    ref_p, our_p = torch.nn.Parameter(torch.randn(5)), None
    our_p = torch.nn.Parameter(ref_p.detach().clone())
    ref, ours = torch.amp.GradScaler("cpu"), LossScaler("cpu")
    for p, s in ((ref_p, ref), (our_p, ours)):
        opt = torch.optim.SGD([p], lr=0.1)
        s.scale((p * p).sum()).backward()
        s.unscale_(opt)
        s.step(opt)
        s.update()
    assert torch.equal(ref_p, our_p)
    theirs, mine = ref.state_dict(), ours.state_dict()
    assert {k: mine[k] for k in theirs} == theirs
    restored = LossScaler("cpu", init_scale=2.0)
    restored.load_state_dict(theirs)  # a GradScaler checkpoint loads too
    assert restored.get_scale() == ref.get_scale()


@pytest.mark.parametrize("fields, word", [
    (dict(growth_factor=1.0), "growth_factor"), (dict(backoff_factor=1.0), "backoff_factor"),
    (dict(backoff_factor=0.0), "backoff_factor"), (dict(min_scale=10.0, max_scale=1.0), "min_scale"),
    (dict(init_scale=2.0**30), "init_scale"), (dict(hysteresis=0), "hysteresis"),
])
def test_bad_settings(fields, word):
    with pytest.raises(UserError, match=word):
        LossScaleConfig(**fields)


def test_an_overflow_in_two_dtypes_is_one_skip_and_the_step_counts_stay():
    """found_inf is a flag (GradScaler's protocol): gradients of two dtypes both non-finite make 1, not 2, and a
    skipped step leaves mixprec's AdamW's step counts where they were (2 counted -1: a negative step's bias
    correction made every weight non-finite one step later)."""
    from mixprec.optim import AdamW

    params = [torch.zeros(64, 256, requires_grad=True), torch.zeros(8, dtype=torch.float16, requires_grad=True)]
    opt = AdamW(params, lr=1e-2, states="8bit", moments_dtype=torch.float32)
    scaler = LossScaler("cpu", init_scale=2.0**10)
    for p in params:
        p.grad = torch.full_like(p, float("inf"))
    assert scaler.scaling.unscale(opt, check_only=True).item() == 1.0
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**9
    assert all(s["step"].item() == 0 for s in opt.state.values())
    for p in params:
        p.grad = torch.ones_like(p)
    scaler.step(opt)
    scaler.update()
    assert all(s["step"].item() == 1 for s in opt.state.values())
    assert all(torch.isfinite(p).all() and p.abs().sum() > 0 for p in params)


def test_the_optimizer_kernels_count_any_nonzero_skip_as_one():
    from mixprec.optim import fused_adamw

    group = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    states = [{"step": torch.tensor(3.0)}]
    fused_adamw.device_steps(group, states, [torch.device("cpu")], torch.tensor(2.0))
    assert states[0]["step"].item() == 3.0
    fused_adamw.device_steps(group, states, [torch.device("cpu")], torch.tensor(0.0))
    assert states[0]["step"].item() == 4.0
