"""mixprec.analysis.cuda_route: what an experts operator holds inside along CUDA's route, traced on meta, and the
memory plan that now counts it (an operator's fake function allocates only what it returns)."""

import dataclasses

import pytest
import torch

from mixprec.analysis import cuda_route
from mixprec.analysis.plan_model import plan_memory
from mixprec.models.llama import construct, model_args
from mixprec.narrow.experts import ops as experts
from mixprec.narrow.linear.fp8 import Plan
from mixprec.narrow.formats.recipe import RECIPES

E, N, K, S = 8, 272, 208, 200  # S not a multiple of E, 16 or 128; the weights the most bytes


def _key(name: str) -> experts.Key:
    r = RECIPES[name]
    salts = tuple(range(E)) if hasattr(r, "element") else ()
    return experts.register(experts.ExpertsGemm("e", Plan(r, r.tiles, torch.bfloat16, (False,) * 3), False, salts))


def _args():
    sizes = torch.tensor([30, 0, 41, 25, 25, 50, 9, 20])  # an empty expert, 200 rows
    return (torch.empty(S, K, dtype=torch.bfloat16), torch.empty(E, N, K), sizes.cumsum(0).to(torch.int32),
            torch.empty(S, N, dtype=torch.bfloat16))


@pytest.mark.parametrize("name", ["rowwise", "tensorwise", "blockwise"])
def test_the_fp8_experts_hold_no_fp32_copy_of_their_weights_inside(name):
    x, w, offs, dy = _args()
    key = _key(name)
    fp32_weights, fp8_weights = 4 * E * N * K, E * N * K
    forward = cuda_route.inside_peak(torch.ops.mixprec.experts_mm.default, (x, w, offs, *key))
    backward = cuda_route.inside_peak(torch.ops.mixprec.experts_mm_backward.default, (x, w, offs, dy, *key))
    # at least what the route must hold at once: the FP8 weights, the FP8 rows and the bfloat16 output
    assert forward >= fp8_weights + S * K + 2 * S * N, forward
    assert forward < fp32_weights, forward  # and no FP32 (E, N, K) temporary
    outputs = 2 * S * K + fp32_weights  # dx in bfloat16, dW in the masters' FP32
    assert fp8_weights < backward - outputs < fp32_weights, backward


def test_inside_peak_is_traced_once_per_shape_and_follows_the_shape():
    x, w, offs, dy = _args()
    key = _key("rowwise")
    op = torch.ops.mixprec.experts_mm.default
    small = cuda_route.inside_peak(op, (x, w, offs, *key))
    assert cuda_route.inside_peak(op, (x, w, offs, *key)) == small
    assert cuda_route.inside_peak(op, (torch.empty(2 * S, K, dtype=torch.bfloat16), w, offs, *key)) > small


def test_the_memory_plan_counts_what_the_experts_operators_hold_inside(monkeypatch):
    # the debug flavor with wider experts, where a step's peak is in the experts' backward
    shape = dataclasses.replace(model_args("moe-debug", 64), moe_hidden_dim=256, n_experts=16, n_layers=1)
    tokens = torch.zeros(4, 32, dtype=torch.long)

    def planned():
        return plan_memory(lambda: construct(shape, torch.float32), "fp8-rowwise", (tokens, tokens))

    with_insides = planned()
    monkeypatch.setattr(cuda_route.Workspaces, "__torch_dispatch__",
                        lambda self, func, types, args=(), kwargs=None: func(*args, **(kwargs or {})))
    outputs_only = planned()
    assert with_insides["by_kind"]["temp"] > outputs_only["by_kind"]["temp"], (with_insides, outputs_only)
    assert with_insides["peak_bytes"] > outputs_only["peak_bytes"]
