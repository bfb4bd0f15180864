"""FP8 training recipes: how each GEMM operand of a converted Linear is scaled and cast.

A recipe is a frozen dataclass that carries everything a converted Linear needs: the tile
of each operand's cast (`tiles`) and the operand and output formats of each of the three
GEMMs (`gemms`). The four named ones are registered below; a new recipe is one
`register_recipe(FP8Recipe(...))` (and `mixprec.precision` then knows the preset
`fp8-<name>`):

    recipe = FP8Recipe.from_name("rowwise")

tensorwise  current scaling: one scale per tensor from this step's amax; e4m3 for inputs
            and weights, e5m2 for gradients (Transformer Engine's HYBRID format).
delayed     one scale per tensor from the amax history of earlier steps (Transformer
            Engine's DelayedScaling): no reduction before the cast, and a tensor whose amax
            jumps saturates for one step until the history catches up.
rowwise     one power-of-two scale per row of each operand along the contracted
            dimension, e4m3 everywhere (torchao's "rowwise").
blockwise   DeepSeek-V3: 1x128 tiles for activations and gradients, 128x128 blocks for
            weights, e4m3 everywhere, FP32 partial sums promoted every 128 products along K;
            AdamW moments kept in bfloat16 beside the FP32 master weights.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

import torch

from mixprec.errors import UserError

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


class Granularity(enum.Enum):
    TENSORWISE = "tensorwise"
    ROWWISE = "rowwise"
    BLOCKWISE = "blockwise"
    MICROSCALED = "microscaled"  # blocks of 16 or 32 elements with a shared 8-bit scale (mixprec.narrow.formats.mx)


class Scaling(enum.Enum):
    CURRENT = "current"  # the amax of the tensor being cast
    DELAYED = "delayed"  # the amax history of the steps before


AMAX_COMPUTE_ALGOS = ("max", "most_recent")
GEMMS = ("forward", "input gradient", "weight gradient")


@dataclass(frozen=True)
class Tiles:
    """The tile of each cast, as `quantize` takes it (0: the whole dimension). None reuses
    the cast of the role before it: the weight's for dgrad, the gradient's for wgrad."""
    x: tuple[int, int]
    w: tuple[int, int]
    g: tuple[int, int]
    w_dgrad: tuple[int, int] | None
    g_wgrad: tuple[int, int] | None
    x_wgrad: tuple[int, int] | None

    def gemms(self):
        """(a tile, b tile) of the three GEMMs, b as the (K, N) operand: what to probe."""
        swap = lambda t: (t[1], t[0])  # noqa: E731
        return ((self.x, swap(self.w)), (self.g, self.w_dgrad or self.w),
                (swap(self.g_wgrad or self.g), self.x_wgrad or self.x))


@dataclass(frozen=True)
class FP8Recipe:
    name: str
    granularity: Granularity
    scaling: Scaling = Scaling.CURRENT
    grad_dtype: torch.dtype = E5M2  # gradients: e5m2's range (57344) over e4m3's precision
    power_of_2_scales: bool = False  # a power-of-two scale changes only the exponent: no rounding in the scaling
    amax_history_len: int = 16  # delayed scaling: steps of amax kept
    amax_compute_algo: str = "max"  # delayed scaling: max of the history, or the most recent amax
    margin: int = 0  # delayed scaling: scale = fp8_max / amax / 2**margin
    block: int = 128  # blockwise: tile length; also the promotion interval of the FP32 partial sums
    fast_accum: bool = False  # CUDA: the forward GEMM accumulates in the tensor core's reduced-precision adder
    moments_dtype: torch.dtype = torch.float32  # AdamW's exp_avg and exp_avg_sq

    def __post_init__(self):
        def check(ok, field, value, accepted):
            if not ok:
                raise UserError(f"fp8.{field}: bad value {value!r}; accepted: {accepted}")

        check(self.grad_dtype in (E4M3, E5M2), "grad_dtype", self.grad_dtype, "float8_e4m3fn, float8_e5m2")
        check(self.amax_history_len >= 1, "amax_history_len", self.amax_history_len, "a positive integer")
        check(self.amax_compute_algo in AMAX_COMPUTE_ALGOS, "amax_compute_algo", self.amax_compute_algo,
              ", ".join(AMAX_COMPUTE_ALGOS))
        check(self.margin >= 0, "margin", self.margin, "an integer >= 0")
        check(self.block > 0 and self.block % 16 == 0, "block", self.block, "a positive multiple of 16 (128)")
        check(self.scaling is Scaling.CURRENT or self.granularity is Granularity.TENSORWISE, "recipe",
              f"{self.granularity.value} with delayed scaling", "delayed scaling with tensor-wise scales")
        check(self.moments_dtype in (torch.float32, torch.bfloat16), "moments_dtype", self.moments_dtype,
              "float32, bfloat16")

    def emulation(self, device: str) -> str:
        """What the emulation of this recipe's GEMMs computes on `device`, for the log line that says it is emulated."""
        return "the same numerics: FP32 partial sums of the FP8 products"

    @property
    def preset(self) -> str:
        """The precision preset that is bf16-mixed with this recipe."""
        return f"fp8-{self.name}"

    @property
    def label(self) -> str:
        """The format's name in a sentence ("in FP8")."""
        return "FP8"

    @property
    def saved_bytes(self) -> float:
        """Bytes per element of an operand saved for backward in this recipe's format."""
        return 1.0

    @property
    def operand_formats(self) -> tuple[set, set]:
        """The element formats of the forward GEMM's operands and of the backward GEMMs'."""
        return {E4M3}, {E4M3, self.grad_dtype}

    @property
    def saved_weight_bytes(self) -> float:
        """Bytes per weight element a Linear keeps from forward to backward: its FP8 weight."""
        return 1.0

    @property
    def delayed(self) -> bool:
        return self.scaling is Scaling.DELAYED

    @property
    def tiles(self) -> Tiles:
        b = self.block
        if self.granularity is Granularity.TENSORWISE:
            return Tiles((0, 0), (0, 0), (0, 0), None, None, None)
        if self.granularity is Granularity.ROWWISE:  # each operand along the dimension its GEMM sums over
            return Tiles((1, 0), (1, 0), (1, 0), (0, 1), (0, 1), (0, 1))
        return Tiles((1, b), (b, b), (1, b), None, (b, 1), (b, 1))  # 128x128 blocks serve W and W^T alike

    def gemms(self, compute_dtype: torch.dtype):
        """Each GEMM as (name, (a tile, b tile), (a format, b format, output dtype)): the
        forward and input gradient write the compute dtype, the weight gradient FP32."""
        formats = ((E4M3, E4M3, compute_dtype), (self.grad_dtype, E4M3, compute_dtype),
                   (self.grad_dtype, E4M3, torch.float32))
        return tuple(zip(GEMMS, self.tiles.gemms(), formats))

    @property
    def backward_fp32_copies(self) -> int:
        """FP32 copies of an activation an eager backward makes to cast: the gradient, and
        for scales along M (row- and block-wise) the dequantised input too, besides the
        input's own widening (measured on the debug flavor; the memory planner counts them)."""
        return 2 if self.granularity is Granularity.TENSORWISE else 3

    def with_options(self, **options) -> "FP8Recipe":
        """The recipe with [fp8] table options applied; options delayed scaling does not use
        are refused for current-scaling recipes only when changed from their defaults."""
        delayed_only = {"amax_history_len", "amax_compute_algo", "margin"}
        defaults = FP8Recipe(name="", granularity=Granularity.TENSORWISE)
        foreign = sorted(set(options) - set(self.__dataclass_fields__))
        if foreign:
            raise UserError(f"fp8.{foreign[0]} = {options[foreign[0]]!r} applies to the microscaled recipes only; the "
                            f"{self.name} recipe has no such option (accepted: mxfp8, nvfp4, mxfp4, or leave it out)")
        changed = {k: v for k, v in options.items() if v != getattr(defaults, k)}
        if not self.delayed and changed.keys() & delayed_only:
            key = sorted(changed.keys() & delayed_only)[0]
            raise UserError(f"fp8.{key} = {changed[key]!r} applies to delayed scaling only; the {self.name} recipe "
                            "scales by the current amax (accepted: the fp8-delayed preset, or leave it out)")
        return replace(self, **options)

    def summary(self) -> str:
        grads = "e4m3" if self.grad_dtype == E4M3 else "e5m2"
        how = {Granularity.TENSORWISE: "one scale per tensor", Granularity.ROWWISE: "one scale per row",
               Granularity.BLOCKWISE: f"1x{self.block} activation and {self.block}x{self.block} weight scales"}
        when = (f"delayed scaling over {self.amax_history_len} steps ({self.amax_compute_algo})" if self.delayed
                else "current scaling")
        return f"{how[self.granularity]}, {when}, e4m3 forward, {grads} gradients"

    @classmethod
    def from_name(cls, name: str) -> "FP8Recipe":
        if name not in RECIPES:
            raise UserError(f"fp8.recipe: unknown recipe {name!r}; accepted: {', '.join(RECIPES)}")
        return RECIPES[name]


RECIPES: dict[str, FP8Recipe] = {}  # the registry: config, presets and the CLI validate against it


def register_recipe(recipe: FP8Recipe) -> FP8Recipe:
    """Make `recipe` known by its name (fp8.recipe, the preset fp8-<name>)."""
    if recipe.name in RECIPES and RECIPES[recipe.name] != recipe:
        raise ValueError(f"an FP8 recipe named {recipe.name!r} is registered already")
    RECIPES[recipe.name] = recipe
    return recipe


register_recipe(FP8Recipe("tensorwise", Granularity.TENSORWISE, fast_accum=True))
register_recipe(FP8Recipe("delayed", Granularity.TENSORWISE, Scaling.DELAYED, fast_accum=True))
register_recipe(FP8Recipe("rowwise", Granularity.ROWWISE, grad_dtype=E4M3, power_of_2_scales=True))
register_recipe(FP8Recipe("blockwise", Granularity.BLOCKWISE, grad_dtype=E4M3, moments_dtype=torch.bfloat16))
