"""What one optimizer step did: `Policy.step` returns it, the trainer logs it, the stability
guard reads it. Truthy when the step was applied, so `if policy.step(optimizer): ...` reads
as before."""

from __future__ import annotations

from dataclasses import dataclass


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
