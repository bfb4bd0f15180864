"""Fault-injection drills (as Megatron's error injection): prove a recovery setup
before a long run. Each fires once, in the step it names, and says so loudly."""

from __future__ import annotations

import logging

import torch

from mixprec.errors import UserError
from mixprec.narrow.linear.fp8 import FP8Linear, runs_fp8
from mixprec.stability.config import Drill

logger = logging.getLogger("mixprec.stability")

SPIKE_FACTOR = 1000.0  # the loss a corrupted batch gives is many times the usual one


def _poison(module, args, output):
    """The output with its first element NaN (a fresh tensor; autograd flows through the rest)."""
    if not isinstance(output, torch.Tensor) or not output.is_floating_point():
        raise TypeError(f"stability.inject: {type(module).__name__}'s output is not a floating tensor")
    mask = torch.zeros(output.shape, dtype=torch.bool, device=output.device)
    mask.view(-1)[0] = True
    return output.masked_fill(mask, float("nan"))


def _bad_scale(module, args, output):
    """An FP8 GEMM's output times a scale corrupted to infinity (a zero output becomes NaN);
    a layer taken out of FP8 has no scale to corrupt."""
    return output * float("inf") if module.fp8_enabled else output


def _spike(module, args, output):
    return output * SPIKE_FACTOR


class DrillRunner:
    """Arms the drill's hook for its step (every forward of that step, the locator's re-run
    included) and disarms it after; `fired` goes into the checkpoint, so a resumed or
    rewound run does not fire it again."""

    def __init__(self, drill: Drill | None, model: torch.nn.Module, rank: int = 0):
        self.drill, self.model, self.rank = drill, model, rank
        self.fired = False
        self._handle = None
        if drill is not None and drill.kind != "spike":
            names = dict(model.named_modules())
            if drill.fqn not in names:
                close = [n for n in names if n.endswith(drill.fqn.split(".")[-1])][:3]
                raise UserError(f"stability.inject: no module {drill.fqn!r} in the model; accepted: a module name "
                                f"such as {', '.join(close or [n for n in names if n][:3])}")
            if drill.kind == "fp8scale" and not isinstance(names[drill.fqn], FP8Linear):
                fp8 = [n for n, m in names.items() if isinstance(m, FP8Linear)][:3]
                raise UserError(f"stability.inject {drill}: {drill.fqn} does not compute in FP8 in this run; accepted: "
                                f"an FP8 layer{' such as ' + ', '.join(fp8) if fp8 else ' (this run has none)'}")

    def arm(self, step: int) -> None:
        d = self.drill
        if (d is None or self.fired or self._handle is not None or step != d.step
                or (d.rank is not None and d.rank != self.rank)):
            return
        if d.kind == "fp8scale" and not runs_fp8(self.model.get_submodule(d.fqn)):
            logger.warning("[DRILL] step %d: %s no longer computes in FP8 (promoted): stability.inject %s injects "
                           "nothing", step, d.fqn, d)
            self.fired = True
            return
        if d.kind == "fp8scale":
            # a layer promoted out of FP8 (in the guard's replay) has no scale left to corrupt
            self._handle = self.model.get_submodule(d.fqn).register_forward_hook(_bad_scale)
            torch.compiler.set_stance("force_eager")
            logger.warning("[DRILL] step %d: the FP8 scale of %s is corrupted to infinity for this step "
                           "(stability.inject %s; compiled regions run eagerly in this step)", step, d.fqn, d)
        elif d.kind == "nan":
            self._handle = self.model.get_submodule(d.fqn).register_forward_hook(_poison)
            # compiled code does not see a hook added after it was traced (dynamo skips hook
            # guards): this step runs eagerly
            torch.compiler.set_stance("force_eager")
            logger.warning("[DRILL] step %d: a NaN goes into the forward output of %s%s (stability.inject %s; "
                           "compiled regions run eagerly in this step)", step, d.fqn,
                           "" if d.rank is None else f" on rank {d.rank}", d)
        else:
            self._handle = self.model.register_forward_hook(_spike)
            logger.warning("[DRILL] step %d: the loss is multiplied by %g, as a corrupted batch would do "
                           "(stability.inject %s)", step, SPIKE_FACTOR, d)

    def disarm(self, step: int) -> None:
        """After step `step` (its locator re-run included): the drill is spent once its step has passed, on every rank."""
        if self.drill is None or step < self.drill.step:
            return  # a step before the drill's, read after it was armed
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
            torch.compiler.set_stance("default")
        self.fired = True

    def state_dict(self) -> dict:
        return {"drill": str(self.drill) if self.drill else None, "fired": self.fired}

    def load_state_dict(self, state: dict) -> None:
        self.fired = bool(state.get("fired")) and state.get("drill") == (str(self.drill) if self.drill else None)
