"""The [plan] config table: what `mixprec plan` measures and how it chooses (no torch
import, so the command line parses before torch loads)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from mixprec.errors import check_value

OBJECTIVES = ("coverage", "speed")
TARGETS = ("", "h100")


@dataclass(frozen=True)
class PlanConfig:
    """`mixprec plan`: each Linear layer's three GEMMs measured in each candidate format on
    real training steps, and a format chosen per layer; the [plan] table."""

    out: str = "plan.toml"
    """Where the plan file is written; a training run takes it as precision.plan."""
    steps: int = 8
    """Training steps the planner runs (from scratch, or on from checkpoint.load_step's checkpoint); the last measure_steps of them are measured. Nothing is saved."""
    measure_steps: int = 2
    """Steps measured; a layer's figures are its worst over them."""
    candidates: tuple[str, ...] = ("fp8-tensorwise", "fp8-rowwise", "fp8-blockwise")
    """Formats a layer may take instead of the base mode's (current-scaling FP8 recipes); a layer no candidate suits stays in the base mode."""
    objective: str = "coverage"
    """coverage: every layer some candidate suits takes the most accurate such one (no timing needed); speed: the one with the largest expected GEMM speed-up, and only a speed-up."""
    target: str = ""
    """speed: whose GEMM speed counts. Empty: this device's, measured (an emulated format is no speed-up); h100: a stated table of measured H100 throughputs, marked as modeled."""
    forward_floor_db: float = 25.0
    """A candidate suits a layer when its forward GEMM's SQNR against the FP32 GEMM on the same tensors is at least this (torchao's bar for an FP8 Linear's output) ..."""
    gradient_floor_db: float = 18.0
    """... and its input-gradient and weight-gradient GEMMs' SQNR at least this (torchao's bar for the gradients) ..."""
    interval: int = 0
    """Re-planning during training: every this many steps each FP8 layer is measured in its own format on that step's tensors, and one that misses the floors computes in the base mode's dtype from then on (logged, in metrics.jsonl, summary.json and checkpoints). 0: off."""
    max_lost: float = 0.01
    """... and its casts flush to zero or saturate at most this share of any operand's values (a whole-tensor SQNR can hide an outlier that flushes the rest of its tile)."""
    min_expert_tokens: int = 32
    """A mixture of experts' experts module whose experts received a median of fewer rows than this in the measured step stays in the base mode (per-expert casts and GEMMs on so few rows cost more than they save)."""

    def __post_init__(self):
        def check(ok: bool, name: str, accepted: str):
            check_value(ok, f"plan.{name}", getattr(self, name), accepted)

        check(bool(self.out.strip()), "out", "a file path")
        check(self.steps >= 1, "steps", "an integer >= 1")
        check(self.interval >= 0, "interval", "an integer >= 0 (0: no re-planning)")
        check(1 <= self.measure_steps <= self.steps, "measure_steps", f"an integer from 1 to plan.steps ({self.steps})")
        check(self.objective in OBJECTIVES, "objective", ", ".join(OBJECTIVES))
        check(self.target in TARGETS, "target", "empty (this device, measured) or h100 (modeled)")
        for name in ("forward_floor_db", "gradient_floor_db"):
            check(math.isfinite(getattr(self, name)), name, "a number of dB")
        check(0 <= self.max_lost <= 1, "max_lost", "a share from 0 to 1")
        check(self.min_expert_tokens >= 0, "min_expert_tokens", "an integer >= 0")
        check(bool(self.candidates), "candidates", "one or more FP8 recipes, e.g. fp8-rowwise,fp8-blockwise")
