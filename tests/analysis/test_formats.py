import json

import pytest
import torch

from mixprec.analysis.formats import FORMATS
from mixprec.cli import main

# (max, smallest normal, smallest subnormal, eps) from the IEEE 754 and OCP FP8 definitions
KNOWN = {
    "fp32": ((2 - 2 ** -23) * 2.0 ** 127, 2.0 ** -126, 2.0 ** -149, 2.0 ** -23),
    "tf32": ((2 - 2 ** -10) * 2.0 ** 127, 2.0 ** -126, 2.0 ** -136, 2.0 ** -10),
    "fp16": (65504.0, 2.0 ** -14, 2.0 ** -24, 2.0 ** -10),
    "bf16": ((2 - 2 ** -7) * 2.0 ** 127, 2.0 ** -126, 2.0 ** -133, 2.0 ** -7),
    "fp8_e4m3": (448.0, 2.0 ** -6, 2.0 ** -9, 2.0 ** -3),
    "fp8_e5m2": (57344.0, 2.0 ** -14, 2.0 ** -16, 2.0 ** -2),
}


@pytest.mark.parametrize("name", list(KNOWN))
def test_limits_match_the_definitions(name):
    f = FORMATS[name]
    assert (f.max, f.smallest_normal, f.smallest_subnormal, f.eps) == KNOWN[name]
    assert f.bits == 1 + f.exponent_bits + f.mantissa_bits


@pytest.mark.parametrize("name", [n for n in KNOWN if n != "tf32"])
def test_limits_are_what_the_dtype_does(name):
    f = FORMATS[name]
    x = torch.tensor([f.max, f.smallest_subnormal, f.underflow * 0.99, 1 + f.eps], dtype=torch.float64)
    y = x.to(f.dtype).double()
    assert y[0] == f.max and y[1] == f.smallest_subnormal  # representable
    assert y[2] == 0  # below half the smallest subnormal: flushed
    assert y[3] == 1 + f.eps and torch.tensor(1 + f.eps / 2, dtype=torch.float64).to(f.dtype).double() == 1


def test_bf16_facts_the_seeds_get_wrong():
    assert torch.tensor(0.125).to(torch.bfloat16).item() == 0.125  # a power of two: exact
    assert torch.tensor(257.0).to(torch.bfloat16).item() == 256.0  # 8 significant bits


def test_cli_json(capsys):
    assert main(["formats", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["fp16"]["max"] == 65504.0 and rows["bf16"]["decimal_digits"] == 2.41
