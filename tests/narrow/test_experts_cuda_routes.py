"""Grouped experts along CUDA's routes, run on the CPU: torch's grouped row-wise kernel stood in for by
torch._scaled_mm per group (forward, input gradient, the weight gradient's 2-D x 2-D form, the zero expert of
the rows past the last offset, fast accumulation, the conversion's probe), CUDA's layouts (each expert's tokens
padded to 16; the MX weight gradient summed as cast), the functions CUDA compiles (Inductor's CPU backend
against the eager run), the route traced on meta. The same experts on the emulation: test_experts.py."""

import pytest
import torch
from test_experts import gemm, problem

from mixprec.narrow.experts import ops as experts
from mixprec.narrow.experts import routes
from mixprec.narrow.experts import fp8 as experts_fp8
from mixprec.narrow.gemm.fp8 import scaled_mm
from mixprec.narrow.formats.recipe import RECIPES
from mixprec.narrow.formats.scaling import Quantized


def _compiled_names(cuda_compiled) -> set:
    """The functions that ran compiled, the group bookkeeping (mixprec.narrow.experts.segments: one compiled function
    each, computed once a pass) apart; that ran too."""
    names = {fn.__name__ for fn, _ in cuda_compiled._COMPILED}
    assert "_index" in names
    return names - {"_index", "_tiles", "_aligned", "_sources"}


def _eager_and_compiled_as_on_cuda(g, monkeypatch, K: int, N: int):
    """A projection's forward and backward (an empty expert, sizes off every grid) eagerly, then with every
    cuda_compiled function compiled (Inductor's CPU backend) as CUDA runs them: (eager, compiled)."""
    import functools

    from mixprec.narrow.kernels import cuda_compiled

    x, w, offs, dy = problem(sizes=(37, 0, 64, 19), K=K, N=N)
    x, w = x.detach(), w.detach()
    eager = (experts.forward(x, w, offs, g), *experts.backward(x, w, offs, dy, g))
    monkeypatch.setattr(cuda_compiled, "_COMPILED", {})
    always = lambda fn, device: functools.partial(cuda_compiled.compiled_variant, fn)  # noqa: E731 - CUDA's route
    monkeypatch.setattr(cuda_compiled, "compiled", always)
    return eager, (experts.forward(x, w, offs, g), *experts.backward(x, w, offs, dy, g))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tensorwise", "rowwise", "blockwise", "rowwise on the kernel"])
def test_the_fp8_casts_compiled_as_on_cuda_equal_the_eager_ones(name, monkeypatch):
    """On CUDA each FP8 experts cast is one compiled function (cuda_compiled: Inductor fuses its amax, scale and
    cast): compiled here by Inductor's CPU backend, the forward and backward are the eager ones, bit for bit.
    On the kernel route (torch's grouped kernel stood in for) the casts also write the layouts the kernel reads:
    the input gradient's weight column-major, the weight gradient's operands placed and transposed."""
    from mixprec.narrow.kernels import cuda_compiled

    if name == "rowwise on the kernel":
        monkeypatch.setattr(experts_fp8, "_scaled_grouped_mm", _reference_grouped)
        g = gemm("rowwise")
        g = experts.ExpertsGemm(g.name, g.plan, False, grouped=True)
    else:
        g = gemm(name)
    eager, compiled = _eager_and_compiled_as_on_cuda(g, monkeypatch, K=48, N=80)
    # tensor-wise's weight gradient reuses the forward's and the input gradient's casts; the grouped GEMMs'
    # epilogues (FP32 out, rows and groups without tokens zeroed, the weight gradient's scales) compiled too
    casts = {"_stacked"} | ({"_by_expert"} if name == "tensorwise" else {"_by_token", "_along"})
    per_expert = {"_groups_present", "_scaled_groups"}  # block-wise sums 128-token tiles: a batched GEMM
    epilogues = {"_rows_present"} | (per_expert if name != "blockwise" else set())
    if g.grouped:  # the kernel scales and writes bfloat16: no epilogue; the weight cast twice (row-, column-major),
        # each with a zero expert for the rows past offs[-1]
        casts, epilogues = {"_stacked", "_by_token", "_along_placed"}, set()
        stacked = sorted(args[-2:] for fn, args in cuda_compiled._COMPILED if fn.__name__ == "_stacked")
        assert stacked == [(False, True), (True, True)], stacked
    assert _compiled_names(cuda_compiled) == casts | epilogues
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b), name


@pytest.mark.slow
@pytest.mark.parametrize("name", ["nvfp4"])  # every branch of the others' casts too (mxfp8, mxfp4: flags off)
def test_the_microscaled_casts_compiled_as_on_cuda_equal_the_eager_ones(name, monkeypatch):
    """On CUDA each microscaled experts cast is one compiled function with its bookkeeping inside (the tokens'
    cast with NVFP4's per-expert amax and the stochastic rounding's element indices; the stacked weights read
    transposed and padded; the weight gradient's operands placed along the tokens, rotated, keyed) and the
    grouped GEMMs' epilogues with NVFP4's tensor scales: compiled by Inductor's CPU backend, the forward and
    backward are the eager ones, bit for bit (nvfp4: Hadamard rotation, stochastic rounding, 2-D weights)."""
    from mixprec.narrow.kernels import cuda_compiled

    eager, compiled = _eager_and_compiled_as_on_cuda(gemm(name), monkeypatch, K=64, N=96)
    names = {"_token_cast", "_cast_stack", "_placed_cast", "_rows_present", "_groups_present"}
    if name == "nvfp4":
        names |= {"_tensor_scaled", "_expert_scaled"}
    assert _compiled_names(cuda_compiled) == names
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b), name


def _reference_grouped(a, b, scale_a, scale_b, offs, fast_accum=False):
    """torch's grouped row-wise GEMM group by group, on the route a row-wise Linear takes on this CPU
    (torch._scaled_mm where it takes row-wise scales, torch 2.13; the emulation where not, 2.11); the CPU
    has no reduced-precision accumulation, so fast_accum changes nothing here."""
    kernel = gemm("rowwise").plan.kernels[0]
    if b.dim() == 2:  # 2-D x 2-D: a (N, P), b (P, K), the summed P split by offs; scales (E * N,), (E * K,)
        N, K = a.shape[0], b.shape[1]
        out = torch.zeros(offs.shape[0], N, K, dtype=torch.bfloat16)
        for e, (s, t) in enumerate(experts.groups(offs)):
            qa = Quantized(a[:, s:t], scale_a[e * N:(e + 1) * N].view(-1, 1), (1, t - s))
            qb = Quantized(b[s:t], scale_b[e * K:(e + 1) * K].view(1, -1), (t - s, 1))
            out[e] = scaled_mm(qa, qb, torch.bfloat16, kernel=kernel)
        return out
    K = a.shape[1]
    out = torch.zeros(a.shape[0], b.shape[2], dtype=torch.bfloat16)
    for e, (s, t) in enumerate(experts.groups(offs)):
        if t > s:
            qa = Quantized(a[s:t], scale_a[s:t].view(-1, 1), (1, K))
            qb = Quantized(b[e], scale_b[e].view(1, -1), (K, 1))
            out[s:t] = scaled_mm(qa, qb, torch.bfloat16, kernel=kernel)
    return out


@pytest.mark.parametrize("transposed", [False, True])
def test_grouped_row_wise_route_equals_expert_by_expert(monkeypatch, transposed):
    """The grouped route casts x, dy and all the weights at once: the same operands as expert by
    expert (row-wise scales never cross a row), laid out as torch's grouped kernel reads them; with
    that kernel stood in for by torch._scaled_mm per group, the output and the input gradient are the
    loop's, bit for bit, and the weight gradient (the kernel's 2-D x 2-D form: each expert's tokens
    padded to 16 with zero rows, its FP32 sums written in bfloat16) is the loop's FP32 one rounded to
    bfloat16 (a last bit apart where the padded sum's order moves a rounding)."""
    monkeypatch.setattr(experts_fp8, "_scaled_grouped_mm", _reference_grouped)
    loop = gemm("rowwise", transposed)
    grouped = experts.ExpertsGemm(loop.name, loop.plan, transposed, grouped=True)
    assert grouped.plan.kernels == (True, True, True)
    results = []
    for g in (loop, grouped):
        x, w, offs, dy = problem(transposed=transposed, seed=5)
        experts.experts_mm(x, w, offs, experts.register(g)).backward(dy)
        results.append((experts.experts_mm(x, w, offs, experts.register(g)).detach(), x.grad, w.grad))
    (out, dx, dw), (out_k, dx_k, dw_k) = results
    assert torch.equal(out, out_k) and torch.equal(dx, dx_k)
    rounded = dw.bfloat16().float()
    assert not torch.equal(dw_k, dw) and (dw_k != rounded).float().mean() < 0.01, (dw_k != rounded).float().mean()
    assert ((dw_k - rounded).abs() <= 2**-7 * rounded.abs()).all()


def test_grouped_route_traced_on_meta(monkeypatch):
    """CUDA's grouped route on the meta device: torch's meta function of torch._scaled_grouped_mm checks the
    operands' dtypes, layouts (a row-major, b column-major) and the scales' shapes."""
    g = experts.ExpertsGemm("e.gate_up_proj", gemm("rowwise").plan, False, grouped=True)
    x = torch.empty(40, 48, dtype=torch.bfloat16, device="meta")
    w = torch.empty(4, 80, 48, device="meta")
    offs = torch.empty(4, dtype=torch.int32, device="meta")
    out = experts.forward(x, w, offs, g)
    assert out.shape == (40, 80) and out.dtype == torch.bfloat16
    dx, dw = experts.backward(x, w, offs, torch.empty(40, 80, dtype=torch.bfloat16, device="meta"), g)
    assert dx.shape == x.shape and dx.dtype == x.dtype and dw.shape == w.shape


def test_routes_said_at_conversion():
    plan = gemm("rowwise").plan
    assert "not torch's grouped row-wise kernel: torch's grouped scaled GEMM runs on CUDA GPUs only" in \
        routes.describe(plan)
    assert routes.describe(gemm("mxfp8").plan).startswith("the grouped emulation")


def test_grouped_kernel_probe(monkeypatch):
    """The probe that admits torch's grouped kernel (run on CUDA at conversion), on the CPU with the kernel
    stood in for: a faithful kernel is admitted, a wrong one refused with the error."""
    monkeypatch.setattr(experts_fp8, "_scaled_grouped_mm", _reference_grouped)
    routes._probe_grouped.cache_clear()
    assert routes._probe_grouped("cpu") is None
    monkeypatch.setattr(experts_fp8, "_scaled_grouped_mm", lambda *args, **kw: _reference_grouped(*args) * 1.1)
    routes._probe_grouped.cache_clear()
    assert "disagrees with the grouped emulation (0.1)" in routes._probe_grouped("cpu")
    routes._probe_grouped.cache_clear()


@pytest.mark.parametrize("sizes", [(37, 0, 64, 19), (0, 0, 0, 0), (16, 1, 0, 15)])
def test_the_weight_gradients_layout_pads_each_expert_to_16_rows_none_empty(sizes):
    """Segments.sources(16), the row-wise kernel's weight-gradient layout: each expert's rows in order from a
    multiple of 16, zero rows to the next (an expert without rows: 16 zero rows, no empty group), the rows
    past offs[-1] nowhere, within the static length P; against a loop over the experts."""
    from mixprec.narrow.experts.segments import Segments

    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    rows = sum(sizes) + 3  # three rows past offs[-1]
    src, ends, P = Segments(offs, rows).sources(16)
    want, start = [], 0
    for n in sizes:
        want += list(range(start, start + n)) + [rows] * (max(-(-n // 16), 1) * 16 - n)
        start += n
    assert P % 16 == 0 and P >= len(want) and src.shape == (P,)
    assert src[:len(want)].tolist() == want and (src[len(want):] == rows).all()
    assert ends.tolist() == torch.tensor([max(-(-n // 16), 1) * 16 for n in sizes]).cumsum(0).tolist()


@pytest.mark.parametrize("name", ["tensorwise", "rowwise"])
def test_the_grouped_kernels_forward_accumulates_as_the_recipes_dense_forward(name, monkeypatch):
    """torch's grouped row-wise kernel gets the recipe's fast_accum in the forward GEMM (tensor-wise: on, as
    its dense Linear's forward and torchao's) and never in the gradients' GEMMs."""
    calls = []

    def kernel(a, b, scale_a, scale_b, offs, fast_accum=False):
        calls.append((b.dim(), fast_accum))
        return _reference_grouped(a, b, scale_a, scale_b, offs)

    monkeypatch.setattr(experts_fp8, "_scaled_grouped_mm", kernel)
    g = gemm(name)
    g = experts.ExpertsGemm(g.name, g.plan, False, grouped=True)
    x, w, offs, dy = problem(sizes=(37, 0, 64, 19), K=48, N=80)
    experts.experts_mm(x, w, offs, experts.register(g)).backward(dy)
    fast = RECIPES[name].fast_accum
    # tensor-wise: the forward only (its e5m2 gradients are emulated); row-wise: forward, dgrad, wgrad (2-D x 2-D)
    assert calls == ([(3, True)] if name == "tensorwise" else [(3, fast), (3, False), (2, False)])
    assert fast == (name == "tensorwise")


@pytest.mark.parametrize("name", ["mxfp8", "mxfp4"])
def test_the_mx_weight_gradient_summed_as_cast_is_the_cpus_in_another_order(name, monkeypatch):
    """Off the CPU the MX weight gradient's GEMM sums the tokens' layout as cast (zero rows between experts, an
    empty expert one zero block): the same products as the CPU's sum of each expert's own tokens, in another
    order (FP32 rounding apart); the output and the input gradient do not change."""
    from mixprec.narrow.experts import mx as experts_mx

    g = gemm(name)
    x, w, offs, dy = problem(sizes=(37, 0, 64, 19), K=64, N=96)
    x, w = x.detach(), w.detach()
    cpu = (experts.forward(x, w, offs, g), *experts.backward(x, w, offs, dy, g))
    monkeypatch.setattr(experts_mx, "sums_as_cast", lambda device_type: True)
    as_cast = (experts.forward(x, w, offs, g), *experts.backward(x, w, offs, dy, g))
    assert torch.equal(cpu[0], as_cast[0]) and torch.equal(cpu[1], as_cast[1])
    assert float((cpu[2] - as_cast[2]).norm() / cpu[2].norm()) < 1e-6 and torch.count_nonzero(as_cast[2][1]) == 0


@pytest.mark.parametrize("name", ["rowwise", "tensorwise"])
def test_on_the_grouped_kernel_the_rows_past_the_last_offset_go_to_a_zero_expert(name, monkeypatch):
    """The grouped row-wise kernel leaves the rows past offs[-1] unwritten: a zero expert cast after the last
    takes them (one more group, no pass over the output), so they come out zero, and every other row is the
    emulation's bit for bit (the kernel stood in for by torch._scaled_mm per group)."""
    monkeypatch.setattr(experts_fp8, "_scaled_grouped_mm", _reference_grouped)
    x, w, offs, dy = problem(sizes=(37, 0, 64, 19), K=48, N=80)
    gen = torch.Generator().manual_seed(7)
    x = torch.cat([x.detach(), torch.randn(3, 48, generator=gen).bfloat16()])
    dy = torch.cat([dy, torch.randn(3, 80, generator=gen).bfloat16()])
    results = []
    for grouped in (True, False):
        g = gemm(name)
        g = experts.ExpertsGemm(g.name, g.plan, False, grouped=grouped)
        results.append((experts.forward(x, w.detach(), offs, g), *experts.backward(x, w.detach(), offs, dy, g)))
    (out, dx, _), (out_e, dx_e, _) = results
    assert torch.count_nonzero(out[120:]) == 0 and torch.count_nonzero(dx[120:]) == 0
    assert torch.equal(out, out_e)
    if name == "rowwise":  # tensor-wise's e5m2 input gradient is emulated on both routes
        assert torch.equal(dx, dx_e)
