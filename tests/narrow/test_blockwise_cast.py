"""mixprec.narrow.formats.blockwise_cast: where its Triton kernel applies, and the kernel itself bit for
bit against the pure-PyTorch casts in Triton's interpreter on the CPU
(tests/narrow/blockwise_cast_cases.py, in a process of its own: TRITON_INTERPRET is read when
Triton is imported, and a process that compiled for a GPU must not run interpreted)."""

import pytest
import torch
from interpreted import run_interpreted

from mixprec.narrow.formats import blockwise_cast
from mixprec.narrow.formats.recipe import E4M3


@pytest.mark.slow
def test_the_kernel_equals_the_reference_casts_in_tritons_interpreter():
    run_interpreted("blockwise_cast_cases.py", 6, timeout=600)


def test_where_it_applies():
    x = torch.zeros(256, 128)
    tiles = ((1, 128), (128, 1))
    assert not blockwise_cast.applies(x, E4M3, tiles, False)  # a CPU tensor: the reference
    assert blockwise_cast.applies(x, E4M3, tiles, False, triton=True)
    assert not blockwise_cast.applies(torch.zeros(200, 128), E4M3, tiles, False, triton=True)  # a partial tile
    assert not blockwise_cast.applies(x, torch.float8_e5m2, tiles, False, triton=True)
    assert not blockwise_cast.applies(x, E4M3, tiles, True, triton=True)  # power-of-two scales
    assert not blockwise_cast.applies(x, E4M3, ((1, 0), (0, 1)), False, triton=True)


def test_the_probe_decides_where_the_kernel_is_used(monkeypatch):
    x, tiles = torch.zeros(256, 128), ((1, 128), (128, 1))
    assert "CUDA only" in blockwise_cast.probe("cpu")
    monkeypatch.setitem(blockwise_cast._PROBED, "cpu", None)  # as where the probe passed
    assert blockwise_cast.applies(x, E4M3, tiles, False)


@pytest.mark.gpu
def test_the_kernel_compiles_and_equals_torchs_casts_on_cuda():
    # the CPU twin: test_the_kernel_equals_the_reference_casts_in_tritons_interpreter
    pytest.importorskip("triton")
    blockwise_cast._PROBED.pop("cuda", None)
    assert blockwise_cast.probe("cuda") is None
    x = torch.randn(256, 384, device="cuda")
    xq = blockwise_cast.quantize(x, E4M3, (1, 128))[0]
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")  # schema: FP8 inputs
    torch.library.opcheck(torch.ops.mixprec.blockwise_cast_transpose.default, (x,))
    torch.library.opcheck(torch.ops.mixprec.blockwise_recast_transposed.default, (xq.data, xq.scale_inv),
                          test_utils=utils)


def test_a_layer_converted_on_the_cpu_probes_the_kernel_where_it_is_moved(monkeypatch, caplog):
    # the probe runs at conversion for the conversion's device; a layer moved to another
    # (a model converted on the CPU or meta device, then moved to CUDA: the gpu twin below)
    # probes there when moved, before any step, and says what it found
    import logging

    from mixprec.narrow.convert import convert_to_fp8
    from mixprec.narrow.formats.recipe import FP8Recipe

    probed = []
    monkeypatch.setattr(blockwise_cast, "_PROBED", {})
    monkeypatch.setattr(blockwise_cast, "_probe", lambda device: probed.append(device) or None)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256, bias=False))
    convert_to_fp8(model, FP8Recipe.from_name("blockwise"), compute_dtype=torch.bfloat16)
    assert probed == []  # the CPU's block-wise GEMMs are emulated: conversion probes nothing
    with caplog.at_level(logging.INFO, logger="mixprec"):
        model.to("meta")  # nothing runs on the meta device
        assert probed == []
        model.to_empty(device="cpu")
        model.float()  # probed once per device
    assert probed == ["cpu"]
    assert "block-wise backward casts on cpu in one Triton kernel" in caplog.text


def test_policy_setup_probes_where_the_model_computes_now(monkeypatch):
    # fully_shard moves the parameters without Module._apply: setup asks again, outside any step
    from mixprec.precision import Policy

    probed = []
    monkeypatch.setattr(blockwise_cast, "_probe", lambda device: probed.append(device) or None)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256, bias=False), torch.nn.Linear(256, 256, bias=False))
    policy = Policy.from_preset("fp8-blockwise")
    policy.prepare_model(model)
    monkeypatch.setattr(blockwise_cast, "_PROBED", {})  # as on a device not probed at conversion
    policy.setup(model, torch.optim.AdamW(model.parameters()))
    assert probed == ["cpu"]


def test_a_layer_that_computes_on_another_device_chooses_its_gemm_routes_there(caplog, kernel_on_cpu):
    # converted for one device (routes chosen for it), then moved: each GEMM's route is chosen
    # again where the layer computes (a model converted on the CPU and moved to a GPU runs
    # torch's kernels there; they ran the CPU's emulated routes before, only warned), said once
    import dataclasses
    import logging

    from mixprec.precision import Policy

    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 64, bias=False))
    policy = Policy.from_preset("fp8-tensorwise")
    policy.prepare_model(model)  # for this CPU: torch's tensor-wise kernel for all three GEMMs
    conversion = policy.formats.conversions[0]
    layers = list(conversion.modules.values())
    assert all(m.plan.kernels == (True, True, True) and m.plan.device == "cpu" for m in layers)

    def as_converted_elsewhere():  # as if converted for a device whose routes were all emulated
        for m in layers:
            m.plan = dataclasses.replace(m.plan, kernels=(False, False, False), device="elsewhere")
        conversion.device = "elsewhere"

    as_converted_elsewhere()
    with caplog.at_level(logging.INFO, logger="mixprec"):
        model.to("cpu")  # Module.to applies to every parameter, on the same device too
    assert all(m.plan.kernels == (True, True, True) and m.plan.device == "cpu" for m in layers)
    assert "fp8: tensorwise layers converted for elsewhere compute on cpu: their GEMMs' routes chosen there " \
           "(forward: torch's kernel" in caplog.text
    as_converted_elsewhere()  # fully_shard moves parameters without _apply: setup's probe moves the conversion
    conversion.move("cpu")
    assert conversion.device == "cpu" and all(why is None for why in conversion.routes.values())
    assert all(m.plan.kernels == (True, True, True) for m in layers)
    # the emulation a user asked for (fp8.emulate) stays on any device
    forced, other = Policy.from_preset("fp8-tensorwise", fp8_emulate=True), torch.nn.Sequential(torch.nn.Linear(64, 64))
    forced.prepare_model(other)
    (layer,) = forced.formats.conversions[0].modules.values()
    layer.plan = dataclasses.replace(layer.plan, device="elsewhere")
    other.to("cpu")
    assert layer.plan.emulated and layer.plan.kernels == (False, False, False)


def test_a_model_converted_on_the_meta_device_chooses_its_routes_where_it_is_materialised(kernel_on_cpu):
    # converted on meta without a device_type, the route probe ran a kernel on meta tensors
    # ("Tensor.item() cannot be called on meta tensors"); nothing runs there, so nothing is chosen there
    from mixprec.precision import Policy

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 64, bias=False))
    policy = Policy.from_preset("fp8-tensorwise")
    policy.prepare_model(model)
    conversion = policy.formats.conversions[0]
    layers = list(conversion.modules.values())
    assert conversion.device == "meta" and all(m.plan.kernels == (False, False, False) for m in layers)
    model.to_empty(device="cpu")
    for m in layers:
        torch.nn.init.normal_(m.weight)
    assert all(m.plan.kernels == (True, True, True) and m.plan.device == "cpu" for m in layers)
    policy.setup(model, torch.optim.AdamW(model.parameters()))
    assert conversion.device == "cpu" and all(why is None for why in conversion.routes.values())
    with policy.autocast():
        model(torch.randn(4, 64)).float().sum().backward()  # and it trains there
