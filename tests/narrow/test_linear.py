import contextlib
import copy

import pytest
import torch
from torch import nn

from mixprec.narrow import RECIPES, Conversion, FP8Linear, convert_to_fp8, sqnr
from mixprec.narrow.gemm.fp8 import KERNELS
from mixprec.narrow.formats.recipe import GEMMS


def pair(recipe: str, K=256, N=384, seed=0):
    """A BF16 reference Linear and its FP8 conversion with the same weights."""
    torch.manual_seed(seed)
    ref = nn.Sequential(nn.Linear(K, N, bias=False))
    fp8 = copy.deepcopy(ref)
    convert_to_fp8(fp8, RECIPES[recipe], compute_dtype=torch.bfloat16)
    return ref, fp8


def run(model, x, grad, autocast: bool):
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        y = model(x)
    y.backward(grad.to(y.dtype))
    return y.detach().float(), x.grad.float(), model[0].weight.grad.float()


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_linear_against_the_bf16_linear(recipe):
    # torchao's bounds for a Float8Linear against the high-precision one: output >= 18 dB, grads >= 17 dB;
    # FP4 elements (3 bits of magnitude) measured 16.5-16.7 dB forward, 15.0-16.4 dB gradients (nvfp4's
    # stochastically rounded gradient the lowest)
    floors = (14, 13, 13) if RECIPES[recipe].label in ("NVFP4", "MXFP4") else (18, 17, 17)
    ref, fp8 = pair(recipe)
    x = torch.randn(2, 96, 256)
    grad = torch.randn(2, 96, 384)
    y_ref, dx_ref, dw_ref = run(ref, x, grad, autocast=True)
    y, dx, dw = run(fp8, x, grad, autocast=True)
    assert sqnr(y_ref, y) >= floors[0] and sqnr(dx_ref, dx) >= floors[1] and sqnr(dw_ref, dw) >= floors[2]
    assert fp8[0].weight.grad.dtype == torch.float32  # the gradient of an FP32 parameter stays FP32


@pytest.mark.parametrize("recipe", RECIPES)
def test_outputs_take_the_compute_dtype_and_gradients_the_inputs(recipe):
    _, fp8 = pair(recipe)
    x = torch.randn(64, 256, requires_grad=True)
    y = fp8(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32


def test_conversion_keeps_the_parameters_and_their_names():
    model = nn.Sequential(nn.Linear(64, 32, bias=True), nn.ReLU(), nn.Linear(32, 48))
    before = dict(model.named_parameters())
    keys = list(model.state_dict())
    conversion = convert_to_fp8(model, RECIPES["delayed"], compute_dtype=torch.bfloat16)
    assert isinstance(model[0], FP8Linear) and isinstance(model[2], FP8Linear)
    assert all(p is before[n] for n, p in model.named_parameters())
    assert list(model.state_dict()) == keys  # the amax history travels with the policy, not the model
    assert set(conversion.modules) == {"0", "2"}


def test_the_default_filter_leaves_the_output_layer_odd_dims_and_subclasses():
    class Head(nn.Linear):
        pass

    model = nn.ModuleDict({"proj": nn.Linear(64, 64), "odd": nn.Linear(64, 50), "head": Head(64, 64),
                           "output": nn.Linear(64, 64), "skip_me": nn.Linear(64, 64)})
    conversion = convert_to_fp8(model, RECIPES["tensorwise"], compute_dtype=torch.bfloat16,
                                exclude=("output", "skip_*"))  # no embedding: no output projection to find
    assert list(conversion.modules) == ["proj"]
    assert set(conversion.left_out) == {"odd", "head", "output", "skip_me"}
    assert "multiples of 16" in conversion.left_out["odd"] and "'skip_*'" in conversion.left_out["skip_me"]


def test_delayed_scaling_saturates_on_an_amax_jump_and_recovers_the_next_step():
    _, fp8 = pair("delayed", K=128, N=128)
    layer = fp8[0]
    conversion = Conversion(RECIPES["delayed"], {"0": layer})
    w = layer.weight.detach()
    calm = torch.randn(32, 128)
    for _ in range(3):  # three steps with |x| <= about 4 build the history
        fp8(calm).float().sum().backward()
        conversion.after_step()
    spike = calm.clone()
    spike[0, 0] = 1000.0  # 250x the history's amax
    y = fp8(spike).float()
    exact = spike @ w.t()
    # this step the spike saturates (clamped to about 4, the scale's expectation): row 0 is mostly wrong
    assert sqnr(exact[0], y[0]) < 3
    assert torch.isfinite(y).all()
    assert layer.amax_pending[0] == 1000.0
    y.sum().backward()
    conversion.after_step()
    assert layer.amax_history[0, 0] == 1000.0
    assert layer.scale[0] == pytest.approx(448 / 1000.0)
    y = fp8(spike).float()  # the next step represents it
    assert sqnr(exact[0], y[0]) > 18


def _backward_autocast(mode: str):
    """torch's compiled-backward autocast setting for a test (a torch without the setting: nothing)."""
    config = torch._functorch.config
    has = "backward_pass_autocast" in config.get_config_copy()
    return config.patch(backward_pass_autocast=mode) if has else contextlib.nullcontext()


@pytest.mark.parametrize("recipe", RECIPES)
def test_compiled_fp8_linear_matches_eager(recipe):
    # torch's default for the compiled backward under autocast, whatever a compiled run earlier in this process
    # set (mixprec.train.parallelize sets "off"; see the xfail test below)
    with _backward_autocast("same_as_forward"):
        _compiled_matches_eager(recipe)


def _compiled_matches_eager(recipe):
    _, eager = pair(recipe, K=256, N=256)
    compiled = copy.deepcopy(eager)
    compiled[0].forward = torch.compile(compiled[0].forward)
    x, grad = torch.randn(128, 256), torch.randn(128, 256)
    y_e, dx_e, dw_e = run(eager, x, grad, autocast=True)
    y_c, dx_c, dw_c = run(compiled, x, grad, autocast=True)
    # Inductor may fuse the casts and reorder the FP32 sums: the same FP8 values, FP32-rounding differences
    for e, c in ((y_e, y_c), (dx_e, dx_c), (dw_e, dw_c)):
        assert sqnr(e, c) > 40
    if RECIPES[recipe].delayed:  # the amaxes recorded in the compiled forward and backward
        torch.testing.assert_close(compiled[0].amax_pending, eager[0].amax_pending)


@pytest.mark.slow  # cold (an empty Inductor cache) over 20 s beyond its code generation
@pytest.mark.skipif(not torch.__version__.startswith("2.13"), reason="found and measured on torch 2.13 only")
@pytest.mark.xfail(strict=True, raises=torch._inductor.exc.InductorError,
                   reason="torch 2.13's Inductor CPU codegen fails an assertion ({y0: 128, y1: 2, y2: 128}, {y0: 256, "
                          "y1: 1, y2: 128}) compiling a block-wise FP8 Linear's backward outside autocast at 128 tokens "
                          "x 256 outputs (256 x 512 x 384 compiles); found 2026-11-27, not fixed yet")
def test_compiled_blockwise_backward_outside_autocast():
    # what mixprec's compiled training sets (mixprec.train.parallelize: the compiled backward outside autocast, as
    # eager's): a known failure recorded here so that it is seen, and the day it passes, seen too
    torch._dynamo.reset()
    _, eager = pair("blockwise", K=256, N=256)
    eager[0].forward = torch.compile(eager[0].forward)
    with _backward_autocast("off"):
        run(eager, torch.randn(128, 256), torch.randn(128, 256), autocast=True)


def test_the_conversion_names_each_gemms_kernel():
    """The startup line's kernel per GEMM (the CPU twin of test_gpu.py's audit check): on CUDA
    row-wise runs the route measured faster for its shape, tensor-wise's forward keeps
    fast accumulation on torch's kernel, block-wise goes through the registered op."""
    def names(recipe: str, device: str, emulated=()):
        routes = {g: ("no kernel" if g in emulated else None) for g in GEMMS}
        return Conversion(RECIPES[recipe], routes=routes, device=device).kernels()

    assert set(names("rowwise", "cuda").values()) == {KERNELS["rowwise-after"]}
    assert set(names("rowwise", "cpu").values()) == {KERNELS["rowwise"]}
    assert set(names("tensorwise", "cuda").values()) == {KERNELS["tensorwise"]}
    assert set(names("blockwise", "cuda").values()) == {KERNELS["blockwise"]}
    mixed = names("blockwise", "cpu", emulated=GEMMS[1:])
    assert mixed[GEMMS[0]] == KERNELS["blockwise"] and mixed[GEMMS[2]] == "emulated"
    assert "forward: torch._scaled_mm row-wise, or with unit scales" in Conversion(
        RECIPES["rowwise"], routes={g: None for g in GEMMS}, device="cuda").describe()
