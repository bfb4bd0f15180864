"""Loss-scale monitoring: counts overflows and writes the log lines, without flooding."""

from __future__ import annotations

import logging

logger = logging.getLogger("mixprec.precision.policy")


class ScaleMonitor:
    """Logs the first `verbose` overflows one by one, then one summary line per
    `summary_every` steps that had any; every growth of the scale is logged."""

    def __init__(self, verbose: int = 10, summary_every: int = 100):
        self.verbose, self.summary_every = verbose, summary_every
        self.overflows = 0
        self.consecutive = 0
        self._quiet = 0  # overflows not logged yet
        self._quiet_from: int | None = None

    def record(self, step: int, overflow: bool, before: float, after: float, growth_interval: int) -> None:
        if overflow:
            self.overflows += 1
            self.consecutive += 1
            if self.overflows <= self.verbose:
                logger.warning("[OVERFLOW] step %d: loss scale %g -> %g (overflow %d/%d)",
                               step, before, after, self.overflows, step)
                if self.overflows == self.verbose:
                    logger.warning("[OVERFLOW] further overflows are summarised every %d steps", self.summary_every)
            else:
                self._quiet += 1
                self._quiet_from = self._quiet_from or step
        else:
            self.consecutive = 0
            if after > before:
                logger.info("[SCALE] loss scale %g -> %g after %d clean steps", before, after, growth_interval)
        if self._quiet and step % self.summary_every == 0:
            logger.warning("[OVERFLOW] steps %d-%d: %d overflows, loss scale now %g (overflow %d/%d)",
                           self._quiet_from, step, self._quiet, after, self.overflows, step)
            self._quiet, self._quiet_from = 0, None

    def state_dict(self) -> dict:
        return {"overflows": self.overflows, "consecutive": self.consecutive}

    def load_state_dict(self, state: dict) -> None:
        self.overflows = int(state.get("overflows", 0))
        self.consecutive = int(state.get("consecutive", 0))
