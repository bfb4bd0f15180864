"""mixprec: mixed-precision training on PyTorch.

Names load on first use (PEP 562): `import mixprec` and the command line's --help do
not wait for torch; `mixprec.Policy` imports it.
"""

import importlib

_WHERE = {
    # precision policy
    "Policy": "mixprec.precision", "StepResult": "mixprec.precision", "PrecisionSpec": "mixprec.precision",
    "Override": "mixprec.precision", "register_preset": "mixprec.precision", "PRESETS": "mixprec.precision", "ALIASES": "mixprec.precision",
    "APEX_LEVELS": "mixprec.precision", "has_fast_matmul": "mixprec.precision", "parse_dtype": "mixprec.precision",
    "dtype_name": "mixprec.precision",
    # loss scaling
    "LossScaler": "mixprec.precision", "LossScaleConfig": "mixprec.precision",
    # bfloat16 weights without master copies (bf16-kahan, bf16-sr)
    "BF16Updates": "mixprec.optim",
    # numerical stability
    "StabilityGuard": "mixprec.stability", "StabilityConfig": "mixprec.stability",
    # model
    "Llama": "mixprec.models.llama", "ModelArgs": "mixprec.models.llama", "model_args": "mixprec.models.llama",
    "build_model": "mixprec.models.llama",
    # the audit of one observed step, for any model
    "audit": "mixprec.analysis.audit", "format_audit": "mixprec.analysis.audit",
    "plan_memory": "mixprec.analysis.plan_model",
    # a compute format per Linear layer, chosen by measurement
    "plan_precision": "mixprec.plan.planner", "format_plan": "mixprec.plan.planner",
    "PlanConfig": "mixprec.plan.config",
    # config
    "Config": "mixprec.config", "load_config": "mixprec.config", "build_policy": "mixprec.train.policy",
    # errors
    "UserError": "mixprec.errors", "TrainingUnstable": "mixprec.errors",
}
__all__ = list(_WHERE)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'mixprec' has no attribute {name!r}")
