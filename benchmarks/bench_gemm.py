"""Matmul throughput of this device per dtype, at a few transformer shapes.

FP32; BF16 and FP16 with the native kernel and emulated (mixprec's EmulatedMatmul:
FP32 GEMMs on the rounded operands); the forward GEMM of each FP8 recipe (mixprec.narrow:
tensor-wise with and without fast accumulation, row-wise, DeepSeek-V3's 1x128 x 128x128
block-wise) on pre-cast E4M3 operands, through torch's scaled GEMM where this device has
one for the layout and mixprec's emulation (marked "emulated") where it has none. On CUDA
the emulated BF16/FP16 rows are skipped. The best figure per dtype is the peak that MFU
is measured against (bench_train.py).

    python benchmarks/bench_gemm.py [--device cpu|cuda] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from mixprec.narrow import RECIPES, quantize, scaled_mm
from mixprec.narrow.gemm.fp8 import probe
from mixprec.precision.emulation import EmulatedMatmul

# (M, K, N): tokens x dim @ dim x out, for the small flavor's batch of 4 x 256 tokens and the 1B flavor's
SHAPES = {"small qkv": (1024, 512, 512), "small w1": (1024, 512, 1536), "small w2": (1024, 1536, 512),
          "1B w1": (2048, 2048, 8192)}
E4M3 = torch.float8_e4m3fn


def gflops(fn, flops: float, device: torch.device, min_time: float = 0.3, rounds: int = 3) -> float:
    """The best of `rounds` timings, each of as many calls as fill `min_time` seconds."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    sync()
    best = 0.0
    for _ in range(rounds):
        reps, start = 0, time.perf_counter()
        while reps < 2 or time.perf_counter() - start < min_time:
            fn()
            reps += 1
        sync()
        best = max(best, flops * reps / (time.perf_counter() - start) / 1e9)
    return best


def cases(m: int, k: int, n: int, device: torch.device) -> dict:
    """name -> a zero-argument GEMM of that kind on (m, k) @ (k, n)."""
    a32, b32 = torch.randn(m, k, device=device), torch.randn(k, n, device=device)
    out = {"fp32": lambda: a32 @ b32}
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        a, b = a32.to(dtype), b32.to(dtype)
        out[f"{name} native"] = lambda a=a, b=b: a @ b
        if device.type == "cpu":
            def emulated(a=a, b=b):
                with EmulatedMatmul():
                    return a @ b
            out[f"{name} emulated"] = emulated
    # FP8: each recipe's forward layout, B cast as the (N, K) weight and transposed (column-major)
    w32 = b32.t().contiguous()
    for name, recipe in RECIPES.items():
        if name == "delayed":  # the same GEMM as tensorwise; only where the scale comes from differs
            continue
        tiles = recipe.tiles
        a8, _ = quantize(a32, E4M3, tiles.x, power_of_2=recipe.power_of_2_scales)
        w8, _ = quantize(w32, E4M3, tiles.w, power_of_2=recipe.power_of_2_scales)
        kernel = probe(device.type, tiles.x, (tiles.w[1], tiles.w[0]), E4M3, E4M3, torch.bfloat16) is None
        label = f"fp8 {name}" + ("" if kernel else " emulated")
        for fast in ((True, False) if recipe.fast_accum and kernel else (False,)):
            out[label + (" fast-accum" if fast else "")] = (
                lambda a8=a8, w8=w8, kernel=kernel, fast=fast:
                scaled_mm(a8, w8.t(), torch.bfloat16, kernel=kernel, fast_accum=fast))
    return out


def layouts(device: torch.device) -> None:
    """FP32 vs native and emulated BF16 for the four operand layouts (n: row-major,
    t: transposed) that a transformer's forward and backward produce."""
    m, k, n = SHAPES["small w1"]
    print(f"\nGEMM {m}x{k} @ {k}x{n}, GFLOP/s by layout")
    print(f"{'layout':<8}{'fp32':>9}{'bf16 native':>13}{'bf16 emulated':>15}{'native/fp32':>13}{'emulated/fp32':>15}")
    for layout in ("nn", "nt", "tn", "tt"):
        row = {}
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            a = torch.randn(m, k, dtype=dtype) if layout[0] == "n" else torch.randn(k, m, dtype=dtype).t()
            b = torch.randn(k, n, dtype=dtype) if layout[1] == "n" else torch.randn(n, k, dtype=dtype).t()
            row[name] = gflops(lambda: a @ b, 2 * m * k * n, device)
            if dtype == torch.bfloat16:
                with EmulatedMatmul():
                    row["emulated"] = gflops(lambda: a @ b, 2 * m * k * n, device)
        print(f"{layout:<8}{row['fp32']:>9.1f}{row['bf16']:>13.1f}{row['emulated']:>15.1f}"
              f"{row['bf16'] / row['fp32']:>13.2f}{row['emulated'] / row['fp32']:>15.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names from: " + ", ".join(SHAPES))
    p.add_argument("--skip", default="", help="comma-separated kinds to skip (fp16 native is very slow on CPUs)")
    p.add_argument("--json", help="also write the table here")
    p.add_argument("--layouts", action="store_true", help="only the operand-layout study (CPU)")
    args = p.parse_args()
    device = torch.device(args.device)
    if args.layouts:
        layouts(device)
        return
    if device.type == "cpu":
        print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, AVX512-BF16 "
              f"{torch.cpu._is_avx512_bf16_supported()}, AMX {torch.cpu._is_amx_tile_supported()}, threads "
              f"{torch.get_num_threads()}")
    else:
        print(f"torch {torch.__version__}, {torch.cuda.get_device_name(device)}")
    skip = set(filter(None, args.skip.split(",")))
    table: dict[str, dict[str, float | None]] = {}
    for shape in args.shapes.split(","):
        m, k, n = SHAPES[shape]
        row = {}
        for kind, fn in cases(m, k, n, device).items():
            if kind in skip:
                continue
            try:
                row[kind] = gflops(fn, 2 * m * k * n, device)
            except RuntimeError as e:  # a kind this build or device has no kernel for
                print(f"  {shape} {kind}: unavailable ({str(e).splitlines()[0][:80]})")
                row[kind] = None
        table[shape] = row
        print(f"{shape} ({m}x{k} @ {k}x{n}), GFLOP/s: " + ", ".join(
            f"{kind} {v:.1f}" if v is not None else f"{kind} -" for kind, v in row.items()), flush=True)
    kinds = sorted({k for row in table.values() for k in row})
    best = {kind: max((row.get(kind) or 0) for row in table.values()) for kind in kinds}
    print("\nbest per kind, and against fp32:")
    for kind in kinds:
        print(f"  {kind:<16} {best[kind]:9.1f} GFLOP/s   {best[kind] / best['fp32']:6.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "table": table, "best": best}, f, indent=2)


if __name__ == "__main__":
    main()
