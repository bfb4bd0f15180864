"""Low-precision GEMM training: FP8 recipes on torch's scaled GEMMs, the microscaled MXFP8, NVFP4
and MXFP4 recipes (emulated), scaling, the converted Linear layers, conversion."""

from mixprec.fp8.convert import Conversion, convert_to_fp8, why_not
from mixprec.fp8.gemm import emulated_mm, kernel_mm, scaled_mm
from mixprec.fp8.linear import FP8Linear
from mixprec.fp8.mx import MXLinear, MXRecipe
from mixprec.fp8.recipe import E4M3, E5M2, RECIPES, FP8Recipe, Granularity, Scaling
from mixprec.fp8.scaling import Quantized, amax_to_scale, quantize, sqnr

__all__ = [
    # recipes
    "FP8Recipe", "MXRecipe", "RECIPES", "Granularity", "Scaling", "E4M3", "E5M2",
    # conversion
    "convert_to_fp8", "Conversion", "FP8Linear", "MXLinear", "why_not",
    # numerics
    "quantize", "amax_to_scale", "Quantized", "scaled_mm", "emulated_mm", "kernel_mm", "sqnr",
]
