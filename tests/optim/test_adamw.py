import pytest
import torch

from mixprec.optim import AdamW


def train(opt_cls, steps=25, **kwargs):
    torch.manual_seed(0)
    params = [torch.randn(64, 32, requires_grad=True), torch.randn(32, requires_grad=True)]
    groups = [{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:], "weight_decay": 0.0}]
    opt = opt_cls(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, **kwargs)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return params, opt


def test_float32_moments_match_torch_adamw_bit_for_bit():
    ours, _ = train(AdamW, moments_dtype=torch.float32)
    ref, _ = train(torch.optim.AdamW, foreach=False)
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))


def test_bfloat16_moments_halve_the_state_and_stay_close():
    ours, opt = train(AdamW, moments_dtype=torch.bfloat16)
    ref, ref_opt = train(torch.optim.AdamW, foreach=False)
    moments = [t for s in opt.state.values() for k, t in s.items() if k != "step"]
    assert {t.dtype for t in moments} == {torch.bfloat16}
    assert sum(t.nbytes for t in moments) * 2 == sum(t.nbytes for s in ref_opt.state.values()
                                                     for k, t in s.items() if k != "step")
    for a, b in zip(ours, ref):  # 25 steps of lr 1e-2 with moments rounded to 8 bits: close, not equal
        assert not torch.equal(a, b)
        assert (a - b).abs().max() < 2e-3


def test_state_dict_round_trip_keeps_the_moments_dtype():
    params, opt = train(AdamW, steps=3)
    fresh = AdamW([{"params": params[:1]}, {"params": params[1:]}], moments_dtype=torch.bfloat16)
    fresh.load_state_dict(opt.state_dict())
    for p in params:
        assert fresh.state[p]["exp_avg"].dtype == torch.bfloat16
        assert torch.equal(fresh.state[p]["exp_avg"], opt.state[p]["exp_avg"])


def test_closure_and_bad_arguments():
    params, opt = train(AdamW, steps=1)
    assert opt.step(lambda: torch.tensor(3.0)) == 3.0
    with pytest.raises(ValueError, match="moments_dtype"):
        AdamW(params, moments_dtype=torch.int8)
