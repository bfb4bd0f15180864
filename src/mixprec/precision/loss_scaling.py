"""The loss-scaling part of a policy: the scaler, its log lines, and the decision to fall
back to another precision (the part counts the overflows it decides on; the monitor only
writes the log)."""

from __future__ import annotations

import torch

from mixprec.precision.loss_scaler import LossScaler
from mixprec.precision.monitor import ScaleMonitor
from mixprec.precision.scaling_config import LossScaleConfig


class LossScaling:
    def __init__(self, config: LossScaleConfig, device: torch.device | str, fallback_to: str | None):
        self.config, self.fallback_to = config, fallback_to
        self.scaler = LossScaler(device, config=config)
        self.monitor = ScaleMonitor()
        self.consecutive = 0  # overflows in a row: fallback_after counts these
        self._last: float | None = None  # the scale after the last step read (None: the initial one)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def unscale(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """Unscale the gradients in place; 1.0 on the device where any overflowed, else 0.0."""
        self.scaler.unscale_(optimizer)
        return self.scaler._found_inf_async()

    def update(self) -> torch.Tensor:
        """Move the scale after a step, on the device; the scale tensor (updated in place)."""
        self.scaler.update()
        return self.scaler._get_scale_async()

    @property
    def value(self) -> float:
        return self.scaler.get_scale()

    def record(self, step: int, overflow: bool, after: float) -> str | None:
        """What a step did to the scale, read on the host (the scaler moved it on the device):
        the log line, the overflows in a row, and the reason to fall back now, or None."""
        before = self._last if self._last is not None else self.config.init_scale
        self._last = after
        self.consecutive = self.consecutive + 1 if overflow else 0
        self.monitor.record(step, overflow, before, after, self.config.growth_interval)
        if not self.fallback_to:
            return None
        if overflow and before <= self.config.min_scale:
            return f"at the minimum loss scale {before:g}"
        if self.config.fallback_after and self.consecutive >= self.config.fallback_after:
            return f"after {self.consecutive} consecutive overflows"
        return None

    def back_off(self) -> tuple[float, float]:
        """Multiply the scale by backoff_factor (after a rewind): (before, after)."""
        before = self.scaler.get_scale()
        self.scaler.update(max(self.config.min_scale, before * self.config.backoff_factor))
        self._last = self.scaler.get_scale()
        return before, self._last

    def state_dict(self) -> dict:
        return {"consecutive": self.consecutive, "scaler": self.scaler.state_dict()}

    def load_state_dict(self, monitor: dict, scaler: dict | None) -> None:
        self.consecutive = int(monitor.get("consecutive", 0))
        self.monitor.load_state_dict(monitor)
        if scaler:
            self.scaler.load_state_dict(scaler)
        self._last = self.scaler.get_scale()
