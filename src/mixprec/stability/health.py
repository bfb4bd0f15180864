"""Health of each step: the loss and the gradient norm against a rolling window.

Both values are already on the host (the loop logs them), so the check costs no sync.
A value more than `threshold` standard deviations above the window's mean is a spike
(OLMo-core skips such steps with 6 over 128 steps); a non-finite loss, or a non-finite
gradient norm that the loss scaler did not claim as an overflow, is an incident too.
Only healthy steps enter the window, so a spike does not widen the band that judges
the next one. A gradient-norm spike with a healthy loss is a warning, not an incident:
where clipping scaled the gradients down it bounded the update (a clean small-flavor run
had one such real spike, 15.7 standard deviations, that a rewind would only have wasted
steps on); where clipping is off, healthy runs have them too (0-3 in 400 steps, each a rewind
of up to 50 steps before), and an update that did harm shows in the losses that follow, which
are judged. A spike in the loss, or a non-finite value, still is an incident. The spike score
is OLMo 2's: the share of the last `window` steps whose loss spiked, in percent.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass
class Health:
    loss_z: float | None  # None until the window holds min_history steps
    grad_norm_z: float | None
    spike_score: float
    kind: str | None = None  # None (healthy), nonfinite, loss_spike
    reason: str = ""
    warning: str = ""  # a healthy step's note: a gradient-norm spike with a healthy loss

    def metrics(self) -> dict:
        return {"loss_z": self.loss_z, "grad_norm_z": self.grad_norm_z, "spike_score": self.spike_score}


def _mean_std(window: deque) -> tuple[float, float]:
    # plain float sums: statistics.pstdev's exact arithmetic costs ~100 us a call here
    mean = math.fsum(window) / len(window)
    return mean, math.sqrt(math.fsum((x - mean) ** 2 for x in window) / len(window))


def _z(value: float, window: deque, min_history: int) -> float | None:
    if len(window) < min_history:
        return None
    mean, std = _mean_std(window)
    return (value - mean) / std if std > 0 else 0.0


class HealthMonitor:
    def __init__(self, window: int, threshold: float, min_history: int):
        self.window, self.threshold, self.min_history = window, threshold, min_history
        self.losses: deque[float] = deque(maxlen=window)
        self.norms: deque[float] = deque(maxlen=window)
        self.spikes: deque[int] = deque()  # steps whose loss spiked (kept across rewinds)

    def check(self, step: int, loss: float, grad_norm: float | None, overflow: bool = False) -> Health:
        """`overflow`: the loss scaler skipped this step (fp16): its business, not an incident.
        Whether clipping bounded a gradient-norm spike changes nothing here (a warning either
        way); the caller says which in its log."""
        finite_norm = grad_norm is not None and math.isfinite(grad_norm)
        loss_z = _z(loss, self.losses, self.min_history) if math.isfinite(loss) else None
        norm_z = _z(grad_norm, self.norms, self.min_history) if finite_norm else None
        kind, reason, warning = None, "", ""
        if not math.isfinite(loss):
            kind, reason = "nonfinite", f"loss is {loss}"
        elif grad_norm is not None and not finite_norm and not overflow:
            kind, reason = "nonfinite", f"gradient norm is {grad_norm} with a finite loss {loss:.4g}"
        elif loss_z is not None and loss_z > self.threshold:
            kind = "loss_spike"
            reason = (f"loss {loss:.4g} is {loss_z:.1f} standard deviations above the mean of the last "
                      f"{len(self.losses)} steps ({_mean_std(self.losses)[0]:.4g}; threshold {self.threshold:g})")
        elif norm_z is not None and norm_z > self.threshold:
            text = (f"gradient norm {grad_norm:.4g} is {norm_z:.1f} standard deviations above the mean of the "
                    f"last {len(self.norms)} steps ({_mean_std(self.norms)[0]:.4g}; threshold {self.threshold:g})")
            warning = text  # the loss is healthy: a warning (see the module's note)
        if kind == "loss_spike":
            self.spikes.append(step)
        while self.spikes and self.spikes[0] <= step - self.window:
            self.spikes.popleft()
        if kind is None and not overflow:
            self.losses.append(loss)
            if finite_norm and not warning:  # a spike does not widen the band
                self.norms.append(grad_norm)
        return Health(loss_z, norm_z, 100.0 * len(self.spikes) / self.window, kind, reason, warning)

    def state_dict(self) -> dict:
        return {"losses": list(self.losses), "norms": list(self.norms), "spikes": list(self.spikes)}

    def load_state_dict(self, state: dict, spikes: bool = True) -> None:
        """spikes False: keep this monitor's spike record (a rewind does not undo a spike)."""
        self.losses = deque(map(float, state["losses"]), maxlen=self.window)
        self.norms = deque(map(float, state["norms"]), maxlen=self.window)
        if spikes:
            self.spikes = deque(map(int, state["spikes"]))
