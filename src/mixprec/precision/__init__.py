from mixprec.precision.dtypes import dtype_name, parse_dtype
from mixprec.precision.policy import ALIASES, PRESETS, Policy, has_fast_bf16

__all__ = ["Policy", "PRESETS", "ALIASES", "has_fast_bf16", "parse_dtype", "dtype_name"]
