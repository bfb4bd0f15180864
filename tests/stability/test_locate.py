"""The locator names the module, op and dtype where a non-finite value first appears."""

import pytest
import torch

from mixprec.models.llama import build_model, model_args
from mixprec.precision import Policy
from mixprec.stability.diagnose import diagnose
from mixprec.stability.drills import _poison
from mixprec.stability.locate import Locator


@pytest.fixture
def setup():
    model = build_model(model_args("debug", 256), device=torch.device("cpu"), storage_dtype=torch.float32, seed=0)
    policy = Policy.from_preset("bf16-mixed")
    x, y = torch.randint(0, 256, (2, 32)), torch.randint(0, 256, (2, 32))

    def forward():
        with policy.autocast("cpu"):
            return model(x, y)

    return model, forward, lambda loss: loss.backward()


def test_a_clean_step_has_no_finding(setup):
    model, forward, backward = setup  # the causal mask's -inf is intended, not a finding
    assert Locator(model).run(forward, backward) is None


def test_a_nan_in_a_module_output_names_that_module(setup):
    model, forward, backward = setup
    model.get_submodule("layers.1.feed_forward.w2").register_forward_hook(_poison)
    found = Locator(model).run(forward, backward)
    assert (found.module, found.phase, found.op, found.dtype) == ("layers.1.feed_forward.w2", "forward",
                                                                  "masked_fill", "bfloat16")
    assert 0 < found.max_abs_input < 100
    assert str(found).startswith("layers.1.feed_forward.w2 (forward, masked_fill, bfloat16 output, inputs finite")


def test_an_overflowing_op_is_named_with_its_op_and_dtype(setup):
    model, forward, backward = setup
    with torch.no_grad():  # a weight whose products pass float32's range
        model.get_submodule("layers.0.attention.wv").weight.fill_(1e38)
    found = Locator(model).run(forward, backward)
    assert found.module == "layers.0.attention.wv" and found.phase == "forward" and found.op in ("mm", "addmm")
    assert found.max_abs_input > 9e37  # 1e38 rounded to bfloat16 (9.97e37) by autocast


def test_a_nan_made_in_backward_names_the_module(setup):
    model, forward, backward = setup
    wo = model.get_submodule("layers.0.attention.wo")
    wo.register_full_backward_hook(lambda m, grad_in, grad_out: (torch.full_like(grad_in[0], float("nan")),))
    found = Locator(model).run(forward, backward)
    assert (found.module, found.phase) == ("layers.0.attention.wo", "backward")


def test_a_nan_in_a_weight_gradient_names_its_module(setup):
    model, forward, backward = setup
    w1 = model.get_submodule("layers.1.feed_forward.w1")
    w1.weight.register_hook(lambda g: g * float("nan"))
    found = Locator(model).run(forward, backward)
    assert (found.module, found.phase) == ("layers.1.feed_forward.w1", "backward")


def test_float16_overflow_is_diagnosed_as_one():
    lin = torch.nn.Linear(64, 64).half()
    with torch.no_grad():
        lin.weight.fill_(1.0)
    model = torch.nn.Sequential(torch.nn.Identity(), lin)
    x = torch.full((4, 64), 2000.0, dtype=torch.float16)  # 64 x 2000 = 128000 > 65504
    found = Locator(model).run(lambda: model(x).float().sum(), lambda loss: None)
    assert (found.module, found.dtype) == ("1", "float16") and found.max_abs_input == 2000
    text = diagnose("nonfinite", "loss is inf", float("inf"), float("nan"), [], 1, 128, found, "rewound")
    assert "65504" in text and "Action: rewound." in text
