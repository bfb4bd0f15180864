"""mixprec plan: the measurement against what an FP8 Linear computes, the choosing rule, the
command line end to end (plan, train on the plan, audit the plan) and its bad input."""

import json
import tomllib

import pytest
import torch

import mixprec
from conftest import tiny_args
from mixprec.cli import main
from mixprec.narrow.linear.fp8 import FP8Linear, Plan
from mixprec.narrow.formats.recipe import RECIPES
from mixprec.narrow.formats.scaling import sqnr
from mixprec.models.llama import build_model, model_args
from mixprec.plan.choose import H100_TFLOPS, choose, floors, modeled_speedups
from mixprec.plan.config import PlanConfig
from mixprec.plan.measure import measure
from mixprec.narrow.linear.fp8 import linear_class

FLOOR = floors(PlanConfig())
W2 = "layers.1.feed_forward.w2"


def tensors(m=256, k=128, n=192, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen) * 0.05,
            torch.randn(m, n, generator=gen) * 1e-3)


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4", "mxfp4"])
def test_microscaled_figures_are_those_of_its_linear_on_the_same_tensors(recipe):
    x, w, dy = tensors()
    r = RECIPES[recipe]
    layer = linear_class(r).from_linear(torch.nn.Linear(128, 192, bias=False), Plan(r, r.tiles, torch.bfloat16,
                                                                                     (False, False, False)))
    layer.weight = torch.nn.Parameter(w.clone())
    xr = x.clone().requires_grad_()
    y = layer(xr)
    y.backward(dy.to(y.dtype))
    got = measure(x, w, dy, r, torch.bfloat16)
    want = (x @ w.t(), dy @ w, dy.t() @ x)
    for name, ref, out in zip(("forward", "input_gradient", "weight_gradient"), want, (y, xr.grad, layer.weight.grad)):
        assert got[f"{name}_db"] == round(sqnr(ref, out.float()), 2)
    # e4m3 elements: ~28 dB; e2m1: 13-19 dB
    low, high = (24, 32) if recipe == "mxfp8" else (11, 20)
    assert all(low < got[f"{g}_db"] < high for g in ("forward", "input_gradient", "weight_gradient"))
    # E8M0 scales rounded up saturate nothing; NVFP4's e4m3 block scale, rounded to nearest, can
    # land below amax / 6 and clip the block's top. e2m1's smallest step (1/12 of the block's
    # top) flushes ~12% of normal values to zero: more than the planner's 1% floor accepts
    assert (max(got["saturated"].values()) > 0) == (recipe == "nvfp4")
    assert (max(got["flushed"].values()) > 0.05) == (recipe != "mxfp8")


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_the_figures_are_those_of_an_fp8_linear_on_the_same_tensors(recipe):
    x, w, dy = tensors()
    r = RECIPES[recipe]
    layer = FP8Linear.from_linear(torch.nn.Linear(128, 192, bias=False), Plan(r, r.tiles, torch.bfloat16,
                                                                               (False, False, False)))
    layer.weight = torch.nn.Parameter(w.clone())
    xr = x.clone().requires_grad_()
    y = layer(xr)
    y.backward(dy.to(y.dtype))
    want = (x @ w.t(), dy @ w, dy.t() @ x)  # FP32 GEMMs: the reference
    got = measure(x, w, dy, r, torch.bfloat16)
    for name, ref, out in zip(("forward", "input_gradient", "weight_gradient"), want, (y, xr.grad, layer.weight.grad)):
        assert got[f"{name}_db"] == round(sqnr(ref, out.float()), 2)
    # FP8 keeps 3 (e4m3) or 2 (e5m2) mantissa bits: 25-35 dB; bfloat16's 8 bits: about 50 dB
    assert all(20 < got[f"{g}_db"] < 40 for g in ("forward", "input_gradient", "weight_gradient"))
    assert measure(x, w, dy, torch.bfloat16, torch.bfloat16)["forward_db"] > 45
    # e5m2 gradients (tensorwise) lose a bit more than e4m3 (rowwise and blockwise)
    assert (got["input_gradient_db"] < 26) == (recipe == "tensorwise")


def test_flushed_and_saturated_shares_are_counted():
    x, w, dy = tensors()
    x[0, 0] = 1e6  # one outlier: a tensor-wise scale for it flushes the small values of every row
    tiny = measure(x, w, dy, RECIPES["tensorwise"], torch.bfloat16)
    rows = measure(x, w, dy, RECIPES["rowwise"], torch.bfloat16)
    assert tiny["flushed"]["input"] > 0.5 and rows["flushed"]["input"] < 0.01  # only row 0 suffers row-wise
    assert tiny["saturated"] == {"input": 0.0, "weight": 0.0, "output_gradient": 0.0}  # current scaling never clamps
    # the whole-tensor SQNR does not show it (the outlier's row dominates the signal): the share does
    assert tiny["forward_db"] > 25
    fmt, why = choose({"fp8-tensorwise": tiny}, "bfloat16", FLOOR, "coverage")
    assert fmt == "bfloat16" and "flushes or saturates more than 1% of the input's values" in why
    assert choose({"fp8-tensorwise": tiny, "fp8-rowwise": rows}, "bfloat16", FLOOR, "coverage")[0] == "fp8-rowwise"


def figures(fwd, dgrad, wgrad):
    none = {"input": 0.0, "weight": 0.0, "output_gradient": 0.0}
    return {"forward_db": fwd, "input_gradient_db": dgrad, "weight_gradient_db": wgrad, "flushed": none,
            "saturated": none}


def test_coverage_takes_the_most_accurate_candidate_that_meets_every_floor():
    measured = {"fp8-tensorwise": figures(30, 24, 24), "fp8-rowwise": figures(29, 29, 29),
                "fp8-blockwise": figures(24.9, 40, 40)}
    fmt, why = choose(measured, "bfloat16", FLOOR, "coverage")
    assert fmt == "fp8-rowwise" and "2 of 3 candidates meet the floors" in why  # blockwise misses 25 dB forward
    fmt, why = choose({"fp8-rowwise": figures(30, 17.5, 30)}, "bfloat16", FLOOR, "coverage")
    assert fmt == "bfloat16" and "input gradient 17.5 dB < 18" in why


def test_speed_takes_only_a_real_speed_up():
    measured = {"fp8-tensorwise": figures(30, 24, 24), "fp8-rowwise": figures(29, 29, 29)}
    assert choose(measured, "bfloat16", FLOOR, "speed", {"fp8-tensorwise": 1.3, "fp8-rowwise": 1.6})[0] == "fp8-rowwise"
    fmt, why = choose(measured, "bfloat16", FLOOR, "speed", {"fp8-tensorwise": 0.8, "fp8-rowwise": None})
    assert fmt == "bfloat16" and "fp8-rowwise: emulated" in why and "0.80x" in why
    modeled = modeled_speedups(["fp8-tensorwise", "fp8-rowwise", "fp8-blockwise"], "bfloat16")
    assert modeled["fp8-rowwise"] == H100_TFLOPS["fp8-rowwise"] / 730 and choose(
        measured, "bfloat16", FLOOR, "speed", modeled)[0] == "fp8-tensorwise"


def test_plan_precision_on_a_users_loop():
    policy = mixprec.Policy.from_preset("bf16-mixed")
    model = build_model(model_args("debug", 256), device=torch.device("cpu"), storage_dtype=torch.float32, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    policy.setup(model, optimizer)
    gen = torch.Generator().manual_seed(0)
    batches = [tuple(torch.randint(0, 256, (2, 4, 32), generator=gen).unbind(0)) for _ in range(3)]
    # 28.6 dB: about the middle of this model's forward figures at initialisation (28-29 dB)
    report = mixprec.plan_precision(model, policy, optimizer, batches, config=PlanConfig(forward_floor_db=28.6))
    rows = report["layer_rows"]
    assert len(rows) == 14 and "output" in report["header"]["left_out"]  # the head is never planned
    for row in rows.values():  # the floor decides: a layer goes to FP8 exactly when a candidate meets it
        best = max(row["measured"][c]["forward_db"] for c in PlanConfig().candidates)
        assert (row["format"] != "bfloat16") == (best >= 28.6), row
    assert report["header"]["layers_in_fp8"] == sum(row["format"] != "bfloat16" for row in rows.values())


def cli_args(folder, text_file, *extra):
    return [a if a != "train" else "plan" for a in tiny_args(folder, text_file, "--plan.steps", "3", *extra)]


def test_plan_then_train_on_it_then_audit_it(tmp_path, text_file, capsys):
    plan = tmp_path / "plan.toml"
    assert main(cli_args(tmp_path / "p", text_file, "--plan.out", str(plan))) == 0
    out = capsys.readouterr().out
    assert f"written to {plan}" in out and "left out: the output projection" in out
    data = tomllib.loads(plan.read_text())
    assert data["plan"]["base"] == "bf16-mixed" and data["plan"]["floors_db"]["forward"] == 25.0
    chosen = {fqn: t["format"] for fqn, t in data["layers"].items()}
    assert len(chosen) == 14 and set(data["layers"][W2]["measured"]) == {"bfloat16", *PlanConfig().candidates}
    assert not (tmp_path / "p" / "metrics.jsonl").exists()  # the planner's steps leave nothing behind
    # train on it: each layer computes in the plan's format
    assert main(tiny_args(tmp_path / "t", text_file, "--precision.plan", str(plan))) == 0
    summary = json.loads((tmp_path / "t" / "summary.json").read_text())
    assert summary["precision_plan"] == str(plan) and summary["fp8_layers"] == sum(
        f.startswith("fp8") for f in chosen.values())
    # the audit sees each layer run its planned format, forward and backward
    capsys.readouterr()
    audit = [a if a != "train" else "audit" for a in tiny_args(tmp_path / "a", text_file, "--precision.plan",
                                                                 str(plan))]
    assert main(audit + ["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    stages = {r["stage"]: r for r in report["stages"]}
    assert stages["Linear layers by compute (per module)"]["ok"] and stages["FP8 backward GEMMs (per module)"]["ok"]


def test_the_audit_fails_a_layer_that_ran_another_format_than_planned():
    policy = mixprec.Policy.from_preset("bf16-mixed", overrides=(f"{W2}=fp8-rowwise", "layers.0.*=fp8-blockwise"))
    model = build_model(model_args("debug", 256), device=torch.device("cpu"), storage_dtype=torch.float32, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    policy.setup(model, optimizer)
    layer = model.get_submodule(W2)
    tensorwise = RECIPES["tensorwise"]
    layer.plan = Plan(tensorwise, tensorwise.tiles, torch.bfloat16, (False, False, False))  # not what was planned
    gen = torch.Generator().manual_seed(0)
    batches = [tuple(torch.randint(0, 256, (2, 4, 32), generator=gen).unbind(0)) for _ in range(2)]
    report = mixprec.audit(model, policy, optimizer, batches)
    assert not report["ok"]
    notes = [n for n in report["notes"] if n.startswith(f"module {W2}:")]
    assert any("promised float8 rowwise" in n and "ran in float8 tensorwise" in n for n in notes), report["notes"]
    assert any("float8_e5m2" in n for n in notes)  # its backward took e5m2 gradients, rowwise promised e4m3


@pytest.mark.parametrize("content, words", [
    ('[layers."layers.9.attention.wq"]\nformat = "fp8-rowwise"\n', "no Linear layer 'layers.9.attention.wq'"),
    ('[layers."layers.0.attention.wq"]\nformat = "fp7-magic"\n', "unknown compute format 'fp7-magic'"),
    ('[layers."layers.0.attention.wq"\nformat = ', "not valid TOML"),
    ('[plan]\nbase = "bf16-mixed"\n', "no [layers] tables"),
    (None, "no such file"),
])
def test_a_bad_plan_file_is_one_line_and_exit_2(tmp_path, text_file, capsys, content, words):
    plan = tmp_path / "plan.toml"
    if content is not None:
        plan.write_text(content)
    assert main(tiny_args(tmp_path / "run", text_file, "--precision.plan", str(plan))) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1 and "precision.plan" in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("extra, words", [
    (("--plan.candidates", "fp8-delayed"), "cannot be planned from one step's tensors"),
    (("--plan.objective", "fastest"), "plan.objective: bad value 'fastest'"),
    (("--plan.measure_steps", "9"), "plan.measure_steps"),
    (("--precision.preset", "fp8-rowwise"), "already puts layers in FP8"),
])
def test_bad_plan_settings_are_one_line_and_exit_2(tmp_path, text_file, capsys, extra, words):
    plan = tmp_path / "plan.toml"
    assert main(cli_args(tmp_path / "p", text_file, "--plan.out", str(plan), *extra)) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1 and not plan.exists()


def test_objective_speed_times_this_device_and_never_counts_an_emulated_format(tmp_path, text_file, capsys):
    plan = tmp_path / "plan.toml"
    assert main(cli_args(tmp_path / "p", text_file, "--plan.out", str(plan), "--plan.objective", "speed")) == 0
    data = tomllib.loads(plan.read_text())
    assert data["plan"]["speed"].startswith("measured on this device")
    for fqn, layer in data["layers"].items():
        # torch has no block-wise scaled GEMM on a CPU: emulated, so no expected speed-up, never chosen
        assert "fp8-blockwise" not in layer.get("expected_speedup", {}) and layer["format"] != "fp8-blockwise"
        if layer["format"] != "bfloat16":
            assert layer["expected_speedup"][layer["format"]] > 1
    modeled = tmp_path / "h100.toml"
    assert main(cli_args(tmp_path / "q", text_file, "--plan.out", str(modeled), "--plan.objective", "speed",
                         "--plan.target", "h100")) == 0
    data = tomllib.loads(modeled.read_text())
    assert data["plan"]["speed"].startswith("modeled")
    assert {layer["format"] for layer in data["layers"].values()} == {"fp8-tensorwise"}  # the table's fastest


EXPERTS = ("layers.0.feed_forward.experts", "layers.1.feed_forward.experts")


def test_an_moes_experts_are_planned_measured_whole_and_trained_and_audited_as_planned(tmp_path, text_file, capsys):
    # moe-debug: each experts module measured on the step's routed tensors in fp8-rowwise and nvfp4; nvfp4 is not
    # offered to the last block (its keep_last_blocks); training on the plan runs each experts module as planned
    plan = tmp_path / "plan.toml"
    flags = ("--model.flavor", "moe-debug", "--training.seq_len", "64", "--training.local_batch_size", "8")
    assert main(cli_args(tmp_path / "p", text_file, *flags, "--plan.candidates", "fp8-rowwise,nvfp4",
                         "--plan.out", str(plan))) == 0
    rows = tomllib.loads(plan.read_text())["layers"]
    for fqn in EXPERTS:
        assert rows[fqn]["kind"] == "experts" and set(rows[fqn]["measured"]) == {"fp8-rowwise", "nvfp4"}
        assert sum(rows[fqn]["tokens_per_expert"]) == 8 * 64 * 2  # top-2 of 8 experts
        assert rows[fqn]["measured"]["fp8-rowwise"]["forward_db"] > rows[fqn]["measured"]["nvfp4"]["forward_db"]
    assert "not offered: nvfp4 keeps the last 1 of 2 decoder blocks" in rows[EXPERTS[1]]["reason"]
    assert rows[EXPERTS[0]]["format"] == "fp8-rowwise"  # 24.5 dB forward measured: the floor less 3 dB is 22
    capsys.readouterr()
    audit = [a if a != "train" else "audit" for a in tiny_args(tmp_path / "a", text_file, *flags,
                                                                 "--precision.plan", str(plan))]
    assert main(audit + ["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    stages = {r["stage"]: r for r in report["stages"]}
    assert stages["experts modules by compute (per module)"]["ok"]
    assert {rows[f]["format"] for f in EXPERTS} == {"fp8-rowwise"}
    assert stages["experts modules by compute (per module)"]["observed"] == ["2 float8"]


def test_experts_with_few_tokens_stay_in_the_base_mode_and_say_why(tmp_path, text_file, capsys):
    plan = tmp_path / "plan.toml"
    assert main(cli_args(tmp_path / "p", text_file, "--model.flavor", "moe-debug", "--plan.min_expert_tokens",
                         "1000", "--plan.out", str(plan))) == 0
    rows = tomllib.loads(plan.read_text())["layers"]
    for fqn in EXPERTS:
        assert rows[fqn]["format"] == "bfloat16"
        assert "rows in the measured step (below plan.min_expert_tokens 1000)" in rows[fqn]["reason"]


def test_an_experts_override_to_a_format_experts_cannot_take_is_one_line(tmp_path, text_file, capsys):
    code = main(tiny_args(tmp_path, text_file, "--model.flavor", "moe-debug", "--precision.override",
                          "*.experts=float32"))
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert "experts module 'layers.0.feed_forward.experts' cannot compute in float32" in err and "\n" not in err
