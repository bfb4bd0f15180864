"""What a training framework's loop (Lightning, Fabric, the Hugging Face Trainer) gets from
mixprec besides the precision policy's hooks: the step through the policy (unscale, clip on
the true gradients, skip a non-finite step on the device, loss scale), the read of what the
steps did every `read_every` steps (the policy's ReadSchedule, set to the framework's
logging interval by default; never in between: the step does not wait for the device),
and on a non-finite step the locator's re-run of that step's own batch, the line that
names the module, and the repair the stability guard makes: a narrow (FP8) layer found
first is promoted to the base dtype for the rest of the run.

The guard's rewinds are not done here: a rewind restores the weights, the optimizer and the
data position together, and inside a framework the data loader and the checkpoints are the
framework's (a diverged run resumes from the framework's own checkpoint; the policy's state
goes with it).
"""

from __future__ import annotations

import logging

import torch

from mixprec.precision import Policy
from mixprec.precision.step import ReadSchedule
from mixprec.stability.locate import Locator, agree

logger = logging.getLogger(__name__)


def _ranks() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


READ_EVERY = 10  # steps between reads where the framework names no logging interval: mixprec train's metrics.log_freq


class FrameworkSteps:
    """One per run: `step(optimizer, rerun)` after each backward (or micro-batch group).
    rerun(): runs this step's batch's forward and backward again (the locator observes it),
    None where the framework cannot. Each pending step keeps its own until the read, so a
    non-finite step is located on its own batch, however many steps later it is read."""

    def __init__(self, policy: Policy, *, max_norm: float | None = None, read_every: int = READ_EVERY,
                 promote: bool = True):
        self.policy, self.max_norm, self.promote = policy, max_norm, promote
        self.read_every = read_every
        self.steps = 0
        self.model: torch.nn.Module | None = None
        self.last = None  # the last step's StepResult (its figures on the device until read)
        self.incidents: list[dict] = []  # one per non-finite step: step, finding (module, phase, op, dtype), action
        self._steps: list = []  # each step since the last read: (its StepResult, its re-run or None)
        self._optimizer = None

    @property
    def read_every(self) -> int:
        return self.policy.reads.every

    @read_every.setter
    def read_every(self, steps: int) -> None:
        if steps < 1:
            raise ValueError(f"read_every {steps}: accepted: a positive number of steps")
        self.policy.reads = ReadSchedule(steps)  # the policy reads at these steps, this class acts on them

    def step(self, optimizer: torch.optim.Optimizer, rerun=None, max_norm: float | None = None):
        norm = self.max_norm if max_norm is None else max_norm
        self.steps += 1
        self.last = result = self.policy.step(optimizer, max_norm=norm or None, step=self.steps)
        self._steps.append((result, rerun))
        self._optimizer = optimizer
        if self.policy.reads.due(self.steps):
            self.read()
        return result

    def read(self) -> None:
        """Read the pending steps (the policy's read, made at its due step; the end of training
        calls this too: no step goes unread); locate the first non-finite one by re-running
        its own batch."""
        self.policy.settle()
        steps, self._steps = self._steps, []
        results, reruns = [r for r, _ in steps], [rerun for _, rerun in steps]
        first = next((i for i, r in enumerate(results) if r.nonfinite), None)
        if first is None:
            return
        step = self.steps - len(results) + first + 1
        rerun = reruns[first]
        finding = None
        rank, world = _ranks()
        if rerun is not None and self.model is not None:
            finding = Locator(self.model, rank).run(rerun, lambda loss: None)
            self._optimizer.zero_grad(set_to_none=True)  # the re-run's gradients are not stepped
        # each rank re-ran its own batch: the ranks decide together (the norm that made the step
        # non-finite was reduced over them, so every rank is here)
        finding = agree(finding, world)
        record = {"step": step, "finding": finding.to_dict() if finding else None, "action": "skipped"}
        if finding is None:
            logger.warning("[STABILITY] step %d: non-finite gradients, the step was skipped; %s", step,
                           "the re-run of its batch stayed finite" if rerun is not None else
                           "not located (this framework gave no way to re-run its batch)")
        else:
            logger.warning("[STABILITY] step %d: non-finite gradients, the step was skipped; first non-finite value "
                           "in %s", step, finding)
            if self.promote and self.policy.narrow(finding.module):
                promoted = self.policy.promote(finding.module, step, str(finding))
                record["action"] = f"skipped; {finding.module} promoted to {promoted['to']}"
                logger.warning("[PROMOTE] %s computes in %s, not %s, from step %d on: %s", finding.module,
                               promoted["to"], promoted["from"], step + 1, finding)
        self.incidents.append(record)

    def state_dict(self) -> dict:
        return {"policy": self.policy.state_dict(), "steps": self.steps, "incidents": list(self.incidents)}

    def load_state_dict(self, state: dict) -> None:
        self.policy.load_state_dict(state["policy"])
        self.steps, self.incidents = int(state.get("steps", 0)), list(state.get("incidents", []))
