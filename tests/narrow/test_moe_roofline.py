"""benchmarks/moe_roofline.py: what an MoE layer's experts cost on a GPU, estimated on the CPU from the bytes
and FLOPs of every operator along CUDA's route (traced on meta). The bounds are today's figures (+2%): a
change that moves more bytes through the experts fails here, and lowers them when it moves fewer."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import moe_roofline  # noqa: E402

# non-GEMM bytes of both projections, forward and backward, at Qwen3-30B-A3B's layer (16,384 tokens, top-8)
BOUNDS_GB = {"tensorwise": 38, "rowwise": 19.3, "blockwise": 12.5, "mxfp8": 20.5, "nvfp4": 28.6, "mxfp4": 19}


def test_the_estimate_of_each_recipe_stays_under_its_bound():
    table = moe_roofline.estimate()
    bf16 = table["bf16"]
    assert bf16["bytes"] == 0 and abs(bf16["gemm_ms"] - 5.155) < 0.01  # 3.71 TFLOP at 720 TFLOP/s, GEMMs only
    for name, bound in BOUNDS_GB.items():
        c = table[name]
        assert c["bytes"] / 1e9 <= bound, (name, c["bytes"] / 1e9)
        assert c["ms"] > c["gemm_ms"] > 0 and c["ops"] > 20  # every cast counted, none free
    # row-wise: all three GEMMs at FP8's rate (the weight gradient's FLOPs count each expert's padding to 16)
    rowwise = table["rowwise"]
    assert rowwise["bf16_flops"] == 0 and 1 < rowwise["fp8_flops"] / bf16["bf16_flops"] < 1.01
    assert table["tensorwise"]["fp8_flops"] == 1 / 3 * bf16["bf16_flops"]  # the forward (e5m2 gradients emulated)


def test_the_documented_command_runs(capsys):
    moe_roofline.main(["--tokens", "512", "--experts", "16", "--ops"])
    out = capsys.readouterr().out
    assert "| rowwise |" in out and "| bf16 | 0.0 GB |" in out and "nvfp4: " in out
