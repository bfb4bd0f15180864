"""Every recipe's experts, forward and backward, at router-like sizes, with CUDA's rules for torch's grouped
GEMMs applied to every call and its real offsets (tests/narrow/cuda_grouped_rules.py): an empty expert, one
row in the layer, K and N off 8 and off 16, 256 experts, 131,072 rows. Each call obeys them by construction
(layouts chosen, groups never more than the experts), on the emulation and on the kernel routes."""

import pytest
import torch
from cuda_grouped_rules import CudaGroupedRules, GroupedRuleError, check
from test_experts import CURRENT, gemm
from test_experts_cuda_routes import _reference_grouped

from mixprec.narrow.experts import ops as experts
from mixprec.narrow.experts.layer import base_mm

from mixprec.narrow.experts import fp8 as experts_fp8
from mixprec.narrow.experts import mx as experts_mx


def router_sizes(E: int, rows: int, seed: int = 0) -> tuple[int, ...]:
    """Rows per expert as a skewed router sends them (a quarter of the experts get none)."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.rand(E, generator=gen) ** 4
    weights[torch.randperm(E, generator=gen)[: E // 4]] = 0
    picks = torch.multinomial(weights, rows, replacement=True, generator=gen)
    return tuple(torch.bincount(picks, minlength=E).tolist())


CASES = {  # name: (sizes, K, N)
    "empty expert": ((37, 0, 64, 19), 48, 80),
    "one row in the layer": ((0, 1, 0, 0), 48, 80),
    "no rows (an expert-parallel rank)": ((0, 0, 0, 0), 48, 80),
    "K, N off 8": ((37, 0, 64, 19), 20, 12),
    "K, N off 16": ((5, 30, 0, 9), 24, 40),
    "256 experts": (router_sizes(256, 3000), 32, 48),
    "131,072 rows": (router_sizes(128, 131072), 16, 32),
}
ROUTES = [(name, False) for name in CURRENT] + [("rowwise", True), ("tensorwise", True), ("bf16 (base)", False)] + [
    (f"{name} summed as cast", False) for name in ("mxfp8", "mxfp4")]  # the MX weight gradient as CUDA sums it


def _run(name: str, grouped: bool, sizes, K: int, N: int):
    gen = torch.Generator().manual_seed(0)
    E, S = len(sizes), sum(sizes)
    x = torch.randn(S, K, generator=gen).bfloat16().requires_grad_()
    w = (torch.randn(E, N, K, generator=gen) / K ** 0.5).requires_grad_()
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    dy = torch.randn(S, N, generator=gen).bfloat16()
    if name == "bf16 (base)":
        out = base_mm(x, w, offs, transposed=False, dtype=torch.bfloat16)
    else:
        g = gemm(name, E=E)
        g = experts.ExpertsGemm(g.name, g.plan, False, g.salts, grouped=grouped)
        out = experts.experts_mm(x, w, offs, experts.register(g))
    out.backward(dy)
    return out, x.grad, w.grad


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name,grouped", ROUTES)
def test_every_grouped_gemm_obeys_cudas_rules(name, grouped, case, monkeypatch):
    sizes, K, N = CASES[case]
    if name.endswith(" summed as cast"):  # the CUDA route's layout of the MX weight gradient, on the CPU
        monkeypatch.setattr(experts_mx, "sums_as_cast", lambda device_type: True)
        name = name.split()[0]
    if grouped:  # torch's grouped row-wise kernel, stood in for on the CPU (its rules checked first)
        def kernel(a, b, scale_a, scale_b, offs, fast_accum=False):
            rules.calls.append(check(a, b, offs, scaled=True))
            return _reference_grouped(a, b, scale_a, scale_b, offs)
        monkeypatch.setattr(experts_fp8, "_scaled_grouped_mm", kernel)
    with CudaGroupedRules() as rules:
        out, dx, dw = _run(name, grouped, sizes, K, N)
    # forward and input gradient; the weight gradient too, but block-wise's (a batched GEMM over 128-token tiles)
    assert len(rules.calls) >= (2 if name == "blockwise" else 3), rules.calls
    assert torch.isfinite(out).all() and torch.isfinite(dx).all() and torch.isfinite(dw).all()
    for e in (e for e, n in enumerate(sizes) if n == 0):
        assert torch.count_nonzero(dw[e]) == 0, e
    if grouped and K % 16 == 0 and N % 16 == 0:
        assert any(c["scaled"] for c in rules.calls)


def test_the_rules_refuse_what_cuda_refuses():
    """The harness's own reference: the calls the code made before it obeyed (a row-major a and a column-major b
    in a 2-D x 2-D call with an empty group, one (N, 1) operand of unit strides, 1,028 groups)."""
    a, b = torch.randn(80, 120), torch.randn(120, 48)
    offs = torch.tensor([37, 37, 101, 120], dtype=torch.int32)
    with pytest.raises(GroupedRuleError, match="empty group"):
        check(a, b.t().contiguous().t(), offs, scaled=False)  # a row-major, b column-major (the MX weight gradient)
    assert check(a.t().contiguous().t(), b, offs, scaled=False)["a"] == "col"  # column-major a, row-major b: any
    with pytest.raises(GroupedRuleError, match="16 bytes"):
        check(torch.randn(80, 1), torch.randn(1, 48), torch.tensor([1], dtype=torch.int32), scaled=False)
    with pytest.raises(GroupedRuleError, match="1,024"):
        ends = torch.arange(1, 1029, dtype=torch.int32) * 128
        check(torch.randn(80, 1028 * 128).t().contiguous().t(), torch.randn(1028 * 128, 48), ends, scaled=False)
    with pytest.raises(GroupedRuleError, match="16 bytes"):  # dy^T column-major, N = 20 in bfloat16: 40 bytes
        check(torch.randn(120, 20).t(), torch.randn(120, 48), offs, scaled=False)


def test_at_1023_experts_the_kernel_route_adds_no_group_past_cudas_limit(monkeypatch):
    """The zero expert that takes the rows past offs[-1] on torch's grouped row-wise kernel is one group more:
    at 1,023 experts it would be CUDA's 1,024th, so there the rows are zeroed after the kernel instead."""
    def kernel(a, b, scale_a, scale_b, offs, fast_accum=False):
        rules.calls.append(check(a, b, offs, scaled=True))
        return _reference_grouped(a, b, scale_a, scale_b, offs)

    monkeypatch.setattr(experts_fp8, "_scaled_grouped_mm", kernel)
    with CudaGroupedRules() as rules:
        out, dx, dw = _run("rowwise", True, router_sizes(1023, 2000), 16, 16)
    assert max(c["groups"] for c in rules.calls if c["kind"] == "2d x 3d") == 1023
    assert torch.isfinite(out).all() and torch.isfinite(dx).all() and torch.isfinite(dw).all()
