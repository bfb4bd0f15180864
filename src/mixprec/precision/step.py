"""What one optimizer step did: `Policy.step` returns it, the trainer logs it, the stability
guard reads it. Truthy when the step was applied, so `if policy.step(optimizer): ...` reads
as before. StepCounts: the policy's running counts of what the steps did. ReadSchedule: when
the host reads them, the one place that decides it.

A step decides on the device (mixprec.precision.loss_scaling.step_unless): its figures are
one small tensor there, `StepResult.values`, and a field read on the host is a
device-to-host copy, made on the first access (or by `Policy.settle`, which reads every step
since the last read in one copy) and kept."""

from __future__ import annotations

import logging
from typing import Callable

import torch

logger = logging.getLogger("mixprec.precision.policy")  # where these lines have always come from

# StepResult.values, in this order (float32: every figure is a float32 value or a 0/1 flag)
FIELDS = ("applied", "overflow", "nonfinite", "clipped", "grad_norm", "loss_scale")


class StepResult:
    """applied: the optimizer stepped (no overflow, no non-finite gradient); overflow: the
    loss scaler found an inf/NaN gradient (its business, not an incident); nonfinite:
    without a loss scaler, a non-finite gradient norm skipped the step; clipped: clipping
    scaled the gradients down; grad_norm: the global gradient norm; loss_scale: after the
    step's update (None without loss scaling); precision: the mode the step ran in (after
    a fallback, the new one); fallback: the reason a fallback happened at this step."""

    def __init__(self, values: torch.Tensor, precision: str = "", fallback: str | None = None, scaled: bool = True):
        self.values, self._host = values, None  # values: FIELDS, on the device
        self.precision, self.fallback, self.scaled = precision, fallback, scaled

    def read(self, host: list[float] | None = None) -> list[float]:
        """The figures on the host: `host` when the caller read them already, else one copy."""
        if self._host is None:
            self._host = host if host is not None else self.values.tolist()
        return self._host

    def on_device(self, name: str) -> torch.Tensor:
        """One figure (a FIELDS name) as a 0-dim tensor on the device: no read."""
        return self.values[FIELDS.index(name)]

    @property
    def is_read(self) -> bool:
        return self._host is not None

    applied = property(lambda self: bool(self.read()[0]))
    overflow = property(lambda self: bool(self.read()[1]))
    nonfinite = property(lambda self: bool(self.read()[2]))
    clipped = property(lambda self: bool(self.read()[3]))
    grad_norm = property(lambda self: self.read()[4])
    loss_scale = property(lambda self: self.read()[5] if self.scaled else None)

    def __bool__(self) -> bool:
        return self.applied

    def __repr__(self) -> str:
        if not self.is_read:
            return f"StepResult(on {self.values.device}, not read yet, precision={self.precision!r})"
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in FIELDS)
        return f"StepResult({fields}, precision={self.precision!r}, fallback={self.fallback!r})"


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
                logger.warning("[NONFINITE] step %d: gradient norm %s: step skipped on the device (weights and "
                               "optimizer state untouched; %d such steps so far)", self.steps, norm, self.nonfinite)


class ReadSchedule:
    """When the host reads what the steps did: the one place a loop waits for the device.
    Due every `every` steps (0: never by count) and at any step `also(step)` names. Each
    policy holds one (`Policy.reads`) and settles at its due steps; whoever runs the loop sets
    it up once and asks it, never counts on its own: the trainer adds its read steps
    (evaluations, checkpoints, the guard's, re-planning) to its metrics.log_freq, a
    framework's steps (mixprec.stability.framework) set its logging interval."""

    def __init__(self, every: int = 10, also: Callable[[int], bool] | None = None):
        if every < 0:
            raise ValueError(f"read every {every} steps: accepted: a number of steps >= 0 (0: only when asked)")
        self.every, self.also = every, also

    def due(self, step: int) -> bool:
        """Whether the host reads after step `step` (1-based)."""
        return bool(self.every and step % self.every == 0) or bool(self.also is not None and self.also(step))
