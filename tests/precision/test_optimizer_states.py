"""What Policy.setup does with the user's optimizer where a mode promises other moments than
torch's AdamW keeps: mixprec's AdamW in its place (logged), or one line for another class."""

import logging
import warnings

import pytest
import torch

from mixprec import Policy, UserError, build_model, model_args
from mixprec.optim import AdamW


def model():
    return build_model(model_args("debug", 256), device="cpu", storage_dtype=torch.float32, seed=0)


def groups(m):
    return [{"params": [p for p in m.parameters() if p.dim() >= 2], "weight_decay": 0.05},
            {"params": [p for p in m.parameters() if p.dim() < 2], "weight_decay": 0.0, "lr": 1e-4}]


@pytest.mark.parametrize("preset, states", [("bf16-mixed-8bit", "8bit"), ("fp8-blockwise", "bf16"),
                                            ("bf16-kahan-8bit", "8bit")])
def test_torchs_adamw_is_replaced_with_the_same_groups_and_a_line(preset, states, caplog):
    m = model()
    opt = torch.optim.AdamW(groups(m), lr=3e-4, betas=(0.8, 0.9), eps=1e-6)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)  # built before setup, on the old one
    policy = Policy.from_preset(preset)
    with caplog.at_level(logging.INFO, logger="mixprec"):
        _, new = policy.setup(m, opt)
    assert isinstance(new, AdamW) and new.states.name == states and policy.optimizer is new
    assert [g is h for g, h in zip(new.param_groups, opt.param_groups)] == [True, True]  # the same dicts
    assert new.defaults["betas"] == (0.8, 0.9) and new.defaults["eps"] == 1e-6
    assert [g["lr"] for g in new.param_groups] == [1.5e-4, 5e-5] and [g["weight_decay"] for g in new.param_groups] \
        == [0.05, 0.0]
    for p in m.parameters():
        p.grad = torch.zeros_like(p)
    new.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not "lr_scheduler.step() before optimizer.step()": the new one stepped
        scheduler.step()  # drives the new optimizer's groups
    assert [g["lr"] for g in new.param_groups] == [1.5e-4, 5e-5]
    line = next(r.getMessage() for r in caplog.records if "replaced by mixprec.optim.AdamW" in r.getMessage())
    assert f"{preset} keeps AdamW's moments in {states}" in line and "same 2 parameter groups" in line
    if states == "8bit":
        assert any("float32 moments, an embedding: tok_embeddings.weight" in r.getMessage() for r in caplog.records)
        assert new.compensated == (preset == "bf16-kahan-8bit")
        assert policy.updates is None  # that AdamW compensates the bfloat16 weights itself


def test_another_optimizer_class_keeps_its_state_with_one_line(caplog):
    m = model()
    sgd = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    with caplog.at_level(logging.WARNING, logger="mixprec"):
        _, same = Policy.from_preset("bf16-mixed-8bit").setup(m, sgd)
    assert same is sgd
    lines = [r.getMessage() for r in caplog.records if "keeps its own state" in r.getMessage()]
    assert len(lines) == 1 and "SGD" in lines[0] and "8bit (blocks of 256)" in lines[0]


def test_the_spec_refuses_what_an_update_rule_cannot_keep_in_one_line():
    with pytest.raises(UserError, match="optimizer_states 8bit with bf16-sr: .* accepted: bf16"):
        Policy.from_preset("bf16-sr", optimizer_states="8bit")
    with pytest.raises(UserError, match="optimizer_states fp32 with a bfloat16 model: .* accepted: bf16, fp8, 8bit"):
        Policy.from_preset("bf16-true", optimizer_states="fp32")
    policy = Policy.from_preset("fp8-rowwise", optimizer_states="fp8")
    assert policy.describe()["optimizer states"] == "fp8 (blocks of 256) moments"
    assert policy.name == "fp8-rowwise+fp8-moments"
    assert Policy.from_preset("bf16-mixed", optimizer_states="8bit").name == "bf16-mixed-8bit"


def test_a_scheduler_built_before_setup_still_drives_the_groups_after_load_state_dict():
    m = model()
    opt = torch.optim.AdamW(groups(m), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # on the old optimizer
    _, new = Policy.from_preset("bf16-mixed-8bit").setup(m, opt)
    for p in m.parameters():
        p.grad = torch.zeros_like(p)
    new.step()
    dicts = list(new.param_groups)
    new.load_state_dict(new.state_dict())
    assert all(a is b for a, b in zip(dicts, new.param_groups))  # the dicts the scheduler holds
    scheduler.step()
    assert [g["lr"] for g in new.param_groups] == [5e-4, 5e-5]


def test_master_weight_modes_keep_fp32_moments_where_the_log_says():
    """bf16-master with 8-bit moments: MasterWeights swaps FP32 masters into the groups after the AdamW was
    built; embeddings and small tensors keep FP32 moments on the masters, as logged."""
    import dataclasses

    from mixprec.optim.state_formats import StateFormat

    m = model()
    policy = Policy(dataclasses.replace(Policy.from_preset("bf16-master").spec,
                                        optimizer_states=StateFormat("8bit")))
    _, opt = policy.setup(m, torch.optim.AdamW(m.parameters(), lr=1e-3))
    masters = policy.masters.named_masters(m)
    assert masters and all(p.dtype == torch.float32 for p in masters.values())
    for p in m.parameters():
        p.grad = torch.ones_like(p)
    policy.step(opt)
    kept = {name for name, p in masters.items() if opt.state[p]["exp_avg"].dtype == torch.float32}
    small = {name for name, p in masters.items() if p.numel() < 4096}
    assert kept == small | {"tok_embeddings.weight"}, kept ^ (small | {"tok_embeddings.weight"})
    assert {name for name, p in masters.items() if id(p) in opt.kept_fp32} == kept
