"""mixprec compare on the debug flavor."""

import json
import math

import pytest

from conftest import tiny_args
from mixprec.cli import main


def compare(folder, text_file, presets, *extra) -> int:
    args = tiny_args(folder, text_file, *extra)
    return main(["compare", "--presets", presets, *args[1:]])


@pytest.mark.slow
def test_two_presets_write_every_file_with_sane_values(tmp_path, text_file):
    assert compare(tmp_path, text_file, "fp32,bf16-mixed,bf16-kahan-8bit", "--metrics.plot", "true") == 0
    report = json.loads((tmp_path / "compare.json").read_text())
    base, bf16, eight = report["presets"]
    assert eight["preset"] == "bf16-kahan-8bit" and eight["passed"] and abs(eight["loss_diff"]) < 0.01
    assert report["baseline"] == "fp32" and base["loss_diff"] == 0 and base["speedup"] == 1
    assert abs(bf16["loss_diff"]) < 0.01 and bf16["passed"] and bf16["tokens_per_sec"] > 0
    assert bf16["memory_ratio"] > 0 and bf16["overflow_rate"] == 0
    assert bf16["incidents"] == 0 and bf16["rewinds"] == 0  # the stability guard ran and saw nothing
    assert "| bf16-mixed |" in (tmp_path / "compare.md").read_text()
    for png in ("loss_curves.png", "speed_memory.png"):
        assert (tmp_path / png).stat().st_size > 5_000
    # each preset is its own run, on the same data and initialisation
    first = [json.loads(line) for line in (tmp_path / "fp32" / "metrics.jsonl").read_text().splitlines()][0]
    other = [json.loads(line) for line in (tmp_path / "bf16-mixed" / "metrics.jsonl").read_text().splitlines()][0]
    assert abs(first["loss"] - other["loss"]) / first["loss"] < 1e-2


@pytest.mark.slow
def test_a_preset_that_overflows_too_often_fails(tmp_path, text_file):
    # a 1e9 loss scale overflows float16 for the first steps: far above the 10% threshold
    assert compare(tmp_path, text_file, "fp32,fp16-mixed", "--loss_scale.init_scale", "1e9", "--loss_scale.max_scale",
                   "1e9", "--loss_scale.fallback_after", "0", "--metrics.plot", "false") == 1
    fp16 = json.loads((tmp_path / "compare.json").read_text())["presets"][1]
    assert not fp16["passed"] and any(f.startswith("overflow rate") for f in fp16["failures"])


@pytest.mark.slow
def test_a_diverged_preset_fails(tmp_path, text_file):
    # fp16-true at a learning rate of 1e4: the first update puts float16 weights near their range,
    # the next forward overflows to NaN on every CPU (eps 1e-8 alone diverged to NaN on some CPUs
    # only: an AMX/AVX512-FP16 machine stayed finite). The stability guard, off here, would rewind.
    assert compare(tmp_path, text_file, "fp32,fp16-true", "--metrics.plot", "false", "--stability.enable", "false",
                   "--training.lr", "1e4") == 1
    fp16 = json.loads((tmp_path / "compare.json").read_text())["presets"][1]
    assert not fp16["passed"] and "validation loss is nan" in fp16["failures"][0]


def test_bad_presets_are_one_line(tmp_path, text_file, capsys):
    assert compare(tmp_path, text_file, "fp32") == 2
    assert "two or more different presets" in capsys.readouterr().err
    assert compare(tmp_path, text_file, "fp32,fp99") == 2


def test_a_preset_that_gave_up_as_unstable_fails():
    from mixprec.config import Compare
    from mixprec.train.compare import judge, to_markdown

    def summary(loss, **extra):
        return {"final_train_loss": loss, "final_val_loss": loss, "val_perplexity": math.exp(loss),
                "overflow_rate": 0.0, "tokens_per_sec": 100.0, "peak_memory_bytes": 1, "param_bytes": 1,
                "optimizer_state_bytes": 1, "skipped_steps": 0, "fallback_triggered": False,
                "precision_final": "x", "steps": 40, "stability": {"incidents": 0, "rewinds": 0}, **extra}

    unstable = summary(math.nan, stopped_unstable=True, stability={"incidents": 3, "rewinds": 2})
    report = judge({"fp32": summary(2.0), "fp16-true": unstable}, Compare())
    row = report["presets"][1]
    assert not report["passed"] and row["failures"] == ["unstable: gave up after 2 rewinds at step 40"]
    assert "| 3 (2) | FAIL: unstable" in to_markdown(report)


@pytest.mark.slow
def test_an_moe_flavor_compares_with_its_experts_flops_counted(tmp_path, text_file):
    assert compare(tmp_path, text_file, "bf16-mixed,fp8-rowwise", "--model.flavor", "moe-debug",
                   "--metrics.plot", "true") == 0
    report = json.loads((tmp_path / "compare.json").read_text())
    fp8 = report["presets"][1]
    assert fp8["passed"] and abs(fp8["loss_diff"]) < 0.01
    # the experts' GEMMs (a token's top-2 of 8) are counted in the recipe's share, not the base's
    assert fp8["gemm_flops_by_format"]["fp8-rowwise"] > 0.75
    assert (tmp_path / "loss_curves.png").stat().st_size > 5_000
