"""mixprec's tensor-wise FP8 Linear against torchao's Float8Linear, an independent
implementation (a test-only reference): the same recipe (current scaling, e4m3 inputs and
weights, e5m2 output gradients, torch's CPU _scaled_mm) must give the same bits."""

import copy
import warnings

import pytest
import torch
from torch import nn

from mixprec.narrow.convert import convert_to_fp8
from mixprec.narrow.formats.recipe import FP8Recipe

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    float8 = pytest.importorskip("torchao.float8")


@pytest.fixture(autouse=True)
def _kernel(kernel_on_cpu):  # torchao's Float8Linear runs torch's CPU _scaled_mm: mixprec's on the same kernel
    pass


def _pair(seed: int):
    torch.manual_seed(seed)
    base = nn.Sequential(nn.Linear(64, 128, bias=False), nn.ReLU(), nn.Linear(128, 64, bias=False))
    ours, ao = copy.deepcopy(base), copy.deepcopy(base)
    convert_to_fp8(ours, FP8Recipe.from_name("tensorwise"), compute_dtype=torch.float32, emulate=False)
    float8.convert_to_float8_training(ao)
    assert type(ao[0]).__name__ == "Float8Linear"
    return ours, ao


@pytest.mark.parametrize("seed", range(8))
def test_outputs_and_gradients_equal_torchaos(seed):
    # before the scales were correctly rounded, 27 of 30 such draws differed
    ours, ao = _pair(seed)
    x = torch.randn(32, 64) * (10 * torch.rand(()) + 0.01)
    y_ours, y_ao = ours(x), ao(x)
    assert torch.equal(y_ours, y_ao)
    y_ours.square().sum().backward()
    y_ao.square().sum().backward()
    for a, b in zip(ours.parameters(), ao.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_a_hundred_training_steps_equal_torchaos():
    ours, ao = _pair(0)
    data = torch.Generator().manual_seed(1)
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ours, ao)]
    for _ in range(100):
        x = torch.randn(16, 64, generator=data)
        target = torch.randn(16, 64, generator=data)
        losses = []
        for model, opt in zip((ours, ao), optims):
            loss = (model(x) - target).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss)
        assert torch.equal(losses[0], losses[1])
    for a, b in zip(ours.parameters(), ao.parameters()):
        assert torch.equal(a, b)
