"""Precision specs and their per-module layouts, the policy, loss scaling, presets and dtype names. Names load on first use
(PEP 562), so that `mixprec --help` does not wait for torch."""

import importlib

_WHERE = {
    "Policy": "policy", "StepResult": "step", "has_fast_matmul": "emulation",
    "LossScaler": "loss_scaling", "LossScaling": "loss_scaling",
    "PrecisionSpec": "spec", "Override": "spec", "Update": "spec", "register_preset": "presets",
    "resolve": "layout", "Layout": "layout",
    "LossScaleConfig": "scaling_config", "PRESETS": "presets", "ALIASES": "presets", "APEX_LEVELS": "presets",
    "parse_dtype": "dtypes", "dtype_name": "dtypes",
}
__all__ = ["Policy", "StepResult", "PrecisionSpec", "Override", "Update", "register_preset", "resolve", "Layout",
           "PRESETS", "ALIASES", "APEX_LEVELS", "LossScaler", "LossScaling", "LossScaleConfig", "has_fast_matmul",
           "parse_dtype", "dtype_name"]


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f"mixprec.precision.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'mixprec.precision' has no attribute {name!r}")
