"""What one optimizer step did: `Policy.step` returns it, the trainer logs it, the stability
guard reads it. Truthy when the step was applied, so `if policy.step(optimizer): ...` reads
as before. StepCounts: the policy's running counts of what the steps did."""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger("mixprec.precision.policy")  # where these lines have always come from


@dataclass(frozen=True)
class StepResult:
    applied: bool  # the optimizer stepped (no overflow, no non-finite gradient)
    overflow: bool = False  # the loss scaler found an inf/NaN gradient: its business, not an incident
    nonfinite: bool = False  # without a loss scaler, a non-finite gradient norm skipped the step
    clipped: bool = False  # clipping scaled the gradients down (their norm was above max_norm)
    grad_norm: float | None = None  # the global gradient norm, on the host
    loss_scale: float | None = None  # after the step's update; None without loss scaling
    precision: str = ""  # the mode the step ran in (after a fallback, the new one)
    fallback: str | None = None  # the reason a fallback happened at this step

    def __bool__(self) -> bool:
        return self.applied


class StepCounts:
    """The policy's counters: steps taken, skipped, skipped for a non-finite gradient norm
    (each logged, then every hundredth), and loss-scaler overflows."""

    def __init__(self, steps: int = 0, skipped: int = 0, nonfinite: int = 0, overflows: int = 0):
        self.steps, self.skipped, self.nonfinite, self.overflows = steps, skipped, nonfinite, overflows

    def record(self, applied: bool, overflow: bool, nonfinite: bool, norm: float) -> None:
        self.steps += 1
        self.skipped += not applied
        self.overflows += overflow
        if nonfinite:
            self.nonfinite += 1
            if self.nonfinite <= 10 or self.nonfinite % 100 == 0:
                logger.warning("[NONFINITE] step %d: gradient norm %s: step skipped (weights, optimizer state and "
                               "learning-rate schedule untouched; %d such steps so far)", self.steps, norm,
                               self.nonfinite)
