"""mixprec: mixed-precision training on PyTorch."""

from mixprec.config import Config, build_policy, load_config
from mixprec.errors import UserError
from mixprec.models.llama import Llama, ModelArgs, build_model, model_args
from mixprec.precision import (ALIASES, APEX_LEVELS, PRESETS, LossScaleConfig, LossScaler, Policy, dtype_name,
                               has_fast_matmul, parse_dtype)

__all__ = [
    # precision policy
    "Policy", "PRESETS", "ALIASES", "APEX_LEVELS", "has_fast_matmul", "parse_dtype", "dtype_name",
    # loss scaling
    "LossScaler", "LossScaleConfig",
    # model
    "Llama", "ModelArgs", "model_args", "build_model",
    # config
    "Config", "load_config", "build_policy",
    # errors
    "UserError",
]
__version__ = "0.1.0"
