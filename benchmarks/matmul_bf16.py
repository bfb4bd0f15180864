"""GEMM throughput on this device: FP32 vs native BF16 vs BF16 emulated by FP32 GEMMs,
for the operand layouts a transformer's forward and backward produce.

    python benchmarks/matmul_bf16.py
"""

from __future__ import annotations

import time

import torch

from mixprec.precision.emulation import EmulatedMatmul


def gflops(fn, flops: float, min_time: float = 0.3) -> float:
    fn()
    reps, start = 0, time.perf_counter()
    while reps < 2 or time.perf_counter() - start < min_time:
        fn()
        reps += 1
    return flops * reps / (time.perf_counter() - start) / 1e9


def main() -> None:
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"AVX512-BF16 {torch.cpu._is_avx512_bf16_supported()}, AMX {torch.cpu._is_amx_tile_supported()}, "
          f"threads {torch.get_num_threads()}")
    m, k, n = 1024, 512, 1536  # (tokens, dim) @ (dim, ffn): the small flavor's w1
    print(f"\nGEMM {m}x{k} @ {k}x{n}, GFLOP/s by layout (n: row-major, t: transposed)")
    print(f"{'layout':<8}{'fp32':>9}{'bf16 native':>13}{'bf16 emulated':>15}{'native/fp32':>13}{'emulated/fp32':>15}")
    flops = 2 * m * k * n
    for layout in ("nn", "nt", "tn", "tt"):
        row = {}
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            a = torch.randn(m, k, dtype=dtype) if layout[0] == "n" else torch.randn(k, m, dtype=dtype).t()
            b = torch.randn(k, n, dtype=dtype) if layout[1] == "n" else torch.randn(n, k, dtype=dtype).t()
            row[name] = gflops(lambda: a @ b, flops)
            if dtype == torch.bfloat16:
                with EmulatedMatmul():
                    row["emulated"] = gflops(lambda: a @ b, flops)
        print(f"{layout:<8}{row['fp32']:>9.1f}{row['bf16']:>13.1f}{row['emulated']:>15.1f}"
              f"{row['bf16'] / row['fp32']:>13.2f}{row['emulated'] / row['fp32']:>15.2f}")


if __name__ == "__main__":
    main()
