"""The audit on every mode in one process, and on purpose-broken policies."""

import json

import pytest
import torch

from conftest import tiny_args
from mixprec.cli import main
from mixprec.precision import Policy
from mixprec.precision.presets import PRESETS


def audit(tmp_path, text_file, *extra) -> tuple[int, dict]:
    args = tiny_args(tmp_path / "unused", text_file, *extra)
    args[0] = "audit"
    return main([*args, "--json"])


@pytest.mark.parametrize("preset", ["fp32", "bf16-mixed", "bf16-true", "fp16-mixed", "fp16-master", "bf16-master",
                                    "fp16-true"])
def test_every_mode_keeps_its_promise(tmp_path, text_file, capsys, preset):
    assert audit(tmp_path, text_file, "--precision.preset", preset) == 0
    report = json.loads(capsys.readouterr().out)
    stages = {r["stage"]: r for r in report["stages"]}
    assert report["ok"] and report["precision"] == preset
    low = "float32" if preset == "fp32" else ("float16" if "fp16" in preset else "bfloat16")
    assert stages["matmul output"]["observed"] == [low]  # computed in the promised dtype, never silently FP32
    assert stages["softmax"]["observed"] == ["float32"] and stages["loss"]["observed"] == ["float32"]
    if preset in ("fp16-master", "bf16-master"):
        assert stages["master weights"]["observed"] == ["float32"]
        assert stages["stored parameters"]["observed"] == sorted(["float32", low])  # norms stay FP32


def test_a_module_cast_behind_the_policys_back_fails(tmp_path, text_file, capsys, monkeypatch):
    setup = Policy.setup

    def sneaky(self, model, optimizer=None, **settings):
        out = setup(self, model, optimizer, **settings)
        model.layers[0].feed_forward.to(torch.bfloat16)  # not through the policy
        return out

    monkeypatch.setattr(Policy, "setup", sneaky)
    assert audit(tmp_path, text_file, "--precision.preset", "bf16-mixed") == 1
    stages = {r["stage"]: r for r in json.loads(capsys.readouterr().out)["stages"]}
    assert not stages["stored parameters"]["ok"] and stages["stored parameters"]["observed"] == ["bfloat16", "float32"]
    assert not stages["optimizer states"]["ok"]


def test_silent_fp32_compute_fails(tmp_path, text_file, capsys, monkeypatch):
    # a policy that promises BF16 compute but never casts: the failure TorchTitan users hit
    monkeypatch.setattr(Policy, "autocast", lambda self, device_type=None: torch.autocast("cpu", enabled=False))
    assert audit(tmp_path, text_file, "--precision.preset", "bf16-mixed") == 1
    stages = {r["stage"]: r for r in json.loads(capsys.readouterr().out)["stages"]}
    assert stages["matmul output"]["observed"] == ["float32"] and not stages["matmul output"]["ok"]


def test_fused_attention_is_reported_instead_of_its_hidden_softmax(tmp_path, text_file, capsys):
    assert audit(tmp_path, text_file, "--precision.preset", "bf16-mixed", "--model.attention", "sdpa") == 0
    stages = {r["stage"]: r for r in json.loads(capsys.readouterr().out)["stages"]}
    assert stages["fused attention output (SDPA)"]["observed"] == ["bfloat16"]
    assert stages["softmax"]["promised"] is None and stages["softmax"]["observed"] == []


@pytest.mark.parametrize("preset", ["fp8-tensorwise", "fp8-delayed", "fp8-rowwise", "fp8-blockwise"])
def test_every_fp8_recipe_runs_its_planned_layers_in_fp8_and_nothing_else(tmp_path, text_file, capsys, preset):
    assert audit(tmp_path, text_file, "--precision.preset", preset) == 0
    report = json.loads(capsys.readouterr().out)
    stages = {r["stage"]: r for r in report["stages"]}
    assert stages["narrow layers (forward GEMMs in float8 or e2m1)"]["observed"] == ["14 ran"]  # 7 projections x 2 blocks
    assert stages["FP8 backward GEMMs"]["observed"] == ["56"]  # 2 per layer and micro-batch, 2 micro-batches
    assert stages["matmul output"]["observed"] == ["bfloat16"]  # attention and the output layer stay bf16
    assert any("output left in bfloat16" in n for n in report["notes"])
    grads = "float8_e4m3fn" if preset in ("fp8-rowwise", "fp8-blockwise") else "float8_e5m2"
    assert grads in stages["FP8 backward operands"]["observed"]


AUDITED = ["fp32", "bf16-mixed", "bf16-true", "fp16-mixed", "fp16-master", "bf16-master", "fp16-true",
           "fp8-tensorwise", "fp8-delayed", "fp8-rowwise", "fp8-blockwise", "bf16-kahan", "bf16-sr", "mxfp8", "nvfp4",
           "mxfp4", "bf16-mixed-8bit", "bf16-kahan-8bit"]


def test_every_preset_the_help_lists_is_audited(capsys):
    import re

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    listed = re.search(r"--precision.preset STR (.*?), or an alias", text).group(1).split(", ")
    assert set(listed) == set(AUDITED), listed


@pytest.mark.parametrize("preset, narrow", [("bf16-kahan", None), ("bf16-sr", None), ("mxfp8", "14 float8 1x32 tiles"),
                                            ("nvfp4", "7 e2m1 1x16 tiles"), ("mxfp4", "14 e2m1 1x32 tiles"),
                                            ("bf16-mixed-8bit", None), ("bf16-kahan-8bit", None)])
def test_the_update_and_microscaled_presets_keep_their_promise(tmp_path, text_file, capsys, preset, narrow):
    assert audit(tmp_path, text_file, "--precision.preset", preset) == 0
    report = json.loads(capsys.readouterr().out)
    stages = {r["stage"]: r for r in report["stages"]}
    assert report["ok"] and report["precision"] == preset
    if preset.endswith("8bit"):  # each state tensor's format and block size, observed against the spec
        states = stages["optimizer state formats (per tensor)"]
        assert states["ok"] and states["observed"] == ["8bit (blocks of 256) x11", "fp32 x10"]
        assert stages["optimizer states"]["observed"] == ["float32", "uint8"]
        assert stages["stored parameters"]["observed"] == (["bfloat16"] if "kahan" in preset else ["float32"])
        return
    if narrow is None:
        assert stages["stored parameters"]["observed"] == ["bfloat16"]
        return
    # what ran, seen through the operators: the element format and the blocks of the input's scales
    assert narrow in stages["Linear layers by compute (per module)"]["observed"]
    assert stages["Linear layers by compute (per module)"]["ok"]
    fp4 = "float4_e2m1fn_x2" if preset != "mxfp8" else "float8_e4m3fn"
    assert stages["FP8 forward operands"]["observed"] == [fp4]


def test_moments_stored_in_another_format_than_the_spec_says_fail(tmp_path, text_file, capsys, monkeypatch):
    setup = Policy.setup

    def everything_quantized(self, model, optimizer=None, **settings):
        model, optimizer = setup(self, model, optimizer, **settings)
        optimizer.kept_fp32.clear()  # behind the spec's back: the norms and the embedding in 8 bits too
        return model, optimizer

    monkeypatch.setattr(Policy, "setup", everything_quantized)
    assert audit(tmp_path, text_file, "--precision.preset", "bf16-mixed-8bit") == 1
    report = json.loads(capsys.readouterr().out)
    row = {r["stage"]: r for r in report["stages"]}["optimizer state formats (per tensor)"]
    assert not row["ok"] and row["observed"] == ["8bit (blocks of 256) x21"]
    assert any("tok_embeddings.weight: moments promised in fp32, stored in 8bit" in n for n in report["notes"])


def test_a_microscaled_layer_whose_recipe_is_swapped_behind_the_plans_back_fails(tmp_path, text_file, capsys,
                                                                                 monkeypatch):
    import dataclasses

    from mixprec.narrow.formats.mx import MXRecipe

    setup = Policy.setup

    def swaps(self, model, optimizer=None, **settings):
        out = setup(self, model, optimizer, **settings)
        layer = model.layers[0].attention.wq
        layer.plan = dataclasses.replace(layer.plan, recipe=MXRecipe.from_name("mxfp4"))  # not through the policy
        return out

    monkeypatch.setattr(Policy, "setup", swaps)
    assert audit(tmp_path, text_file, "--precision.preset", "mxfp8") == 1
    report = json.loads(capsys.readouterr().out)
    stages = {r["stage"]: r for r in report["stages"]}
    assert not stages["Linear layers by compute (per module)"]["ok"]
    assert "module layers.0.attention.wq: promised float8 1x32 tiles (" in " ".join(report["notes"])
    assert "its forward GEMMs ran in e2m1 1x32 tiles" in " ".join(report["notes"])


def test_a_layer_quantised_behind_the_plans_back_fails(tmp_path, text_file, capsys, monkeypatch):
    # the failure two public projects shipped: a layer in FP8 that the plan does not list
    from mixprec.narrow import convert as convert_module

    real = convert_module.convert_to_fp8

    def adds_one(*args, modules, **kwargs):  # converts a layer the layout left out
        return real(*args, modules={**modules, "layers.1.feed_forward.w2": None}, **kwargs)

    monkeypatch.setattr("mixprec.precision.conversion.convert_to_fp8", adds_one)
    assert audit(tmp_path, text_file, "--precision.preset", "fp8-tensorwise",
                 "--fp8.filter_fqns", "layers.1.feed_forward.w2") == 1
    report = json.loads(capsys.readouterr().out)
    stages = {r["stage"]: r for r in report["stages"]}
    assert not stages["narrow layers (forward GEMMs in float8 or e2m1)"]["ok"]
    assert "fp8: layers.1.feed_forward.w2 ran in FP8 but the plan leaves it out" in report["notes"]
    assert not stages["Linear layers by compute (per module)"]["ok"]
    assert any(n.startswith("module layers.1.feed_forward.w2: promised bfloat16") for n in report["notes"])


def test_a_planned_layer_that_ran_in_bf16_fails(tmp_path, text_file, capsys, monkeypatch):
    from mixprec.narrow import convert as convert_module

    real = convert_module.convert_to_fp8

    def undoes_one(model, *args, **kwargs):
        conversion = real(model, *args, **kwargs)
        fp8 = model.layers[0].attention.wq
        plain = torch.nn.Linear(fp8.in_features, fp8.out_features, bias=False)
        plain.weight = fp8.weight
        model.layers[0].attention.wq = plain
        return conversion

    monkeypatch.setattr("mixprec.precision.conversion.convert_to_fp8", undoes_one)
    assert audit(tmp_path, text_file, "--precision.preset", "fp8-rowwise") == 1
    report = json.loads(capsys.readouterr().out)
    assert "fp8: layers.0.attention.wq was planned for FP8 but its forward GEMM ran in bfloat16" in report["notes"]


def test_block_wise_gemms_on_torchs_kernel_are_counted(tmp_path, text_file, capsys, monkeypatch):
    # On CUDA a block-wise GEMM of whole tiles (here each layer's weight gradient: 128 tokens a micro-batch)
    # runs torch's kernel inside mixprec::blockwise_scaled_mm, an operator whose insides a dispatch mode does
    # not see: the audit counted 2 of each layer's 4 backward FP8 GEMMs there (H100, 2026-11-26). CUDA's routes
    # on this CPU, which has no block-wise kernel: the kernel's result stubbed (the audit checks formats, not values)
    from mixprec.narrow.gemm import fp8 as gemm
    from mixprec.narrow.linear import fp8 as linear

    routes = linear.FP8Linear.routes
    monkeypatch.setattr(linear.FP8Linear, "routes", staticmethod(lambda r, d, c: dict.fromkeys(routes(r, d, c))))
    ran = []

    def kernel(a, b, scale_a, kind_a, scale_b, kind_b, output_dtype):
        ran.append((a.dtype, b.dtype))
        return torch.zeros(a.shape[0], b.shape[1], dtype=output_dtype)

    monkeypatch.setattr(gemm.F, "scaled_mm", kernel)
    args = tiny_args(tmp_path / "unused", text_file, "--precision.preset", "fp8-blockwise")
    args[0] = "audit"
    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert ran and set(ran) == {(torch.float8_e4m3fn, torch.float8_e4m3fn)}
    (backward,) = [r for r in report["stages"] if r["stage"] == "FP8 backward GEMMs"]
    assert backward["ok"] and backward["observed"] == backward["promised"], backward


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_the_moe_flavor_keeps_its_promise_in_every_preset(tmp_path, text_file, capsys, preset):
    # each experts module's GEMMs in the preset's recipe (or the base mode, with why), the routers in float32,
    # and the rows each expert received in the audited step (2 micro-batches of 4 x 32 tokens, 2 experts each)
    assert audit(tmp_path, text_file, "--model.flavor", "moe-debug", "--precision.preset", preset) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"], [r for r in report["stages"] if not r["ok"]]
    stages = {r["stage"]: r for r in report["stages"]}
    assert stages["experts modules by compute (per module)"]["ok"]
    tokens = [n for n in report["notes"] if "tokens per expert in the audited step" in n]
    assert len(tokens) == 2
    for note in tokens:
        counts = json.loads(note.split("audited step ")[1].split(" (")[0])
        assert len(counts) == 8 and sum(counts) == 2 * 4 * 32 * 2
    recipe = PRESETS[preset].fp8
    if recipe is not None and not recipe.delayed:
        assert stages["narrow experts backward GEMMs"]["ok"]
        assert any("gate_up_proj: forward" in n and "down_proj: forward" in n for n in report["notes"])
