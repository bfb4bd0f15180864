"""The [loss_scale] config table: dynamic loss scaling's settings (no torch import, so
the command line parses before torch loads)."""

from __future__ import annotations

from dataclasses import dataclass

from mixprec.errors import UserError, check_value


@dataclass(frozen=True)
class LossScaleConfig:
    """Dynamic loss scaling, with RustGPT's defaults; the [loss_scale] config table."""

    init_scale: float = 65536.0
    """Initial loss scale (fp16 modes)."""
    growth_factor: float = 2.0
    """Scale multiplier after growth_interval clean steps; > 1."""
    backoff_factor: float = 0.5
    """Scale multiplier on an overflow; in (0, 1)."""
    growth_interval: int = 2000
    """Consecutive clean steps before the scale grows."""
    min_scale: float = 1.0
    """The scale never goes below this."""
    max_scale: float = 16777216.0
    """The scale never goes above this (2^24)."""
    hysteresis: int = 1
    """Back off only on the N-th overflow since the last growth (Megatron); 1: on every overflow."""
    fallback_after: int = 5
    """Consecutive overflows that switch the run to fallback_to; 0 never falls back."""
    fallback_to: str = "auto"
    """Precision after a fallback: fp32, bf16-mixed, or auto (bf16-mixed where BF16 matmuls are native, else fp32)."""

    def __post_init__(self):
        def check(ok: bool, field: str, accepted: str):
            check_value(ok, f"loss_scale.{field}", getattr(self, field), accepted)

        check(self.growth_factor > 1, "growth_factor", "a number > 1")
        check(0 < self.backoff_factor < 1, "backoff_factor", "a number in (0, 1)")
        check(self.growth_interval >= 1, "growth_interval", "a positive integer")
        check(self.hysteresis >= 1, "hysteresis", "a positive integer")
        if not 0 <= self.min_scale <= self.max_scale:
            raise UserError(f"loss_scale.min_scale {self.min_scale} > max_scale {self.max_scale}; "
                            "accepted: 0 <= min_scale <= max_scale")
        check(self.min_scale <= self.init_scale <= self.max_scale, "init_scale",
              f"a number in [min_scale, max_scale] = [{self.min_scale}, {self.max_scale}]")
        check(self.fallback_after >= 0, "fallback_after", "an integer >= 0")
        check(self.fallback_to in ("auto", "fp32", "bf16-mixed"), "fallback_to", "auto, fp32, bf16-mixed")
