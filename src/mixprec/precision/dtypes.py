"""Dtype names for the precision package (they live in mixprec.dtypes, below every package)."""

from mixprec.dtypes import dtype_name, parse_dtype

__all__ = ["dtype_name", "parse_dtype"]
