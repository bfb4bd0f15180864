from mixprec.precision.dtypes import dtype_name, parse_dtype
from mixprec.precision.loss_scaler import LossScaleConfig, LossScaler
from mixprec.precision.policy import Policy, has_fast_matmul
from mixprec.precision.presets import ALIASES, APEX_LEVELS, PRESETS

__all__ = ["Policy", "PRESETS", "ALIASES", "APEX_LEVELS", "LossScaler", "LossScaleConfig", "has_fast_matmul", "parse_dtype", "dtype_name"]
