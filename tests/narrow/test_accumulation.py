import json

import torch

from mixprec.cli import main
from mixprec.narrow.gemm.accumulation import accumulation_errors, truncate


def test_truncate_keeps_the_significant_bits_and_rounds_toward_zero():
    x = torch.tensor([1 + 2**-13, 1 + 2**-14, -(1 + 2**-13 + 2**-14)], dtype=torch.float64)
    assert truncate(x, 14).tolist() == [1 + 2**-13, 1.0, -(1 + 2**-13)]


def test_a_14_bit_accumulator_drifts_with_k_and_promotion_every_128_does_not():
    report = accumulation_errors()
    errs = report["relative_error"]
    limited, promoted, fp32 = errs["limited"], errs["promoted"], errs["float32"]
    # truncation loses about half a unit of the 14th bit per instruction: linear in K
    assert limited[-1] > 50 * limited[0] and limited[report["K"].index(4096)] > 1e-3
    # promoted: never more than 128 products in the short register, whatever K is
    assert max(promoted) < 1.1 * min(promoted) and all(p <= q for p, q in zip(promoted, limited))
    assert max(fp32) < 1e-5


def test_cli_prints_json_and_writes_the_plot(tmp_path, capsys):
    plot = tmp_path / "acc.png"
    assert main(["demo", "fp8-accumulation", "--json", "--plot", str(plot)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["K"][0] == 128 and report["K"][-1] == 16384
    assert report["plot"] in (str(plot), None) and (report["plot"] is None or plot.stat().st_size > 0)
