"""The [fp8] config table: which low-precision recipe the block projections use on top of
precision.preset, and its options (no torch import, so the command line parses before torch
loads; the recipe registry is imported only when a recipe is named)."""

from __future__ import annotations

from dataclasses import dataclass

from mixprec.errors import check_value


@dataclass(frozen=True)
class FP8Config:
    """The [fp8] table: low-precision GEMMs on top of precision.preset, and the recipe's options."""

    recipe: str = ""
    """Low-precision GEMMs for the block projections on top of precision.preset: a registered recipe (tensorwise, delayed, rowwise, blockwise, mxfp8, nvfp4, mxfp4, ...). Empty: none, or the recipe of an fp8-* (or mxfp8, nvfp4, mxfp4) preset."""
    filter_fqns: tuple[str, ...] = ()
    """Linear layers left in the base mode: substrings of their names or fnmatch globs (layers.0.*). The model's output projection (whatever its name) and layers whose dimensions are not multiples of 16 are always left out."""
    amax_history_len: int = 16
    """Delayed scaling: steps of amax history per tensor."""
    amax_compute_algo: str = "max"
    """Delayed scaling: the scale comes from the history's max or its most_recent amax."""
    margin: int = 0
    """Delayed scaling: scale = fp8_max / amax / 2**margin."""
    emulate: bool = False
    """Run every FP8 GEMM as FP32 GEMMs on the FP8 values (the same numerics); false: torch's scaled GEMM wherever it has one for the layout (block-wise on a CPU is emulated either way)."""
    grad_format: str = ""
    """mxfp8: the gradients' elements, e4m3 or e5m2 (Transformer Engine's HYBRID). Empty: the recipe's (e4m3)."""
    scale_rounding: str = ""
    """mxfp8, mxfp4: E8M0 block scales rounded ceil (RCEIL: the block's amax never saturates), floor (OCP) or even (OCP, the amax rounded to the element's width first). Empty: the recipe's (ceil)."""
    weight_2d: str = ""
    """nvfp4: weights in 16x16 blocks, one quantised copy for W and W^T (true/false). Empty: the recipe's (true)."""
    stochastic_gradients: str = ""
    """nvfp4, mxfp4: gradients stochastically rounded to e2m1 (true/false). Empty: the recipe's (nvfp4 true, mxfp4 false)."""
    hadamard: str = ""
    """nvfp4, mxfp4: 16x16 Hadamard transform of the weight-gradient GEMM's operands: none, random, deterministic. Empty: the recipe's (nvfp4 random, mxfp4 none)."""
    four_over_six: str = ""
    """nvfp4: each block's amax mapped to 4 or 6, whichever reconstructs it better (true/false). Empty: the recipe's (false)."""
    keep_last_blocks: float = -1.0
    """Microscaled recipes: the share of decoder blocks, from the last, kept in the base mode (0 to 1). -1: the recipe's (nvfp4 0.15, others 0)."""

    def __post_init__(self):
        if self.recipe:  # the registry imports torch: only when a recipe is named
            from mixprec.narrow.formats.recipe import RECIPES

            check_value(self.recipe in RECIPES, "fp8.recipe", self.recipe, f"{', '.join(RECIPES)} (or empty)")
        check_value(self.amax_history_len >= 1, "fp8.amax_history_len", self.amax_history_len, "a positive integer")
        check_value(self.amax_compute_algo in ("max", "most_recent"), "fp8.amax_compute_algo", self.amax_compute_algo,
               "max, most_recent")
        check_value(self.margin >= 0, "fp8.margin", self.margin, "an integer >= 0")
        for name, accepted in (("grad_format", ("e4m3", "e5m2")), ("scale_rounding", ("ceil", "floor", "even")),
                               ("hadamard", ("none", "random", "deterministic")), ("weight_2d", ("true", "false")),
                               ("stochastic_gradients", ("true", "false")), ("four_over_six", ("true", "false"))):
            check_value(getattr(self, name) in ("",) + accepted, f"fp8.{name}", getattr(self, name),
                   f"{', '.join(accepted)} (or empty: the recipe's)")
        check_value(self.keep_last_blocks == -1.0 or 0.0 <= self.keep_last_blocks < 1.0, "fp8.keep_last_blocks",
               self.keep_last_blocks, "a share in [0, 1) (or -1: the recipe's)")

    @property
    def options(self) -> dict:
        """The recipe options to apply: delayed scaling's always, the microscaled ones where set."""
        options = {"amax_history_len": self.amax_history_len, "amax_compute_algo": self.amax_compute_algo,
                   "margin": self.margin}
        if self.grad_format:
            from mixprec.dtypes import parse_element

            options["grad_dtype"] = parse_element(self.grad_format, "fp8.grad_format")
        for name in ("weight_2d", "stochastic_gradients", "four_over_six"):
            if getattr(self, name):
                options[name] = getattr(self, name) == "true"
        for name in ("scale_rounding", "hadamard"):
            if getattr(self, name):
                options[name] = getattr(self, name)
        if self.keep_last_blocks != -1.0:
            options["keep_last_blocks"] = self.keep_last_blocks
        return options
