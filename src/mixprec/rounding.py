"""Stochastic rounding to bfloat16 with counter-based random bits.

The 16 random bits of element i are the top half of a 32-bit integer hash of i XOR key
(Wellons' two-multiply "lowbias32" mixer), the key a splitmix64 hash of (seed, rank, step,
tensor): reproducible, resumable, the same in eager and compiled code and on every device,
with no generator state to save, and independent from element to element (the rounding
directions of neighbours, and of elements 2^16 apart, are uncorrelated; a test measures it).
In compiled code the hash costs ~15% of the fused AdamW kernel's time on a 2-core AVX2 CPU
(8.2 against 7.2 ms per 4M elements); the same hash in int64, with no product past 2^63,
doubled it (AVX2 has no 64-bit vector multiply).
"""

from __future__ import annotations

import torch


MIX = (0x21F0AAAD, 0x735A2D97)  # lowbias32's multipliers (both below 2^31: positive int32 constants)


def _to_bf16_grid(x: torch.Tensor, add: torch.Tensor) -> torch.Tensor:
    """FP32 `x` with `add` added to its bits and the low 16 bits dropped: a bfloat16 value,
    kept in FP32 (a carry goes into the exponent, as a rounding's should). All int32
    arithmetic stays in range for finite x; non-finite values are returned as they are.
    (On a CPU, Inductor's bit casts go through memory: about twice the time of a
    memory-bound kernel.)"""
    rounded = ((x.view(torch.int32) + add) & -65536).view(torch.float32)
    return torch.where(torch.isfinite(x), rounded, x)


def nearest_bf16(x: torch.Tensor) -> torch.Tensor:
    """FP32 `x` rounded to the nearest bfloat16 value (ties to even), kept in FP32: the value
    of x.to(torch.bfloat16).float(), computed so that a compiler keeps it. (Inductor keeps
    that round trip in FP32 inside one kernel unless emulate_precision_casts is set, and
    with that option and dynamic shapes its CPU kernels run on one thread.)

    On a CPU, Veltkamp's split: t = x * (2^16 + 1), then t - (t - x),
    keeps x's top 8 significant bits, rounded to nearest, ties to even (checked against
    torch's cast for every float32 of several binades), in three FP32 operations at
    memory speed; it needs the operations unfused (Inductor's C++ default,
    ffp-contract=off) and holds for 2^-126 <= |x| < 2^112 (a subnormal comes out within
    one bfloat16 subnormal step, |x| >= 5.2e33 as NaN: a diverged weight either way).
    Elsewhere (Triton fuses multiply-adds, and bit casts cost nothing there) on the bits."""
    if x.device.type == "cpu":
        t = x * 65537.0
        return t - (t - x)
    return nearest_bf16_bits(x)


def nearest_bf16_bits(x: torch.Tensor) -> torch.Tensor:
    """nearest_bf16 on the bits: round half to even at bit 16 (non-CPU devices)."""
    return _to_bf16_grid(x, 0x7FFF + ((x.view(torch.int32) >> 16) & 1))


def round_trip(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP32 `x` rounded to nearest in `dtype`, kept in FP32, in a form compiled code keeps:
    nearest_bf16 for bfloat16; a cast for other dtypes, which needs compile_options."""
    return nearest_bf16(x) if dtype == torch.bfloat16 else x.to(dtype).float()


def compile_options(dtype: torch.dtype) -> dict:
    """torch.compile options for a kernel that calls round_trip(..., dtype):
    emulate_precision_casts only where the round trip is a cast (not bfloat16, not
    float32), since with it and dynamic shapes Inductor's CPU kernels run on one thread."""
    return {"emulate_precision_casts": dtype not in (torch.bfloat16, torch.float32)}


def compiled_nearest_unsafe(device: torch.device) -> str | None:
    """Why a kernel compiled here would not keep nearest_bf16's Veltkamp split exact (Inductor
    told to fuse multiply-adds or to reassociate in its C++ kernels), or None where it would."""
    if device.type != "cpu":
        return None
    from torch._inductor import config

    if config.cpp.enable_floating_point_contract_flag != "off":
        return (f"Inductor's C++ kernels fuse multiply-adds (ffp-contract="
                f"{config.cpp.enable_floating_point_contract_flag}), which breaks the bfloat16 rounding's exactness")
    if config.cpp.enable_unsafe_math_opt_flag:
        return "Inductor's C++ kernels allow unsafe math, which breaks the bfloat16 rounding's exactness"
    return None


def random_bits16(n, key: torch.Tensor, device) -> torch.Tensor:
    """16 random bits (int32 in [0, 2^16)) for each of elements 0..n-1 (or for each index of an
    int32 tensor n, its key broadcast against it): the top half of lowbias32(i ^ key). int32 products wrap modulo 2^32 on every backend torch has (CPU
    vector and scalar code, CUDA, Triton), which is unsigned arithmetic's result; right
    shifts of negative int32 fill with ones, hence the masks (logical shifts)."""
    h = (torch.arange(n, device=device, dtype=torch.int32) if isinstance(n, int) else n) ^ key
    h = (h ^ ((h >> 16) & 0xFFFF)) * MIX[0]
    h = (h ^ ((h >> 15) & 0x1FFFF)) * MIX[1]
    return (h >> 16) & 0xFFFF  # the last multiply mixes every input bit into the high half


def stochastic_round_bf16(x: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """FP32 `x` rounded to bfloat16 up or down at random, P(up) = the dropped 16 bits / 2^16.

    Element i's 16 random bits are random_bits16's, with `key` (a 0-dim int32 tensor, so a
    compiled kernel is not specialised on it) drawn afresh for each tensor and step by
    rounding_key: uniform, independent across elements and from step to step, which makes
    the rounding unbiased and its errors uncorrelated. Non-finite values round to nearest."""
    flat = x.reshape(-1)
    return _to_bf16_grid(flat, random_bits16(flat.numel(), key, x.device)).to(torch.bfloat16).view(x.shape)


def rounding_key(seed: int, rank: int, step: int, tensor: int) -> int:
    """splitmix64 over the four counters: a fresh 32-bit key for each tensor and step, as a
    signed int32 value (for an int32 tensor)."""
    z = 0
    for v in (seed, rank, step, tensor):
        z = (z + v + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        z ^= z >> 31
    z &= 0xFFFFFFFF
    return z - (1 << 32) if z >= 1 << 31 else z
