"""LossScaler as a drop-in for torch.amp.GradScaler: the behaviours PyTorch's own
GradScaler tests check (test_torch.py / test_cuda.py: unscale, update, sparse gradients,
state_dict, pickling, clipping, penalty, accumulation, multiple optimizers, the fused
optimizer handshake), written anew and run against both classes. LossScaler runs
unbounded (min_scale=0, max_scale=inf), where its scale is GradScaler's."""

import copy
import math
import pickle

import pytest
import torch

from mixprec import LossScaler

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def grad_scaler(device="cpu", **kw):
    scaler = torch.amp.GradScaler(device, **kw)
    scaler.scale(torch.ones((), device=device))  # GradScaler creates its scale tensor on first use
    return scaler


def loss_scaler(device="cpu", **kw):
    return LossScaler(device, min_scale=0.0, max_scale=math.inf, **kw)


BOTH = pytest.mark.parametrize("make", [grad_scaler, loss_scaler], ids=["GradScaler", "LossScaler"])


def model_and_data(device, seed=0, n_models=1):
    gen = torch.Generator().manual_seed(seed)
    models = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)).to(device)
              for _ in range(n_models)]
    for m in models:
        for p in m.parameters():
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    data = [(torch.randn(6, 8, generator=gen).to(device), torch.randn(6, 4, generator=gen).to(device))
            for _ in range(8)]
    return models, data


def run(make, device, scenario, fused=False):
    """A short training loop in the shape of one of PyTorch's GradScaler tests, with an
    inf injected into one step's gradients. Returns the final parameters and scales."""
    n_models = 2 if scenario == "multiple" else 1
    models, data = model_and_data(device, n_models=n_models)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, fused=fused or None) for m in models]
    scaler = make(device, init_scale=128.0, growth_interval=2)
    scales = []
    for i, (x, y) in enumerate(data):
        losses = [torch.nn.functional.mse_loss(m(x), y) for m in models]
        if scenario == "penalty":  # gradient penalty: autograd.grad of the scaled loss, unscaled by hand
            params = list(models[0].parameters())
            grads = torch.autograd.grad(scaler.scale(losses[0]), params, create_graph=True)
            inv = 1.0 / scaler.get_scale()
            penalty = sum((g * inv).pow(2).sum() for g in grads).sqrt()
            losses[0] = losses[0] + penalty
        if scenario == "accumulation":
            for half in (slice(0, 3), slice(3, 6)):
                scaler.scale(torch.nn.functional.mse_loss(models[0](x[half]), y[half]) / 2).backward()
        else:
            for loss in losses:
                scaler.scale(loss).backward()
        if i == 3:
            next(models[-1].parameters()).grad[0, 0] = math.inf
        for opt, m in zip(opts, models):
            if scenario == "clipping":  # unscale_, then clip the true gradients
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            elif scenario == "clipping_scaled":  # clip the scaled gradients to max_norm * scale
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5 * scaler.get_scale())
            scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        for opt in opts:
            opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for m in models for p in m.parameters()], scales


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scenario", ["plain", "clipping", "clipping_scaled", "penalty", "accumulation",
                                      "multiple"])
@pytest.mark.parametrize("fused", [False, True])
def test_training_loops_match_gradscaler_bitwise(device, scenario, fused):
    ref_params, ref_scales = run(grad_scaler, device, scenario, fused)
    params, scales = run(loss_scaler, device, scenario, fused)
    assert scales == ref_scales and any(b < a for a, b in zip(scales, scales[1:]))  # the inf backed off
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))


@BOTH
def test_unscale_divides_and_finds_infs(make):
    scaler = make(init_scale=4.0)
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=1.0)
    p.grad = torch.tensor([4.0, 8.0, -12.0])
    scaler.unscale_(opt)
    assert torch.equal(p.grad, torch.tensor([1.0, 2.0, -3.0]))
    scaler.step(opt)
    assert torch.equal(p.detach(), torch.tensor([-1.0, -2.0, 3.0]))
    scaler.update()
    p.grad = torch.tensor([1.0, math.nan, 0.0])
    scaler.step(opt)  # skipped
    assert torch.equal(p.detach(), torch.tensor([-1.0, -2.0, 3.0]))
    scaler.update()
    assert scaler.get_scale() == 2.0


@BOTH
def test_sparse_gradients(make):
    emb = torch.nn.Embedding(10, 3, sparse=True)
    opt = torch.optim.SGD(emb.parameters(), lr=1.0)
    scaler = make(init_scale=8.0)
    before = emb.weight.detach().clone()
    scaler.scale(emb(torch.tensor([1, 2, 2])).sum()).backward()
    assert emb.weight.grad.is_sparse
    scaler.step(opt)
    scaler.update()
    # rows 1 and 2 moved by their true gradients (row 2 used twice)
    assert torch.allclose(before[1] - emb.weight.detach()[1], torch.ones(3))
    assert torch.allclose(before[2] - emb.weight.detach()[2], 2 * torch.ones(3))
    assert torch.equal(before[3:], emb.weight.detach()[3:])
    # a float16 sparse gradient whose duplicate indices overflow only when summed
    scaler = make(init_scale=1.0)
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))
    i = torch.tensor([[0, 0]])
    p.grad = torch.sparse_coo_tensor(i, torch.tensor([60000.0, 60000.0], dtype=torch.float16), (4,))
    opt = torch.optim.SGD([p], lr=1.0)
    if make is grad_scaler:
        with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
            scaler.unscale_(opt)
        return
    scaler.unscale_(opt)  # LossScaler unscales float16 gradients (fp16-master needs it)
    assert scaler.found_inf


@BOTH
def test_misuse_is_refused_as_gradscaler_does(make):
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = make()
    p.grad = torch.ones(2)
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called on this optimizer since the last update"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="step\\(\\) has already been called since the last update"):
        scaler.step(opt)
    with pytest.raises(RuntimeError, match="unscale_\\(\\) is being called after step\\(\\)"):
        scaler.unscale_(opt)
    scaler.update()
    with pytest.raises(RuntimeError, match="Closure use is not currently supported"):
        scaler.step(opt, closure=lambda: None)


@BOTH
def test_getters_setters_state_dict_and_pickling(make):
    scaler = make(init_scale=2.0**10, growth_factor=3.0, backoff_factor=0.25, growth_interval=7)
    assert (scaler.get_scale(), scaler.get_growth_factor(), scaler.get_backoff_factor(),
            scaler.get_growth_interval()) == (2.0**10, 3.0, 0.25, 7)
    scaler.set_growth_factor(4.0)
    scaler.set_backoff_factor(0.125)
    scaler.set_growth_interval(5)
    state = scaler.state_dict()
    for other in (grad_scaler(), loss_scaler()):  # each class reads the other's state
        other.load_state_dict(state)
        assert (other.get_scale(), other.get_growth_factor(), other.get_backoff_factor(),
                other.get_growth_interval()) == (2.0**10, 4.0, 0.125, 5)
    again = pickle.loads(pickle.dumps(scaler))
    assert again.state_dict() == state


@BOTH
def test_scale_takes_tensors_lists_tuples_and_any_iterable(make):
    scaler = make(init_scale=2.0)
    a, b = torch.ones(2), torch.full((2,), 3.0)
    assert torch.equal(scaler.scale(a), 2 * a)
    assert isinstance(scaler.scale([a, b]), list) and isinstance(scaler.scale((a, b)), tuple)
    lazy = scaler.scale(t for t in (a, b))
    assert not isinstance(lazy, (list, tuple)) and [t.tolist() for t in lazy] == [[2.0, 2.0], [6.0, 6.0]]
    with pytest.raises(ValueError, match="outputs must be a Tensor or an iterable of Tensors"):
        scaler.scale(3.0)


def test_positional_constructor_as_gradscaler():
    ref, ours = torch.amp.GradScaler("cpu", 1024.0, 3.0, 0.25, 10), LossScaler("cpu", 1024.0, 3.0, 0.25, 10)
    assert ours.get_scale() == ref.get_scale() == 1024.0
    assert ours.get_growth_factor() == 3.0 and ours.get_backoff_factor() == 0.25 and ours.get_growth_interval() == 10


def test_fused_optimizers_get_grad_scale_and_found_inf_not_an_unscale_pass(monkeypatch):
    """torch's fused SGD/Adam/AdamW declare _step_supports_amp_scaling: the scaler hands
    them the scale and the inf flag and they unscale inside their kernel."""
    unscaled = []
    monkeypatch.setattr(LossScaler, "unscale_", lambda self, opt: unscaled.append(opt))
    results = []
    for make in (grad_scaler, loss_scaler):
        (model,), data = model_and_data("cpu")
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
        scaler = make(init_scale=64.0)
        for i, (x, y) in enumerate(data[:3]):
            scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
            if i == 1:
                model[0].weight.grad[0, 0] = math.inf  # skipped inside the kernel
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")  # handed over, then removed
        results.append(([p.detach().clone() for p in model.parameters()], scaler.get_scale(),
                        opt.state[model[0].weight]["step"].item()))
    assert unscaled == []  # no separate unscale pass over the gradients
    (a, scale_a, steps_a), (b, scale_b, steps_b) = results
    assert scale_a == scale_b == 32.0 and steps_a == steps_b == 2
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_gradscaler_state_outside_the_bounds_is_clamped_at_once():
    ref = torch.amp.GradScaler("cpu", init_scale=2.0**30)
    ours = LossScaler("cpu")  # bounds [1, 2^24]
    ours.load_state_dict(ref.state_dict())
    assert ours.get_scale() == 2.0**24  # before any update, as the bounds promise


@pytest.mark.parametrize("device", DEVICES)
def test_pickled_copy_trains_the_same(device):
    ref_params, ref_scales = run(loss_scaler, device, "plain")
    copied = lambda device, **kw: copy.deepcopy(pickle.loads(pickle.dumps(loss_scaler(device, **kw))))  # noqa: E731
    params, scales = run(copied, device, "plain")
    assert scales == ref_scales and all(torch.equal(a, b) for a, b in zip(params, ref_params))
