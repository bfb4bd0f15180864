"""GEMMs on narrow operands: the FP8 GEMM and its routes (fp8: torch's scaled GEMMs or the exact emulation),
the microscaled GEMM (mx), and the accumulation demonstration (accumulation)."""
