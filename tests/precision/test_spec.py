"""Precision as data: specs, per-module overrides, their layout, and a spec no preset has."""

import json

import pytest
import torch

from conftest import run_train, tiny_args
from mixprec import UserError
from mixprec.analysis.memory import Setup, plan
from mixprec.cli import main
from mixprec.narrow.formats.recipe import RECIPES
from mixprec.models.llama import build_model, model_args
from mixprec.precision import Override, Policy, PrecisionSpec, register_preset, resolve
from mixprec.precision.presets import PRESETS

BF16, FP32 = torch.bfloat16, torch.float32


def test_every_preset_is_a_spec_and_resolves_per_module():
    model = build_model(model_args("debug", 256), device="cpu", storage_dtype=FP32, seed=0)
    for name, spec in PRESETS.items():
        layout = resolve(spec, model)
        linears = layout.linears()
        assert len(linears) == 15  # 7 projections x 2 blocks, and the output projection
        if spec.fp8 is not None:
            kept = {f for f in linears if f.startswith("layers.1.")} if spec.fp8.name == "nvfp4" else set()
            assert set(layout.fp8()) == set(linears) - {"output"} - kept, name  # nvfp4: the last 15% of 2 blocks
            assert "output projection" in layout.left_out()["output"]
        else:
            assert {m.compute for m in linears.values()} == {spec.param_dtype}, name


@pytest.mark.parametrize("share, kept", [(0.15, [6, 7]), (0.3, [5, 6, 7]), (0.0, [])])
def test_keep_last_blocks_keeps_the_last_decoder_blocks_in_the_base_mode(share, kept):
    from dataclasses import replace

    model = build_model(replace(model_args("debug", 256), n_layers=8), device="cpu", storage_dtype=FP32, seed=0)
    recipe = replace(RECIPES["nvfp4"], keep_last_blocks=share)
    layout = resolve(PrecisionSpec(FP32, BF16, fp8=recipe), model)
    base = {int(f.split(".")[1]) for f, m in layout.linears().items() if f != "output" and m.compute == BF16}
    assert sorted(base) == kept and len(layout.fp8()) == 7 * (8 - len(kept))
    if kept:
        why = layout.modules[f"layers.{kept[0]}.attention.wq"].why
        assert f"({len(kept)} of 8: layers.{kept[0]}-7) in bfloat16 (fp8.keep_last_blocks)" in why


def test_overrides_are_ordered_and_refused_with_one_line():
    spec = PrecisionSpec(FP32, BF16, fp8=RECIPES["tensorwise"],
                         overrides=("layers.0.feed_forward.*=float32", "layers.0.*=fp8-rowwise", "layers.1.*=bf16"))
    model = build_model(model_args("debug", 256), device="cpu", storage_dtype=FP32, seed=0)
    layout = resolve(spec, model).modules
    assert layout["layers.0.feed_forward.w1"].compute == FP32  # the first rule that matches decides
    assert layout["layers.0.attention.wq"].compute == RECIPES["rowwise"]
    assert layout["layers.1.attention.wq"].compute == BF16 and "layers.1.*=bfloat16" in layout["layers.1.attention.wq"].why
    with pytest.raises(UserError, match="a bfloat16 model computes in bfloat16"):
        PrecisionSpec(BF16, BF16, overrides=("layers.0.*=float32",))
    with pytest.raises(UserError, match="unknown compute format 'fp9'"):
        Override.parse("layers.*=fp9")
    with pytest.raises(UserError, match="accepted: PATTERN=FORMAT"):
        Override.parse("layers.0.*")


def test_a_new_spec_registered_trains_audits_and_plans_without_editing_mixprec(tmp_path, text_file, capsys):
    # bf16-mixed with FP8 in the MLP only and the first block's attention kept in float32: no preset has it
    spec = register_preset("bf16-mlp-fp8", PrecisionSpec(
        FP32, BF16, overrides=("*.feed_forward.*=fp8-rowwise", "layers.0.attention.*=float32"),
        summary="bf16-mixed, the MLP in FP8 (row-wise), block 0's attention in float32"))
    records = run_train(tmp_path / "run", text_file, "--precision.preset", "bf16-mlp-fp8")
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["fp8_layers"] == 6 and summary["precision"] == "bf16-mlp-fp8"
    capsys.readouterr()  # the training run's own lines
    args = tiny_args(tmp_path / "unused", text_file, "--precision.preset", "bf16-mlp-fp8")
    args[0] = "audit"
    assert main([*args, "--json"]) == 0
    stages = {r["stage"]: r for r in json.loads(capsys.readouterr().out)["stages"]}
    assert stages["Linear layers by compute (per module)"]["observed"] == ["5 bfloat16", "4 float32",
                                                                          "6 float8 rowwise"]
    planned = plan(Setup(model_args("debug", 256), spec, 4, 32))["bytes"]
    bf16 = plan(Setup(model_args("debug", 256), "bf16-mixed", 4, 32))["bytes"]
    assert planned["autocast_weight_copies"] < bf16["autocast_weight_copies"]  # FP8 and FP32 layers keep less


@pytest.mark.parametrize("promised, ran", [("float32", "bfloat16"), ("fp8-tensorwise", "bfloat16")])
def test_the_audit_fails_a_module_that_ran_another_format(tmp_path, text_file, capsys, monkeypatch, promised, ran):
    # the layout promises `promised` for layers.1.feed_forward.w2; the compute override is never applied
    from mixprec.precision import conversion

    monkeypatch.setattr(conversion, "_compute_in", lambda forward, dtype, device_type: forward)
    real = conversion.convert_to_fp8
    monkeypatch.setattr(conversion, "convert_to_fp8", lambda *a, modules, **k: real(*a, modules={}, **k))
    args = tiny_args(tmp_path / "unused", text_file, "--precision.preset", "bf16-mixed",
                     "--precision.override", f"layers.1.feed_forward.w2={promised}")
    args[0] = "audit"
    assert main([*args, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    stages = {r["stage"]: r for r in report["stages"]}
    assert not stages["Linear layers by compute (per module)"]["ok"]
    assert any(n.startswith("module layers.1.feed_forward.w2: promised") and n.endswith(f"ran in {ran}")
               for n in report["notes"])


def test_toml_override_tables(tmp_path, text_file):
    config = tmp_path / "run.toml"
    config.write_text('[precision]\npreset = "bf16-mixed"\n[[precision.override]]\nmodules = "layers.0.*"\n'
                      'compute = "float32"\n')
    from mixprec.config import load_config
    from mixprec.train.policy import build_policy

    cfg = load_config(str(config))
    assert cfg.precision.override == ("layers.0.*=float32",)
    policy = build_policy(cfg.precision, cfg.training, cfg.loss_scale, cfg.fp8)
    assert [str(o) for o in policy.spec.overrides] == ["layers.0.*=float32"]


@pytest.mark.parametrize("preset, overrides", [("bf16-mixed", ("layers.0.*=float32",)),
                                               ("bf16-mixed", ("*.feed_forward.*=fp8-tensorwise",))])
def test_planned_peak_with_overrides_within_15_percent_of_measured(preset, overrides):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    from memory_planner import measured_peak

    measured = measured_peak("debug", preset, batch=8, seq_len=64, overrides=overrides)
    planned = plan(Setup(model_args("debug", 256), preset, 8, 64, overrides=overrides))["bytes"]["peak"]
    assert abs(planned / measured - 1) < 0.15


def test_policy_state_keeps_its_checkpoint_layout():
    # the keys checkpoints written before the precision spec hold, read back unchanged, and the
    # layers promoted out of FP8 (absent from older checkpoints: none)
    policy = Policy.from_preset("fp16-mixed")
    model = build_model(model_args("debug", 256), device="cpu", storage_dtype=FP32, seed=0)
    policy.setup(model, torch.optim.AdamW(model.parameters()))
    assert set(policy.state_dict()) == {"precision", "precision_final", "steps", "skipped", "nonfinite",
                                        "fallback_step", "monitor", "scaler", "fp8", "updates", "promoted"}
    assert set(policy.state_dict()["monitor"]) == {"overflows", "consecutive"}


def test_a_new_fp8_recipe_is_one_registration(tmp_path, text_file):
    # row-wise scales with e5m2 gradients: a recipe no preset has; its preset, [fp8] recipe and
    # per-module override name follow from the registry alone
    from mixprec.narrow.formats.recipe import E5M2, FP8Recipe, Granularity, register_recipe

    register_recipe(FP8Recipe("rowwise-e5m2", Granularity.ROWWISE, grad_dtype=E5M2, power_of_2_scales=True))
    records = run_train(tmp_path / "preset", text_file, "--precision.preset", "fp8-rowwise-e5m2")
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records)
    summary = json.loads((tmp_path / "preset" / "summary.json").read_text())
    assert summary["fp8_recipe"] == "rowwise-e5m2" and summary["fp8_layers"] == 14
    run_train(tmp_path / "table", text_file, "--precision.preset", "bf16-mixed", "--fp8.recipe", "rowwise-e5m2")
    assert json.loads((tmp_path / "table" / "summary.json").read_text())["fp8_recipe"] == "rowwise-e5m2"
    run_train(tmp_path / "override", text_file, "--precision.override", "*.feed_forward.*=fp8-rowwise-e5m2")
    assert json.loads((tmp_path / "override" / "summary.json").read_text())["fp8_layers"] == 6
