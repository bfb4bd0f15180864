"""Narrow formats: the FP8 recipes on torch's scaled GEMMs and the microscaled MXFP8, NVFP4 and
MXFP4 recipes (emulated), scaling, and the layers that run them (Linear, grouped experts), conversion.
The face of packages laid out by concept in floors (docs/architecture.md): kernels, formats, gemm,
linear, experts, fsdp, and convert on top; the names below are its public ones."""

from mixprec.narrow.convert import Conversion, convert_to_fp8, why_not
from mixprec.narrow.gemm.fp8 import emulated_mm, kernel_mm, scaled_mm
from mixprec.narrow.linear.fp8 import FP8Linear
from mixprec.narrow.formats.mx import MXRecipe
from mixprec.narrow.linear.mx import MXLinear
from mixprec.narrow.formats.recipe import E4M3, E5M2, RECIPES, FP8Recipe, Granularity, Scaling, register_recipe
from mixprec.narrow.formats.scaling import Quantized, amax_to_scale, quantize, sqnr

__all__ = [
    # recipes
    "FP8Recipe", "MXRecipe", "RECIPES", "Granularity", "Scaling", "E4M3", "E5M2", "register_recipe",
    # conversion
    "convert_to_fp8", "Conversion", "FP8Linear", "MXLinear", "why_not",
    # numerics
    "quantize", "amax_to_scale", "Quantized", "scaled_mm", "emulated_mm", "kernel_mm", "sqnr",
]
