"""Re-planning during training (`plan.interval`): every N steps, each FP8 layer's three
GEMMs are measured in its own format on that step's live tensors (mixprec.plan.measure,
the planner's own measurement), and a layer that no longer meets the floors is promoted
to the base mode's dtype for the rest of the run: logged with the figures, written to
metrics.jsonl and summary.json, and kept in checkpoints (the policy's record).

The measured step runs eagerly (hooks added to compiled code are not seen) and every
rank takes the same decision: the figures are reduced to their worst over ranks.
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch

from mixprec.plan.choose import choose, floors, suits
from mixprec.plan.measure import GEMMS, Capture, measure
from mixprec.precision.spec import format_name

logger = logging.getLogger(__name__)


class Replanner:
    def __init__(self, config, policy, model: torch.nn.Module, world_size: int = 1):
        self.config, self.policy, self.model, self.world_size = config, policy, model, world_size
        self.measurements, self.seconds = 0, 0.0

    def due(self, step: int) -> bool:
        return bool(self.config.interval) and step % self.config.interval == 0 and bool(self.policy.layout.fp8())

    @contextlib.contextmanager
    def watch(self, step: int):
        """Around training step `step` (1-based): when due, keep its FP8 layers' tensors and,
        after it, measure and promote."""
        if not self.due(step):
            yield
            return
        layers = dict(self.policy.layout.fp8())
        with Capture(self.model, layers) as capture, torch.compiler.set_stance("force_eager"):
            yield
        t0 = time.perf_counter()
        base = format_name(self.policy.param_dtype)
        figures = {fqn: measure(capture.x[fqn], _full(self.model.get_submodule(fqn).weight), capture.dy[fqn],
                                recipe, self.policy.param_dtype) for fqn, recipe in layers.items()}
        if self.world_size > 1:
            _worst_over_ranks(figures)
        floor = floors(self.config)
        for fqn, recipe in layers.items():
            name = format_name(recipe)
            if not suits(figures[fqn], floor):
                _, reason = choose({name: figures[fqn]}, base, floor, "coverage")
                dbs = ", ".join(f"{g.replace('_', ' ')} {figures[fqn][f'{g}_db']:.1f} dB" for g in GEMMS)
                record = self.policy.promote(fqn, step, f"re-planning at step {step}: {reason} ({dbs})")
                logger.warning("[PROMOTE] step %d: %s computes in %s from now on, not %s: %s", step, fqn,
                               record["to"], name, record["evidence"])
        self.measurements += 1
        self.seconds += time.perf_counter() - t0

    def summary(self) -> dict:
        return {"interval": self.config.interval, "measurements": self.measurements,
                "measuring_seconds": round(self.seconds, 2)}


def _full(weight: torch.Tensor) -> torch.Tensor:
    return weight.full_tensor() if hasattr(weight, "full_tensor") else weight


def _worst_over_ranks(figures: dict[str, dict]) -> None:
    """Each SQNR the lowest, each share the largest over ranks, in place."""
    names = list(figures)
    db = torch.tensor([[figures[n][f"{g}_db"] for g in GEMMS] for n in names])
    roles = list(next(iter(figures.values()))["flushed"])
    lost = torch.tensor([[figures[n][k][r] for k in ("flushed", "saturated") for r in roles] for n in names])
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    db, lost = db.to(device), lost.to(device)
    torch.distributed.all_reduce(db, op=torch.distributed.ReduceOp.MIN)
    torch.distributed.all_reduce(lost, op=torch.distributed.ReduceOp.MAX)
    for i, n in enumerate(names):
        figures[n].update({f"{g}_db": float(db[i, j]) for j, g in enumerate(GEMMS)})
        for k, key in enumerate(("flushed", "saturated")):
            figures[n][key] = {r: float(lost[i, k * len(roles) + j]) for j, r in enumerate(roles)}
