"""The gathered copy a low-precision Linear reads (mixprec.narrow.fsdp.linear) against the cast
it makes of a plain weight: one shard holding the whole weight, the buffers refilled with the
backward's copy between the passes as FSDP2 does. Bit-identical outputs and gradients, on the
CPU and (gpu-marked) on CUDA: the device path of the gathered copy. The two-rank runs are in
tests/distributed/test_lowp_gather.py."""

import pytest
import torch
from torch import nn

from mixprec.narrow import RECIPES
from mixprec.narrow.fsdp.linear import BACKWARD, FORWARD, NarrowGather, per_pass

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _linear(recipe, device, weight):
    from mixprec.narrow.convert import convert_to_fp8

    model = nn.Sequential(nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=device, dtype=torch.bfloat16))
    model[0].weight.data.copy_(weight)
    convert_to_fp8(model, recipe, compute_dtype=torch.bfloat16, modules=["0"])
    return model[0]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["tensorwise", "delayed", "rowwise", "blockwise", "mxfp8", "nvfp4", "mxfp4"])
def test_the_gathered_copy_is_the_cast_of_the_weight(device, name):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    recipe = RECIPES[name]
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(128, 128, generator=gen) * 0.05).to(device, torch.bfloat16)
    x = torch.randn(32, 128, generator=gen).to(device, torch.bfloat16)
    dy = torch.randn(32, 128, generator=gen).to(device, torch.bfloat16)

    ref = _linear(recipe, device, w)
    xr = x.clone().requires_grad_()
    out_ref = ref(xr)
    out_ref.backward(dy)

    narrow = _linear(recipe, device, w)
    gather = NarrowGather(narrow, recipe, tuple(w.shape))
    inputs, meta = gather._shard_copy(w, FORWARD, None, 0, 1)
    gathered, _ = gather.post(inputs, FORWARD, meta, torch.bfloat16, None)
    narrow.weight = nn.Parameter(gathered)
    xn = x.clone().requires_grad_()
    out = narrow(xn)
    if per_pass(recipe):  # FSDP2 refills the same buffers with the backward's copy
        again, _ = gather._shard_copy(w, BACKWARD, None, 0, 1)
        for buffer, sent in zip(inputs, again):
            with torch.autograd._unsafe_preserve_version_counter(buffer):  # as FSDP2's copy-out
                buffer.view(torch.uint8).copy_(sent.view(torch.uint8))
    out.backward(dy)
    assert torch.equal(out, out_ref)
    assert torch.equal(xn.grad, xr.grad)
    assert torch.equal(narrow.weight.grad, ref.weight.grad)


class _SquareExperts(nn.Module):
    """Experts without a gate whose two projections have one shape (I == H): up_proj and down_proj (E, 32, 32)."""
    mixprec_seam, has_gate, is_transposed, has_bias = True, False, False, False

    def __init__(self):
        super().__init__()
        self.num_experts = 4
        self.up_proj = nn.Parameter(torch.randn(4, 32, 32))
        self.down_proj = nn.Parameter(torch.randn(4, 32, 32))


def test_two_experts_projections_of_one_shape_keep_their_own_gathers():
    """Each shard carries its projection's gather through FSDP2's slicing and copies (a lookup by shape gave
    both projections one), and the gathered weight flattens and unflattens as a traceable subclass."""
    from mixprec.narrow.fsdp import experts as experts_gather
    from mixprec.narrow.experts import hf as hf_experts
    from mixprec.narrow.fsdp.experts import GatheredExperts
    from mixprec.narrow.linear.fp8 import Plan

    recipe = RECIPES["rowwise"]
    model = nn.Module()
    model.experts = _SquareExperts()
    plan = Plan(recipe, recipe.tiles, torch.float32, (False, False, False))
    hf_experts.convert(model, ["experts"], plan)
    decided = experts_gather.shard(model, 2, reshards=lambda fqn: True, recomputes=lambda fqn: False)
    assert decided == {"experts.up_proj": None, "experts.down_proj": None}
    for name in ("up_proj", "down_proj"):
        shard = getattr(model.experts, name)
        assert shard._gather.name == name
        assert shard[:2]._gather is shard._gather and shard.detach().clone()._gather is shard._gather
    gather = model.experts.experts_gathers["down_proj"]
    inputs, meta = gather.pre(model.experts.down_proj.detach()._tensor, _OneRank())
    gathered, _ = gather.post(inputs, *meta[1:], torch.float32, None)
    names, spec = gathered.__tensor_flatten__()
    again = GatheredExperts.__tensor_unflatten__({n: getattr(gathered, n) for n in names}, spec, None, None)
    assert again.shape == gathered.shape and torch.equal(again.expert(1)._data.view(torch.uint8),
                                                         gathered.expert(1)._data.view(torch.uint8))


class _OneRank:
    def get_group(self):
        return None

    def get_local_rank(self):
        return 0

    def size(self):
        return 1
