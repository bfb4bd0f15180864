"""The rule that picks a layer's format from its measured figures.

A candidate *suits* a layer when each of its three GEMMs keeps an SQNR against FP32 at or
above its floor: 25 dB for the forward output and 18 dB for the two gradients by default
(the bars torchao's FP8 tests hold an FP8 Linear to), and its casts flush to zero or
saturate at most `max_lost` (1%) of any operand's values: a whole-tensor SQNR is
dominated by the largest values, so an outlier whose tensor-wise scale flushes every
other row to zero can keep a passing SQNR. Among the candidates that suit it:

- objective `coverage` takes the most accurate one (the least noise power summed over its
  three GEMMs, each relative to its signal: 10^(-SQNR/10)): every layer some FP8 format
  suits goes to FP8, which puts the most GEMM FLOPs in FP8 the floors allow, and no
  timing is needed;
- objective `speed` takes the one with the largest expected speed-up of the layer's three
  GEMMs over the base mode's, and only a real speed-up (> 1): measured on this device,
  where an emulated format counts as none, or, with `target = "h100"`, modeled from the
  table below.

A layer no candidate suits stays in the base mode, and the reason names the GEMM that
missed its floor.
"""

from __future__ import annotations

import math

from mixprec.plan.measure import GEMMS

# Dense GEMM throughput on one H100 SXM at 8192 x 2048 x 8192 (TFLOP/s), the figures the
# planning issue states: BF16 730; FP8 tensor-wise 1,257-1,366 (its middle here), row-wise
# 1,206, block-wise 1,177. Applied to all three GEMMs alike: a model, not a measurement of
# mixprec's own GEMMs (benchmarks/fp8_gemm_probe.py measured its weight-gradient GEMM at
# 0.3-0.7x BF16 on an H100, where the operands are transposed copies).
H100_TFLOPS = {"bfloat16": 730.0, "fp8-tensorwise": 1311.5, "fp8-rowwise": 1206.0, "fp8-blockwise": 1177.0}


def floors(config) -> dict[str, float]:
    """The per-GEMM SQNR floors (dB) and, under "lost", the largest share of values lost."""
    return {"forward": config.forward_floor_db, "input_gradient": config.gradient_floor_db,
            "weight_gradient": config.gradient_floor_db, "lost": config.max_lost}


def margin(figures: dict, floor: dict[str, float]) -> tuple[float, str]:
    """(the smallest SQNR - floor over the three GEMMs, which GEMM); -inf (and the operand)
    when a cast loses more than floor["lost"] of an operand's values."""
    lost = max(((figures[k][role], role) for k in ("flushed", "saturated") for role in figures.get(k, {})),
               default=(0.0, ""))
    if lost[0] > floor["lost"]:
        return -math.inf, lost[1]
    return min((figures[f"{g}_db"] - floor[g], g) for g in GEMMS)


def suits(figures: dict, floor: dict[str, float]) -> bool:
    """Whether a format with these figures meets every floor."""
    return margin(figures, floor)[0] >= 0


def noise_db(figures: dict) -> float:
    """The three GEMMs' relative noise powers summed, in dB (lower is more accurate)."""
    return 10 * math.log10(sum(10 ** (-figures[f"{g}_db"] / 10) for g in GEMMS))


def choose(measured: dict[str, dict], base: str, floor: dict[str, float], objective: str,
           speedups: dict[str, float | None] | None = None) -> tuple[str, str]:
    """(format, reason) for one layer. measured: candidate -> figures (measure());
    speedups: candidate -> expected speed-up over the base, None where it is none."""
    fit = {name: margin(f, floor) for name, f in measured.items() if suits(f, floor)}
    if not fit:
        name, (m, what) = max(((n, margin(f, floor)) for n, f in measured.items()), key=lambda t: t[1][0])
        if m == -math.inf:
            return base, (f"no candidate meets the floors (the closest, {name}, flushes or saturates more than "
                          f"{floor['lost']:.0%} of the {what.replace('_', ' ')}'s values)")
        return base, (f"no candidate meets the floors (the closest, {name}: {what.replace('_', ' ')} "
                      f"{measured[name][f'{what}_db']:.1f} dB < {floor[what]:g})")
    if objective == "coverage":
        name = min(fit, key=lambda n: noise_db(measured[n]))
        m, gemm = fit[name]
        return name, (f"{len(fit)} of {len(measured)} candidates meet the floors; the most accurate (noise "
                      f"{noise_db(measured[name]):.1f} dB summed over its GEMMs; worst GEMM {gemm.replace('_', ' ')} "
                      f"{m:.1f} dB above its floor)")
    speedups = speedups or {}
    fast = {n: speedups[n] for n in fit if speedups.get(n) and speedups[n] > 1}
    if not fast:
        seen = ", ".join(f"{n}: {speedups[n]:.2f}x" if speedups.get(n) else f"{n}: emulated" for n in fit)
        return base, f"{', '.join(fit)} meet the floors but none is faster than {base} here ({seen})"
    name = max(fast, key=fast.get)
    return name, f"meets the floors, expected {fast[name]:.2f}x the {base} GEMMs ({len(fit)} candidates met them)"


def modeled_speedups(candidates, base: str) -> dict[str, float | None]:
    return {c: H100_TFLOPS[c] / H100_TFLOPS[base] if c in H100_TFLOPS and base in H100_TFLOPS else None
            for c in candidates}
