"""The dtype of every op, observed at the ATen level, under each precision mode."""

from collections import defaultdict

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mixprec import Policy, build_model, model_args

FP32, BF16 = torch.float32, torch.bfloat16
aten = torch.ops.aten
MATMUL = {aten.mm.default, aten.addmm.default, aten.bmm.default}


class OpDtypes(TorchDispatchMode):
    """Records the output dtypes of each ATen op."""

    def __init__(self):
        super().__init__()
        self.seen = defaultdict(set)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.seen[func].add(t.dtype)
        return out

    def dtypes(self, funcs) -> set:
        return set().union(*(self.seen[f] for f in funcs if f in self.seen))


def one_step(preset: str, emulate: bool = False):
    """A debug model's forward, backward and optimizer step, recording op dtypes
    (native BF16 kernels: the recorder must see the ops as they are dispatched)."""
    policy = Policy.from_preset(preset, emulate_matmul=emulate)
    model = build_model(model_args("debug", 256), device="cpu", storage_dtype=policy.storage_dtype, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = policy.setup(model, opt)
    x = torch.randint(0, 256, (2, 16))
    forward, backward = OpDtypes(), OpDtypes()
    with policy.autocast(), forward:
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x.flatten())
    with backward:
        policy.backward(loss)
    grads = {p.grad.dtype for p in model.parameters()}
    policy.step(opt)
    states = {t.dtype for s in opt.state.values() for k, t in s.items() if k != "step"}
    params = {p.dtype for p in model.parameters()}
    return forward, backward, logits, loss, grads, states, params


def test_bf16_mixed():
    fwd, bwd, logits, loss, grads, states, params = one_step("bf16-mixed")
    assert fwd.dtypes(MATMUL) == {BF16} and bwd.dtypes(MATMUL) == {BF16}
    assert fwd.dtypes([aten._softmax.default]) == {FP32}
    assert fwd.dtypes([aten.rsqrt.default]) == {FP32}  # RMSNorm
    assert fwd.dtypes([aten._log_softmax.default, aten.nll_loss_forward.default]) == {FP32}
    assert logits.dtype == FP32 and loss.dtype == FP32
    # FP32 leaves get FP32 gradients through autocast's differentiable casts.
    assert params == grads == states == {FP32}


def test_bf16_true():
    fwd, bwd, logits, loss, grads, states, params = one_step("bf16-true")
    assert fwd.dtypes(MATMUL) == {BF16} and bwd.dtypes(MATMUL) == {BF16}
    assert fwd.dtypes([aten.stack.default]) == {FP32}  # RoPE's rotation
    assert fwd.dtypes([aten.cos.default, aten.sin.default]) == {FP32}
    assert fwd.dtypes([aten._softmax.default, aten.rsqrt.default]) == {FP32}
    assert fwd.dtypes([aten._log_softmax.default]) == {FP32}
    assert logits.dtype == FP32
    assert params == grads == states == {BF16}


def test_fp32_has_nothing_narrower():
    fwd, bwd, logits, loss, grads, states, params = one_step("fp32")
    assert set().union(*fwd.seen.values()) == {FP32} and set().union(*bwd.seen.values()) == {FP32}
    assert params == grads == states == {FP32}


@pytest.mark.parametrize("preset", ["bf16-mixed", "bf16-true"])
def test_emulation_keeps_the_dtypes_users_see(preset):
    """With emulated BF16 matmuls the Linear outputs are still BF16 and the numbers
    equal the native kernel's up to summation order."""
    outs = {}
    for emulate in (False, True):
        policy = Policy.from_preset(preset, emulate_matmul=emulate)
        model = build_model(model_args("debug", 256), device="cpu", storage_dtype=policy.storage_dtype, seed=0)
        policy.setup(model)
        linear_dtypes = set()
        # the blocks' projections (the output layer returns the FP32 loss)
        hooks = [m.register_forward_hook(lambda m, i, o: linear_dtypes.add(o.dtype))
                 for m in model.layers.modules() if isinstance(m, torch.nn.Linear)]
        x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
        with policy.autocast():
            loss = model(x, x)
        policy.backward(loss)
        for h in hooks:
            h.remove()
        assert linear_dtypes == {BF16}
        outs[emulate] = (loss.detach(), [p.grad.float() for p in model.parameters()])
    (l0, g0), (l1, g1) = outs[False], outs[True]
    assert torch.allclose(l0, l1, rtol=1e-3)
    for a, b in zip(g0, g1):
        # SQNR of the emulated gradients against the native ones, in dB
        sqnr = 10 * torch.log10(a.pow(2).sum() / (a - b).pow(2).sum().clamp_min(1e-30))
        assert sqnr > 30, sqnr
