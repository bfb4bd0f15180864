import logging

import pytest
import torch

from mixprec import Policy, UserError
from mixprec.config import Precision, Training
from mixprec.train.policy import build_policy

FP32, BF16 = torch.float32, torch.bfloat16


@pytest.mark.parametrize("name, storage, param", [
    ("fp32", FP32, FP32), ("32-true", FP32, FP32), ("32", FP32, FP32), ("no", FP32, FP32),
    ("bf16-mixed", FP32, BF16), ("bf16", FP32, BF16), ("BF16-Mixed", FP32, BF16),
    ("bf16-true", BF16, BF16),
])
def test_presets_and_aliases(name, storage, param):
    policy = Policy.from_preset(name)
    assert (policy.storage_dtype, policy.param_dtype, policy.reduce_dtype) == (storage, param, FP32)
    assert policy.uses_autocast == (storage != param)


def test_explicit_fields_name_the_mode():
    assert Policy(param_dtype="bfloat16").name == "bf16-mixed"
    assert Policy(param_dtype=BF16, storage_dtype=BF16).name == "bf16-true"
    assert Policy().name == "fp32"


@pytest.mark.parametrize("bad, words", [
    (lambda: Policy.from_preset("fp8-mixed"), ["fp8-mixed", "accepted", "bf16-mixed"]),
    (lambda: Policy(param_dtype="bfloat17"), ["param_dtype", "'bfloat17'", "accepted"]),
    (lambda: Policy(param_dtype=FP32, storage_dtype=BF16), ["param_dtype float32", "storage_dtype bfloat16"]),
    (lambda: Policy.from_preset("bf16-mixed", param_dtype="float32"), ["bf16-mixed", "param_dtype", "float32"]),
])
def test_bad_policies_name_what_is_wrong(bad, words):
    with pytest.raises(UserError) as e:
        bad()
    assert all(w in str(e.value) for w in words), str(e.value)


def test_preset_default_fields_can_be_overridden():
    assert Policy.from_preset("bf16-mixed", reduce_dtype="bfloat16").reduce_dtype == BF16
    assert Policy.from_preset("bf16-mixed", param_dtype="bf16").param_dtype == BF16  # agrees: fine


@pytest.mark.parametrize("precision, training, expected", [
    ({}, {}, "bf16-mixed"),  # TorchTitan's defaults: float32 storage, bfloat16 mixed_precision_param
    ({}, {"dtype": "bfloat16"}, "bf16-true"),
    ({}, {"mixed_precision_param": "float32"}, "fp32"),
    ({"preset": "fp32"}, {"dtype": "float32"}, "fp32"),
    ({"param_dtype": "float32"}, {}, "fp32"),
    ({"preset": "32-true"}, {}, "fp32"),
    ({"param_dtype": "float16"}, {}, "fp16-mixed"),
    ({}, {"dtype": "float16"}, "fp16-true"),
])
def test_config_resolution(precision, training, expected):
    assert build_policy(Precision(**precision), Training(**training)).name == expected


@pytest.mark.parametrize("precision, training, words", [
    ({"preset": "bf16-mixed"}, {"mixed_precision_param": "float32"},
     ["precision.preset", "training.mixed_precision_param"]),
    ({"preset": "fp32"}, {"dtype": "bfloat16"}, ["precision.preset", "training.dtype"]),
    ({"param_dtype": "bfloat16"}, {"mixed_precision_param": "float32"},
     ["precision.param_dtype", "training.mixed_precision_param"]),
    ({"reduce_dtype": "float32"}, {"mixed_precision_reduce": "bfloat16"},
     ["precision.reduce_dtype", "training.mixed_precision_reduce"]),
])
def test_config_contradictions_name_both_keys(precision, training, words):
    with pytest.raises(UserError) as e:
        build_policy(Precision(**precision), Training(**training))
    assert all(w in str(e.value) for w in words), str(e.value)


def test_known_bad_combinations_warn_why(caplog):
    with caplog.at_level(logging.WARNING, logger="mixprec"):
        Policy.from_preset("bf16-mixed", reduce_dtype="bfloat16")
    assert "reduce_dtype bfloat16" in caplog.text and "float32 is advised" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mixprec"):
        Policy.from_preset("bf16-true")
    assert "optimizer states" in caplog.text and "2^-8" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mixprec"):
        Policy.from_preset("bf16-mixed")
    assert caplog.text == ""


@pytest.mark.parametrize("preset, message", [
    ("bf16-mixed", "Mixed precision training is handled by AMP"),
    ("fp32", "Mixed precision training is disabled"),
    ("bf16-true", "Mixed precision training is disabled"),
])
def test_setup_logs_the_mode_selection(preset, message, caplog):
    with caplog.at_level(logging.INFO, logger="mixprec"):
        Policy.from_preset(preset).setup(torch.nn.Linear(2, 2))
    assert message in caplog.text


def test_setup_casts_in_place_and_keeps_parameters():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    params = list(model.parameters())
    opt = torch.optim.AdamW(model.parameters())
    model2, opt2 = Policy.from_preset("bf16-true").setup(model, opt)
    assert model2 is model and opt2 is opt
    assert all(a is b and a.dtype == BF16 for a, b in zip(params, model.parameters()))
    model(torch.randn(2, 4, dtype=BF16)).sum().backward()
    opt.step()
    assert all(t.dtype == BF16 for s in opt.state.values() for k, t in s.items() if k != "step")


def test_step_clips_true_gradients_like_torch():
    torch.manual_seed(0)
    ref, ours = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    ours.load_state_dict(ref.state_dict())
    opt_ref, opt_ours = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(ours.parameters(), lr=0.1)
    policy = Policy.from_preset("fp32")
    policy.setup(ours, opt_ours)
    x = torch.randn(16, 8) * 100
    ref(x).pow(2).mean().backward()
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    opt_ref.step()
    with policy.autocast():
        loss = ours(x).pow(2).mean()
    policy.backward(loss)
    result = policy.step(opt_ours, max_norm=1.0)
    assert result.applied is True and bool(result) and result.clipped == (norm.item() > 1.0)
    assert result.grad_norm == pytest.approx(norm.item())
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), ours.parameters()))
    assert all(p.grad is None for p in ours.parameters())


def test_stats_and_state_dict_round_trip():
    policy = Policy.from_preset("bf16-mixed")
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    policy.setup(model, opt)
    for _ in range(3):
        with policy.autocast():
            loss = model(torch.randn(2, 4)).float().sum()
        policy.backward(loss)
        policy.step(opt)
    stats = policy.summary()
    assert stats["precision"] == "bf16-mixed" and stats["steps"] == 3 and stats["skipped_steps"] == 0
    restored = Policy.from_preset("bf16-mixed")
    restored.load_state_dict(policy.state_dict())
    assert restored.summary()["steps"] == 3


def test_describe_matches_the_mode():
    assert Policy.from_preset("bf16-mixed").describe()["gradients"] == "float32"
    assert Policy.from_preset("bf16-true").describe()["optimizer states"] == "bfloat16"
    assert set(Policy.from_preset("fp32").describe().values()) == {"float32", "none"}
    o2 = Policy.from_preset("O2").describe()
    assert o2["parameters"] == "float16 (norms float32)" and o2["master weights"] == o2["optimizer states"] == "float32"
