"""Re-planning during training (plan.interval): measured on live tensors, promoted below the
floor, recorded everywhere, and without changing the numbers of a run it does not repair."""

import json

from conftest import run_train

FP8 = ("--precision.preset", "fp8-rowwise", "--training.steps", "4")


def test_measuring_changes_no_number(tmp_path, text_file):
    plain = run_train(tmp_path / "plain", text_file, *FP8)
    watched = run_train(tmp_path / "watched", text_file, *FP8, "--plan.interval", "2")
    assert [r["loss"] for r in watched] == [r["loss"] for r in plain]  # hooks only keep tensors
    summary = json.loads((tmp_path / "watched" / "summary.json").read_text())
    assert summary["replanning"]["measurements"] == 2 and summary["promoted"] == {}  # every layer >= 25/18 dB


def test_a_layer_below_the_floor_is_promoted_and_the_record_survives_a_resume(tmp_path, text_file):
    folder = tmp_path / "run"
    # a 40 dB forward floor: no FP8 format meets it (they measure 28-30 dB here), so every layer goes
    records = run_train(folder, text_file, *FP8, "--plan.interval", "3", "--plan.forward_floor_db", "40")
    promoted_at = {r["step"]: r["promoted"] for r in records if "promoted" in r}
    assert list(promoted_at) == [3] and len(promoted_at[3]) == 14
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["fp8_layers"] == 0 and summary["gemm_flops_by_format"] == {"bfloat16": 1.0}
    first = next(iter(summary["promoted"].values()))
    assert first["step"] == 3 and "re-planning at step 3" in first["evidence"] and "forward" in first["evidence"]
    # resumed with more steps: the promotions come back from the checkpoint
    run_train(folder, text_file, *FP8[:2], "--training.steps", "5", "--plan.interval", "3",
              "--plan.forward_floor_db", "40")
    resumed = json.loads((folder / "summary.json").read_text())
    assert resumed["promoted"] == summary["promoted"] and resumed["fp8_layers"] == 0
