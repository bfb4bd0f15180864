"""Precision as data: what every tensor role of a training step is kept or computed in.

A PrecisionSpec is frozen and says it once; a preset is a name for one (presets.py). The
per-module overrides are ordered rules from FQN patterns to another compute format; the
spec resolved against a model is a per-module table (layout.py) that `describe` prints,
the audit checks module by module and the memory planner turns into bytes.

    spec = PrecisionSpec(storage_dtype=FP32, param_dtype=BF16,
                         overrides=(Override.parse("layers.0.*=float32"),))

Roles that no mode changes: norms, softmax, RoPE, logits and the loss are FP32 (the model
upcasts them), and a gradient takes its parameter's dtype (autocast's casts are
differentiable: the gradient of an FP32 leaf is FP32).
"""

from __future__ import annotations

import enum
import fnmatch
from dataclasses import dataclass, field

import torch

from mixprec.dtypes import dtype_name, parse_dtype
from mixprec.errors import UserError
from mixprec.narrow.formats.recipe import RECIPES, FP8Recipe
from mixprec.optim.state_formats import StateFormat

FP32, BF16, FP16 = torch.float32, torch.bfloat16, torch.float16
Format = torch.dtype | FP8Recipe  # a matmul's compute format


class Update(enum.Enum):
    """How a weight without an FP32 master copy takes its update (mixprec.optim.updates)."""
    NEAREST = "nearest"  # rounded to the storage dtype
    KAHAN = "kahan"  # a compensation buffer per parameter carries each rounding error
    STOCHASTIC = "stochastic"  # stochastically rounded to bfloat16 (seeded)


def format_name(fmt: Format) -> str:
    return fmt.preset if isinstance(fmt, FP8Recipe) else dtype_name(fmt)


def parse_format(text, where: str) -> Format:
    """A compute format by name: a dtype name, or a recipe by its preset or its name (fp8-rowwise or
    rowwise, nvfp4)."""
    if isinstance(text, (torch.dtype, FP8Recipe)):
        return parse_dtype(text, where) if isinstance(text, torch.dtype) else text
    name = str(text).strip().lower()
    recipe = next((r for r in RECIPES.values() if name in (r.name, r.preset)), None)
    if recipe is not None:
        return recipe
    try:
        return parse_dtype(name, where)
    except UserError:
        raise UserError(f"{where}: unknown compute format {text!r}; accepted: float32, bfloat16, float16, "
                        f"{', '.join(r.preset for r in RECIPES.values())}") from None


@dataclass(frozen=True)
class Override:
    """Modules whose FQN matches `modules` (fnmatch) compute their matmuls in `compute`.
    source: where a rule for one exact module came from (a plan file); empty for the
    user's own rules."""
    modules: str
    compute: Format
    source: str = field(default="", compare=False)

    @classmethod
    def parse(cls, rule) -> Override:
        """From "PATTERN=FORMAT" (the command line's form) or {"modules": ..., "compute": ...} (TOML's)."""
        if isinstance(rule, Override):
            return rule
        if isinstance(rule, dict):
            unknown = set(rule) - {"modules", "compute"}
            if unknown or not {"modules", "compute"} <= set(rule):
                raise UserError(f"precision.override: bad rule {rule!r}; accepted: modules = \"PATTERN\", "
                                "compute = \"FORMAT\"")
            pattern, fmt = rule["modules"], rule["compute"]
        else:
            pattern, sep, fmt = str(rule).partition("=")
            if not sep:
                raise UserError(f"precision.override: bad rule {rule!r}; accepted: PATTERN=FORMAT, e.g. "
                                "layers.0.*=float32")
        if not str(pattern).strip():
            raise UserError(f"precision.override: rule {rule!r} names no modules; accepted: an fnmatch pattern")
        return cls(str(pattern).strip(), parse_format(fmt, f"precision.override {str(pattern).strip()!r}"))

    def matches(self, fqn: str) -> bool:
        return fnmatch.fnmatchcase(fqn, self.modules)

    def __str__(self) -> str:
        return f"{self.modules}={format_name(self.compute)}"

    @property
    def why(self) -> str:
        """The reason a layout row gives for a module this rule decided."""
        return f"{self.source}: {format_name(self.compute)}" if self.source else f"precision.override {self}"


@dataclass(frozen=True)
class PrecisionSpec:
    storage_dtype: torch.dtype = FP32
    """The model's parameters; without master weights also their gradients and optimizer moments."""
    param_dtype: torch.dtype = FP32
    """Matmul compute (torch.autocast, or fully_shard's all-gather, casts to it where it differs from storage)."""
    reduce_dtype: torch.dtype = FP32
    """Gradient reduction across data-parallel ranks."""
    master_weights: bool = False
    """FP32 copies of the parameters live with the optimizer; norm layers stay FP32 in the model (Apex O2)."""
    loss_scaling: bool = False
    """Dynamic loss scaling (float16 compute)."""
    update: Update = Update.NEAREST
    """How a low-precision weight without a master copy takes its update."""
    fp8: FP8Recipe | None = None
    """An FP8 recipe for the Linear layers FP8 can take (not the output projection)."""
    overrides: tuple[Override, ...] = ()
    """Ordered per-module rules; the first that matches a module's FQN decides its compute format."""
    optimizer_states: StateFormat | None = None
    """AdamW's moments (fp32, bf16, fp16, fp8, 8bit); None: the mode's own (see `moments`)."""
    summary: str = field(default="", compare=False)
    """One line for logs and --help."""

    def __post_init__(self):
        for name in ("storage_dtype", "param_dtype", "reduce_dtype"):
            object.__setattr__(self, name, parse_dtype(getattr(self, name), name))
        if isinstance(self.update, str):
            accepted = [u.value for u in Update if u is not Update.NEAREST]
            if self.update not in accepted:
                raise UserError(f"update {self.update!r}: accepted {', '.join(accepted)}")
            object.__setattr__(self, "update", Update(self.update))
        object.__setattr__(self, "overrides", tuple(Override.parse(r) for r in self.overrides))
        if self.optimizer_states is not None:
            object.__setattr__(self, "optimizer_states", StateFormat.of(self.optimizer_states))
            self._check_states(self.optimizer_states)
        storage, param = self.storage_dtype, self.param_dtype
        if storage != FP32 and param != storage:
            raise UserError(f"param_dtype {dtype_name(param)} with storage_dtype {dtype_name(storage)}: a "
                            f"{dtype_name(storage)} model computes in {dtype_name(storage)}; accepted: param_dtype "
                            "equal to storage_dtype, or storage_dtype float32")
        if self.master_weights and storage == FP32:
            raise UserError("master_weights with storage_dtype float32: the parameters are already float32; "
                            "accepted: storage_dtype float16 or bfloat16")
        if self.update is not Update.NEAREST:
            wanted = BF16 if self.update is Update.STOCHASTIC else None
            if storage == FP32 or self.master_weights or (wanted and storage != wanted):
                raise UserError(f"{self.update.value} updates need a {dtype_name(wanted) if wanted else 'low-precision'}"
                                f" model without master weights (storage_dtype {dtype_name(storage)}"
                                f"{', master_weights' if self.master_weights else ''}); accepted: bf16-kahan, bf16-sr")
        fp8_formats = [self.fp8] + [o.compute for o in self.overrides if isinstance(o.compute, FP8Recipe)]
        if any(fp8_formats) and (self.loss_scaling or param == FP16):
            # a float16 mode may fall back to another precision mid-run; the FP8 layers' output dtype is fixed
            recipe = next(r for r in fp8_formats if r)
            raise UserError(f"fp8 recipe {recipe.name!r} on a float16 mode: FP8 recipes build on fp32, bf16-mixed, "
                            "bf16-master, bf16-true")
        for rule in self.overrides:
            self._check_override(rule)

    def _check_states(self, states: StateFormat) -> None:
        """Which moments each way of updating the weights can keep."""
        if self.update is Update.STOCHASTIC and states.name != "bf16":
            raise UserError(f"precision.optimizer_states {states.name} with bf16-sr: its stochastically rounded "
                            "updates keep bfloat16 moments; accepted: bf16 (or bf16-kahan for 8-bit moments)")
        if self.update is Update.KAHAN and not (states.quantized or states.name == "bf16"):
            raise UserError(f"precision.optimizer_states {states.name} with bf16-kahan: accepted: bf16, fp8, 8bit")
        own = self.storage_dtype if not self.master_weights else FP32
        if self.storage_dtype != FP32 and not self.master_weights and not states.quantized \
                and states.dtype != self.storage_dtype:
            raise UserError(f"precision.optimizer_states {states.name} with a {dtype_name(own)} model: its moments "
                            f"follow its {dtype_name(own)} parameters or are quantized; accepted: "
                            f"{'bf16' if own == BF16 else 'fp16'}, fp8, 8bit")

    def _check_override(self, rule: Override) -> None:
        fmt = rule.compute
        if isinstance(fmt, FP8Recipe) or fmt == self.param_dtype:
            return
        where = f"precision.override {rule}"
        if self.storage_dtype != FP32:
            raise UserError(f"{where}: a {dtype_name(self.storage_dtype)} model computes in "
                            f"{dtype_name(self.storage_dtype)} (its weights are stored so); accepted: "
                            f"{dtype_name(self.storage_dtype)} or an FP8 recipe, or a mode with float32 storage")
        if fmt == FP16 and not self.loss_scaling:
            raise UserError(f"{where}: float16 compute needs loss scaling, which this mode has not; accepted: "
                            "float32, bfloat16 or an FP8 recipe (or an fp16 mode)")
        if fmt == BF16 and self.loss_scaling:
            raise UserError(f"{where}: bfloat16 in a float16 mode; accepted: float32 or float16")

    def check_shardable(self) -> None:
        """Under fully_shard a block's parameters are all-gathered in param_dtype, so no layer
        of it can compute in float32 (a per-module fully_shard could; not done)."""
        wider = [str(o) for o in self.overrides if o.compute == FP32 and self.param_dtype != FP32]
        if wider:
            raise UserError(f"precision.override {wider[0]} under fully_shard: the block's parameters are "
                            f"all-gathered in {dtype_name(self.param_dtype)}, so the layer cannot compute in float32; "
                            "accepted: bfloat16 or FP8 overrides, or data_parallel_shard_degree 1")

    # ---- what the spec says, role by role ------------------------------------------------
    @property
    def moments(self) -> StateFormat:
        """AdamW's moments: optimizer_states where given; beside FP32 weights the recipe's
        (bfloat16 under fp8-blockwise, as DeepSeek-V3); else the masters' FP32 or the
        storage dtype."""
        if self.optimizer_states is not None:
            return self.optimizer_states
        if self.fp8 is not None and self.storage_dtype == FP32:
            return StateFormat.of(self.fp8.moments_dtype)
        return StateFormat.of(FP32 if self.master_weights else self.storage_dtype)

    @property
    def compute_formats(self) -> set[Format]:
        """Every compute format some module may use."""
        return {self.param_dtype} | ({self.fp8} if self.fp8 else set()) | {o.compute for o in self.overrides}

    @property
    def low_precision_dtypes(self) -> set[torch.dtype]:
        """The bfloat16/float16 matmul dtypes of the spec (what emulation may have to cover)."""
        return {f for f in self.compute_formats if isinstance(f, torch.dtype) and f != FP32}

    def override_for(self, fqn: str) -> Override | None:
        return next((o for o in self.overrides if o.matches(fqn)), None)
