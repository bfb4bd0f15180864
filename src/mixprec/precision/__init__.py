"""Precision policy, loss scaling, presets and dtype names. Names load on first use
(PEP 562), so that `mixprec --help` does not wait for torch."""

import importlib

_WHERE = {
    "Policy": "policy", "has_fast_matmul": "policy", "LossScaler": "loss_scaler",
    "LossScaleConfig": "scaling_config", "PRESETS": "presets", "ALIASES": "presets", "APEX_LEVELS": "presets",
    "parse_dtype": "dtypes", "dtype_name": "dtypes",
}
__all__ = ["Policy", "PRESETS", "ALIASES", "APEX_LEVELS", "LossScaler", "LossScaleConfig", "has_fast_matmul",
           "parse_dtype", "dtype_name"]


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f"mixprec.precision.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'mixprec.precision' has no attribute {name!r}")
