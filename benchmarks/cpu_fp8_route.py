"""torch's CPU scaled GEMM against mixprec's emulation, side by side, and the route mixprec chooses
(mixprec.narrow.gemm.fp8.route_on: the kernel only where it is CPU_MARGIN times faster).

    python benchmarks/cpu_fp8_route.py
    ONEDNN_MAX_CPU_ISA=AVX512_CORE python benchmarks/cpu_fp8_route.py    # this CPU without AMX
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 python benchmarks/cpu_fp8_route.py   # as an AVX2 CPU

Each GEMM of the tensor-wise and row-wise recipes (their operand formats, a bfloat16 output) at two
shapes: the median of 5 timed runs after one untimed. Run it alone: two torch processes on two cores
slow each other's kernels.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from mixprec.narrow.gemm.fp8 import cpu_name, emulated_mm, kernel_mm, route_on
from mixprec.narrow.formats.recipe import RECIPES
from mixprec.narrow.formats.scaling import quantize

SHAPES = [(64, 512, 512), (512, 512, 1536)]


def seconds(run, repeats: int = 5) -> float:
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "all")
    print(f"torch {torch.__version__}, {cpu_name()} CPU, ONEDNN_MAX_CPU_ISA={isa}, {torch.get_num_threads()} threads")
    print(f"{'recipe':<11} {'GEMM':<16} {'M x K x N':<16} {'kernel ms':>10} {'emulation ms':>13} {'ratio':>7}  route")
    gen = torch.Generator().manual_seed(0)
    for name in ("tensorwise", "rowwise"):
        recipe = RECIPES[name]
        for gemm, (a_tile, b_tile), (a_dtype, b_dtype, out) in recipe.gemms(torch.bfloat16):
            why = route_on("cpu", a_tile, b_tile, a_dtype, b_dtype, out)
            for M, K, N in SHAPES:
                a, _ = quantize(torch.randn(M, K, generator=gen), a_dtype, a_tile)
                b, _ = quantize(torch.randn(K, N, generator=gen), b_dtype, b_tile)
                emulated = seconds(lambda: emulated_mm(a, b, out))
                try:
                    kernel = seconds(lambda: kernel_mm(a, b, out), repeats=1 if M * K * N > 2**27 else 5)
                    figures = f"{kernel * 1e3:>10.2f} {emulated * 1e3:>13.2f} {kernel / emulated:>6.1f}x"
                except RuntimeError:  # oneDNN has no FP8 matmul for this ISA
                    figures = f"{'refused':>10} {emulated * 1e3:>13.2f} {'-':>7}"
                print(f"{name:<11} {gemm:<16} {f'{M} x {K} x {N}':<16} {figures}  "
                      f"{'kernel' if why is None else 'emulation'}")


if __name__ == "__main__":
    main()
