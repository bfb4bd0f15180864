"""MFU's peak: one per compute dtype, the right one for what the matmuls run in."""

import pytest

from mixprec.precision import Policy
from mixprec.precision.presets import PRESETS
from mixprec.train.metrics import gpu_peak_flops

H100 = "NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_has_a_peak_on_an_h100(preset):
    policy = Policy.from_preset(preset)
    policy.device_type = "cuda"  # as after setup on a GPU
    assert gpu_peak_flops(H100, policy.matmul_dtype) in (989e12, 67e12)


def test_fp32_peak_follows_tf32(monkeypatch):
    import torch

    policy = Policy.from_preset("fp32")
    policy.device_type = "cuda"
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "highest")
    assert policy.matmul_dtype == "float32" and gpu_peak_flops(H100, policy.matmul_dtype) == 67e12
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert policy.matmul_dtype == "tfloat32" and gpu_peak_flops(H100, policy.matmul_dtype) == 494e12


def test_data_sheet_values():
    assert gpu_peak_flops("NVIDIA H100 PCIe", "bfloat16") == 756e12  # not the SXM part's 989
    assert gpu_peak_flops(H100, "float8") == 1979e12  # dense FP8; BF16's 1979 is with 2:4 sparsity
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB", "float16") == 312e12


def test_unknown_gpu_or_dtype_gives_no_mfu():
    assert gpu_peak_flops("NVIDIA GeForce RTX 4090", "bfloat16") is None
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB", "float8") is None  # no FP8 on Ampere
