"""Analysis figures against closed-form results."""

import json
import math

import pytest
import torch

from mixprec.analysis import numerics
from mixprec.analysis.formats import FORMATS
from mixprec.cli import main


def test_range_of_chosen_values():
    rows = {r["value"]: r for r in numerics.range_table([70000.0, 1e-8, 1e-5, 0.125, 257.0])}
    assert rows[70000.0]["fp16"]["kind"] == "overflow" and rows[70000.0]["bf16"]["kind"] == "rounded"
    assert rows[1e-8]["fp16"]["kind"] == "zero" and rows[1e-5]["fp16"]["kind"] == "subnormal"
    assert rows[0.125]["bf16"]["kind"] == "exact" and rows[0.125]["fp8_e4m3"]["kind"] == "exact"
    assert rows[257.0]["bf16"]["stored"] == 256.0


@pytest.mark.parametrize("dtype, stall", [(torch.bfloat16, 256.0), (torch.float16, 2048.0)])
def test_adding_ones_stalls_where_the_spacing_reaches_two(dtype, stall):
    # with m mantissa bits, x + 1 == x once x >= 2^(m+1): bf16 (7 bits) at 256, fp16 (10) at 2048
    assert numerics.accumulate(1.0, 5000, dtype) == stall
    assert numerics.accumulate(1.0, 5000, torch.float32) == 5000.0


@pytest.mark.parametrize("fmt", numerics.LOW)
def test_quantisation_error_is_bounded_by_half_an_ulp(fmt):
    q = numerics.quantisation(std=1.0, numel=1 << 16)[fmt]
    eps = FORMATS[fmt].eps
    # round to nearest: relative error at most eps/2 per element; uniform in [-eps/2, eps/2]
    # in the mantissa gives an RMS of about eps / (2 sqrt 3) to eps / sqrt 3 over a binade
    assert eps / (2 * math.sqrt(12)) < q["relative_rms_error"] < eps / 2


def test_tiny_weights_flush_in_e4m3_not_in_bf16():
    q = numerics.quantisation(std=1e-4, numel=1 << 14)
    assert q["fp8_e4m3"]["underflow"] > 0.5 and q["bf16"]["underflow"] == 0


def test_census_counts_against_hand_made_gradients():
    model = torch.nn.Linear(4, 1, bias=False)
    model.weight.grad = torch.tensor([[1e5, 1e-9, 1e-6, 1.0]])
    census = numerics.gradient_census(model)["weight"]
    assert census["fp16"] == {"overflow": 0.25, "underflow": 0.25, "subnormal": 0.25}
    assert census["bf16"] == {"overflow": 0.0, "underflow": 0.0, "subnormal": 0.0}
    scaled = numerics.gradient_census(model, loss_scale=1024)["weight"]["fp16"]
    # x1024: 1e5 still overflows, 1e-9 is rescued into the subnormals, 1e-6 becomes normal
    assert scaled == {"overflow": 0.25, "underflow": 0.0, "subnormal": 0.25}


def test_cli_writes_json_and_histogram(tmp_path, capsys):
    assert main(["analyze", "--flavor", "debug", "--out", str(tmp_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) >= {"range", "accumulation", "quantisation", "reduction", "census"}
    assert (tmp_path / "gradient_census.png").stat().st_size > 10_000
    fp16 = report["census_total"]["fp16"]
    assert 0 <= fp16["underflow"] <= 1 and report["census_total"]["bf16"]["overflow"] == 0
