"""The floating-point formats of mixed-precision training, with their limits.

Values come from torch.finfo where torch has the dtype (FP8 included); TF32 has no
storage dtype (it is how tensor cores read FP32 operands: FP32's 8-bit exponent with
FP16's 10-bit mantissa), so its limits follow from that definition.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class Format:
    name: str
    dtype: torch.dtype | None
    bits: int
    exponent_bits: int
    mantissa_bits: int  # stored bits; the significand has one more (the implicit 1)
    max: float
    smallest_normal: float
    smallest_subnormal: float
    eps: float  # the gap between 1 and the next value: 2^-mantissa_bits

    @property
    def decimal_digits(self) -> float:
        return (self.mantissa_bits + 1) * math.log10(2)

    @property
    def underflow(self) -> float:
        """Magnitudes below this round to zero (half the smallest subnormal, ties to even)."""
        return self.smallest_subnormal / 2

    def to_dict(self) -> dict:
        d = asdict(self)
        d["dtype"] = str(self.dtype).removeprefix("torch.") if self.dtype else None
        d["decimal_digits"] = round(self.decimal_digits, 2)
        return d


def _from_finfo(name: str, dtype: torch.dtype, exponent_bits: int) -> Format:
    fi = torch.finfo(dtype)
    mantissa = fi.bits - 1 - exponent_bits
    return Format(name, dtype, fi.bits, exponent_bits, mantissa, fi.max, fi.tiny, fi.smallest_normal * 2.0 ** -mantissa,
                  fi.eps)


def _tf32() -> Format:
    # FP32's exponent range, a 10-bit mantissa: max (2 - 2^-10) * 2^127, subnormals 2^-126 * 2^-10
    return Format("tf32", None, 19, 8, 10, (2 - 2.0 ** -10) * 2.0 ** 127, 2.0 ** -126, 2.0 ** -136, 2.0 ** -10)


FORMATS: dict[str, Format] = {f.name: f for f in (
    _from_finfo("fp32", torch.float32, 8),
    _tf32(),
    _from_finfo("fp16", torch.float16, 5),
    _from_finfo("bf16", torch.bfloat16, 8),
    _from_finfo("fp8_e4m3", torch.float8_e4m3fn, 4),  # no infinities: 448 is the largest finite value
    _from_finfo("fp8_e5m2", torch.float8_e5m2, 5),
)}


def format_table() -> str:
    head = "| format | bits | exp | mant | max | smallest normal | smallest subnormal | eps | digits |"
    rows = [head, "|" + "---|" * 9]
    for f in FORMATS.values():
        rows.append(f"| {f.name} | {f.bits} | {f.exponent_bits} | {f.mantissa_bits} | {f.max:.6g} | "
                    f"{f.smallest_normal:.6g} | {f.smallest_subnormal:.6g} | {f.eps:.6g} | {f.decimal_digits:.2f} |")
    return "\n".join(rows)
