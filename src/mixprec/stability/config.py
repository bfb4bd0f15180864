"""The [stability] config table and the fault-injection drills it names (no torch
import, so the command line parses before torch loads)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from mixprec.errors import UserError, check_value

_DRILL = re.compile(r"^(?:(?P<kind>nan|fp8scale)@(?P<nan_step>\d+):(?P<fqn>[\w.]+)(?::(?P<rank>\d+))?"
                    r"|spike@(?P<spike_step>\d+))$")
DRILL_FORMS = "nan@STEP:MODULE_FQN (on every rank), nan@STEP:MODULE_FQN:RANK, fp8scale@STEP:FP8_LAYER_FQN, spike@STEP"


@dataclass(frozen=True)
class Drill:
    """A fault injected once, on purpose: a NaN in one module's forward output, an FP8
    layer's scale corrupted to infinity, or a loss multiplied up (as a corrupted batch would)."""

    kind: str  # "nan", "fp8scale" or "spike"
    step: int  # the optimizer step (1-based, as in the log) it fires in
    fqn: str = ""  # nan: the module whose output gets the NaN
    rank: int | None = None  # nan: only this rank (None: every rank)

    def __str__(self) -> str:
        if self.kind == "spike":
            return f"spike@{self.step}"
        return f"{self.kind}@{self.step}:{self.fqn}" + ("" if self.rank is None else f":{self.rank}")


def parse_drill(spec: str) -> Drill | None:
    """`stability.inject`'s text as a Drill (None for an empty string)."""
    spec = spec.strip()
    if not spec:
        return None
    m = _DRILL.match(spec)
    if m is None or int(m["nan_step"] or m["spike_step"]) < 1:
        raise UserError(f"stability.inject: bad value {spec!r}; accepted: {DRILL_FORMS} (STEP >= 1), or empty")
    if m["spike_step"]:
        return Drill("spike", int(m["spike_step"]))
    return Drill(m["kind"], int(m["nan_step"]), m["fqn"], None if m["rank"] is None else int(m["rank"]))


@dataclass(frozen=True)
class StabilityConfig:
    """Health checks, the locator and automatic recovery; the [stability] config table."""

    enable: bool = True
    """Check every step's loss and gradient norm; on an incident, locate, diagnose and recover. Costs no extra host sync."""
    window: int = 128
    """Steps of loss and gradient-norm history the z-scores are taken against (OLMo-core: 128). Checks start once a quarter of it is filled."""
    threshold: float = 6.0
    """A loss or gradient norm this many standard deviations above the window's mean is a spike (OLMo-core: 6)."""
    snapshot_interval: int = 50
    """Keep the last good state in memory every this many steps (one more copy of the model and optimizer state, in CPU memory for one process); 0: rewind to the last checkpoint instead."""
    max_rewinds: int = 3
    """Rewinds before giving up (exit code 3, the last good checkpoint kept on disk); 0: detect and report only, never rewind."""
    lr_backoff: float = 0.5
    """After a rewind the learning rate is multiplied by this, ..."""
    backoff_steps: int = 20
    """... then rises back linearly to the schedule over this many steps (a re-warm-up); 0: no back-off."""
    inject: str = ""
    """Fault-injection drill, fired once: nan@STEP:MODULE_FQN (a NaN in that module's forward output at that step; :RANK at the end for one rank only), fp8scale@STEP:FP8_LAYER_FQN (that FP8 layer's dequantisation scale corrupted to infinity in that step: its output overflows, a fault of the FP8 path only) or spike@STEP (that step's loss multiplied by 1000, as a corrupted batch would)."""

    def __post_init__(self):
        def check(ok: bool, name: str, accepted: str):
            check_value(ok, f"stability.{name}", getattr(self, name), accepted)

        check(self.window >= 4, "window", "an integer >= 4")
        check(0 < self.threshold < float("inf"), "threshold", "a positive number")
        check(self.snapshot_interval >= 0, "snapshot_interval", "an integer >= 0 (0: the last checkpoint)")
        check(self.max_rewinds >= 0, "max_rewinds", "an integer >= 0")
        check(0 < self.lr_backoff <= 1, "lr_backoff", "a number in (0, 1]")
        check(self.backoff_steps >= 0, "backoff_steps", "an integer >= 0")
        parse_drill(self.inject)

    @property
    def drill(self) -> Drill | None:
        return parse_drill(self.inject)

    @property
    def min_history(self) -> int:
        return max(2, self.window // 4)
