"""The stability guard: one call per step checks health; on an incident it locates the
first non-finite value, diagnoses, and recovers at the cost of the damage.

A non-finite step that was skipped (the policy never applies one) while every parameter
and optimizer state stayed finite costs its batch and nothing more: the guard locates,
diagnoses, logs and goes on (as OLMo-core skips such a step). It rewinds only when the
state was harmed (a spike that was applied, a non-finite parameter or optimizer state)
or the fault repeats (a second non-finite step within `window` steps). A rewind follows
what PaLM and BigScience did by hand: go back to a state from before the incident, do
not replay the batches that led there (the data stream keeps moving forward while the
model goes back), train on with a lowered learning rate for a while, and, in fp16 modes,
a lowered loss scale. After `max_rewinds` it gives up with one line. The policy's
counters of what the steps did (skipped, non-finite, overflows) are not rewound: those
events happened.

The guard does not know how to save a training state; it is handed two functions:
`capture()` returns a snapshot of everything that should go back (model, optimizer,
scheduler, policy, random generators), `restore(snapshot)` puts it back. With
`snapshot_interval` 0 the guard keeps no snapshot and calls `restore(None)`, which loads
the last checkpoint and returns (its step, the guard state saved in it).
`StabilityGuard.for_loop` builds them for a user's own loop; the trainer passes its own.
"""

from __future__ import annotations

import logging
import math

import torch
from torch.utils._pytree import tree_map

from mixprec.dtypes import dtype_name
from mixprec.errors import TrainingUnstable, UserError
from mixprec.rng import rng_state, set_rng_state
from mixprec.shards import local_shard
from mixprec.stability.config import StabilityConfig
from mixprec.stability.diagnose import diagnose
from mixprec.stability.drills import DrillRunner
from mixprec.stability.health import HealthMonitor
from mixprec.stability.locate import Finding, Locator, agree

logger = logging.getLogger("mixprec.stability")


class StabilityGuard:
    def __init__(self, config: StabilityConfig, model: torch.nn.Module, *, capture, restore, policy=None,
                 optimizer: torch.optim.Optimizer | None = None, rank: int = 0, world_size: int = 1):
        self.config, self.model, self.policy, self.optimizer = config, model, policy, optimizer
        self.capture, self.restore = capture, restore
        self.rank, self.world_size = rank, world_size
        self.monitor = HealthMonitor(config.window, config.threshold, config.min_history)
        self.drills = DrillRunner(config.drill, model, rank)
        self.locator = Locator(model, rank)
        self.incidents: list[dict] = []
        self.rewinds = 0
        self.skipped: list[list[int]] = []  # [first, last] steps whose data was not replayed
        self.clipped_spikes: list[int] = []  # steps whose gradient-norm spike clipping bounded (warnings)
        self.grad_spikes: list[int] = []  # steps with a gradient-norm spike, unclipped, and a healthy loss (warnings)
        self.backoff_left = 0
        self._snapshot = None  # (step, captured state, monitor state), memory mode
        self.health: dict = {}  # the last step's z-scores and spike score, for metrics.jsonl
        if optimizer is not None:
            optimizer.register_step_pre_hook(self._lower_lr)
            optimizer.register_step_post_hook(self._restore_lr)
        self._saved_lrs = None
        self._ran: int | None = None  # the last step before_step saw (None: none since the start or a rewind)

    @classmethod
    def for_loop(cls, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, policy=None, scheduler=None,
                 config: StabilityConfig = StabilityConfig()) -> StabilityGuard:
        """A guard for a user's own loop: snapshots of the model (full-precision masters where
        the policy keeps them), optimizer, scheduler, policy and torch's random generators,
        in CPU memory. Call `after_step` once per step."""

        if not config.snapshot_interval and config.max_rewinds:
            raise UserError("StabilityGuard.for_loop: stability.snapshot_interval 0 rewinds to the last checkpoint, "
                            "which a loop of your own does not hand the guard; accepted: a snapshot_interval > 0 "
                            "(snapshots in memory), or max_rewinds 0 (detect and report only)")
        device = next(model.parameters()).device

        def capture():
            state = {"model": policy.model_state_dict(model) if policy is not None else model.state_dict(),
                     "optimizer": optimizer.state_dict(), "rng": rng_state(device)}
            if scheduler is not None:
                state["scheduler"] = scheduler.state_dict()
            if policy is not None:
                state["policy"] = policy.state_dict()
            return clone_state(state)

        def restore(state):
            if policy is not None:
                policy.load_state_dict(state["policy"])
                policy.load_model_state_dict(model, state["model"])
            else:
                model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            if scheduler is not None:
                scheduler.load_state_dict(state["scheduler"])
            set_rng_state(state["rng"], device)

        guard = cls(config, model, capture=capture, restore=restore, policy=policy, optimizer=optimizer)
        guard.start(0)
        return guard

    # ---- the per-step hook ------------------------------------------------------------
    def start(self, step: int) -> None:
        """Before the first step (at `step`, 0 or a resumed one): the first snapshot, the drill armed."""
        if self.config.snapshot_interval:
            self._take(step)
        self.drills.arm(step + 1)
        self._ran = None

    def before_step(self, step: int) -> None:
        """Before training step `step` (1-based), on the host, reading nothing: the drill armed
        for its step, and the learning rate's back-off after a rewind moved on by the step
        taken since (for a loop that reads its steps in arrears; `after_step` does neither)."""
        if self._ran is not None and self.backoff_left:
            self.backoff_left -= 1
            if not self.backoff_left:
                logger.info("[STABILITY] step %d: learning rate back on its schedule", step - 1)
        self._ran = step
        self.drills.arm(step)

    def reads_at(self, step: int) -> bool:
        """Whether the guard needs step `step` read at once: a snapshot is taken after it (the
        state must be judged healthy as it stands), or a drill fires in it (its locator re-run
        needs the drill still armed)."""
        interval, drill = self.config.snapshot_interval, self.drills.drill
        return bool(interval and step % interval == 0) or (drill is not None and drill.step == step)

    def after_step(self, step: int, loss: float, result=None, rerun=None, *, grad_norm: float | None = None,
                   consumed: int | None = None) -> int:
        """Check step `step` (1-based, counted after it ran) and return the step to go on
        from: `step` when healthy (or when only reporting), else the step rewound to.
        loss: the step's loss on the host; result: what Policy.step returned (a StepResult:
        whether it was applied, an overflow the loss scaler handled, the gradient norm, and
        whether clipping bounded it, which makes a gradient-norm spike a logged warning
        rather than an incident); rerun: the step's micro-batches as (forward, backward)
        pairs, for the locator; grad_norm: the norm, for a loop without a policy; consumed:
        the last step whose data the loop has drawn, where it reads steps in arrears (the
        trainer reads at its log steps: a rewind then skips the data up to there).
        A loop that calls `before_step` moves the learning rate's back-off there; in a loop
        that does not, each healthy step here does."""
        applied = result.applied if result is not None else True
        overflow = result is not None and result.overflow
        clipped = result is not None and result.clipped
        if result is not None and grad_norm is None:
            grad_norm = result.grad_norm
        health = self.monitor.check(step, loss, grad_norm, overflow)
        self.health = health.metrics()
        if health.warning:
            spikes = self.clipped_spikes if clipped else self.grad_spikes
            spikes.append(step)
            logger.warning("[STABILITY] step %d: %s; %s, so not an incident (%d such steps)", step, health.warning,
                           "clipping bounded the update" if clipped else
                           "the loss is healthy (clipping is off: training.max_norm bounds such updates); the "
                           "losses after it are judged", len(spikes))
        if health.kind is None:
            self.drills.disarm(step)
            if self.backoff_left and self._ran is None:
                self.backoff_left -= 1
                if not self.backoff_left:
                    logger.info("[STABILITY] step %d: learning rate back on its schedule", step)
            if self.config.snapshot_interval and step % self.config.snapshot_interval == 0:
                self._take(step)
            self.drills.arm(step + 1)
            return step
        return self._incident(step, loss, grad_norm, health, rerun, applied, max(step, consumed or step))

    @property
    def lr_factor(self) -> float:
        """What the learning rate is multiplied by now: lr_backoff on the first step after a
        rewind, back up linearly to 1 over backoff_steps (a re-warm-up), then 1."""
        if not self.backoff_left:
            return 1.0
        return 1.0 - (1.0 - self.config.lr_backoff) * self.backoff_left / self.config.backoff_steps

    # ---- an incident ------------------------------------------------------------------
    def _incident(self, step, loss, grad_norm, health, rerun, applied: bool, consumed: int) -> int:
        logger.warning("[STABILITY] step %d: %s", step, health.reason)
        finding = self._locate(rerun) if health.kind == "nonfinite" and rerun else None
        self.drills.disarm(step)
        if finding is not None:
            logger.warning("[STABILITY] step %d: first non-finite value in %s", step, finding)
        elif health.kind == "nonfinite" and rerun:
            logger.warning("[STABILITY] step %d: the locator's re-run of this step stayed finite", step)
        bad_params, bad_moments = self._nonfinite_state()
        record = {"step": step, "kind": health.kind, "reason": health.reason, "loss": _num(loss),
                  "grad_norm": _num(grad_norm), "finding": finding.to_dict() if finding else None,
                  "nonfinite_parameters": bad_params, "nonfinite_optimizer_state": bad_moments}
        recent = sum(1 for i in self.incidents if i["kind"] == "nonfinite" and i["step"] > step - self.config.window)
        recent += health.kind == "nonfinite"
        harm = self._harm(health.kind, applied, bad_params, bad_moments, recent)
        promoted = self._repair(step, finding, rerun) if health.kind == "nonfinite" else None

        def explain(action: str) -> None:
            text = diagnose(health.kind, health.reason, loss, grad_norm, list(self.monitor.norms), recent,
                            self.config.window, finding, action)
            record.update(action=action, diagnosis=text)
            self.incidents.append(record)
            logger.warning("[STABILITY] step %d: %s", step, text)

        if not self.config.max_rewinds:
            explain("none (stability.max_rewinds 0: detect and report only)")
            self.drills.arm(step + 1)
            return step
        if promoted is not None and not (applied or bad_params or bad_moments):
            record["promoted"] = {"module": finding.module, **promoted}
            explain(f"promoted {finding.module} from {promoted['from']} to {promoted['to']} for the rest of the run "
                    "(a replay of the step with it there was finite); the step was not applied and the state is "
                    "finite, so only its batch is lost (no rewind)")
            self.drills.arm(step + 1)
            return step
        if harm is None:
            explain("skipped: the step was not applied and every parameter and optimizer state is finite, so "
                    f"only its batch is lost (no rewind; another non-finite step within {self.config.window} steps "
                    "rewinds)")
            self.drills.arm(step + 1)
            return step
        if self.rewinds >= self.config.max_rewinds:
            explain(f"gave up after {self.rewinds} rewinds (stability.max_rewinds {self.config.max_rewinds})")
            raise TrainingUnstable(f"step {step}: {health.reason}; still unstable after {self.rewinds} rewinds "
                                   f"(stability.max_rewinds {self.config.max_rewinds}); the last good checkpoint is "
                                   "kept on disk: resume from it with a lower training.lr, or see the diagnosis in the log")
        target = self._rewind()
        self.rewinds += 1
        self.skipped.append([target + 1, consumed])
        self._ran = None
        self.backoff_left = self.config.backoff_steps if self.config.lr_backoff < 1 else 0
        scale = self.policy.back_off_loss_scale() if self.policy is not None else None
        action = (f"{harm}: rewound to step {target} ({'memory snapshot' if self.config.snapshot_interval else 'checkpoint'}), "
                  f"the data of steps {target + 1}-{consumed} is not replayed")
        if self.backoff_left:
            action += f", learning rate x{self.config.lr_backoff:g} back up to x1 over {self.backoff_left} steps"
        if scale is not None:
            action += f", loss scale {scale[0]:g} -> {scale[1]:g}"
        record["rewound_to"] = target
        explain(action + f" (rewind {self.rewinds} of at most {self.config.max_rewinds})")
        self.drills.arm(target + 1)
        return target

    def _locate(self, rerun) -> Finding | None:
        found = None
        for forward, backward in rerun:  # every micro-batch on every rank: collectives stay matched
            finding = self.locator.run(forward, backward)
            found = found or finding
            self.model.zero_grad(set_to_none=True)
        return agree(found, self.world_size)

    def _repair(self, step: int, finding: Finding | None, rerun) -> dict | None:
        """Precision-aware recovery: where the first non-finite value came from a layer in a
        narrow format (FP8), replay the step with that layer in the base mode's dtype; if
        the replay stays finite, the layer keeps that for the rest of the run. The record,
        or None (nothing to promote, or the replay still went non-finite: put back)."""
        if finding is None or self.policy is None or not rerun or not self.policy.narrow(finding.module):
            return None
        fqn, was = finding.module, self.policy.layout.modules[finding.module].compute_name
        record = self.policy.promote(fqn, step, f"the first non-finite value of step {step} came from it in {was} "
                                                f"({finding.phase}, {finding.op or 'module output'}); the step's "
                                                f"replay with it in {dtype_name(self.policy.param_dtype)} was finite")
        again = self._locate(rerun)
        if again is not None:
            self.policy.unpromote(fqn)
            logger.warning("[STABILITY] step %d: the replay with %s out of %s still went non-finite, in %s", step, fqn,
                           was, again)
            return None
        logger.warning("[PROMOTE] step %d: %s computes in %s from now on, not %s: %s", step, fqn, record["to"], was,
                       record["evidence"])
        return record

    def _harm(self, kind: str, applied: bool, bad_params: int, bad_moments: int, recent: int) -> str | None:
        """Why this incident needs the state to go back, or None when losing its batch is all it cost."""
        if kind != "nonfinite":
            return f"the {kind.replace('_', ' ')} step was applied" if applied else None
        if bad_params or bad_moments:
            return f"{bad_params} parameter and {bad_moments} optimizer-state tensors are non-finite"
        if applied:
            return "the non-finite step was applied"
        if recent > 1:
            return f"{recent} non-finite steps within {self.config.window} steps"
        return None

    def _nonfinite_state(self) -> tuple[int, int]:
        """Parameter and optimizer-state tensors holding a NaN or an infinity (this rank's
        shards), each summed over ranks."""
        params = [local_shard(p) for p in self.model.parameters()]
        moments = [local_shard(t) for s in (self.optimizer.state.values() if self.optimizer is not None else ())
                   for t in s.values() if torch.is_tensor(t) and t.is_floating_point() and t.dim()]
        count = torch.tensor([float(sum(not bool(torch.isfinite(t).all()) for t in group if t.numel()))
                              for group in (params, moments)])
        if self.world_size > 1:
            count = count.to(params[0].device)
            torch.distributed.all_reduce(count)
        return int(count[0].item()), int(count[1].item())

    # ---- snapshots ----------------------------------------------------------------------
    def _take(self, step: int) -> None:
        self._snapshot = (step, self.capture(), self.monitor.state_dict())

    def _rewind(self) -> int:
        counts = self.policy.counts if self.policy is not None else None  # events that happened stay counted
        if self.config.snapshot_interval:
            step, state, monitor = self._snapshot
            # a copy: torch's Optimizer.load_state_dict keeps the tensors it is handed where their dtype and
            # device fit, and the steps after the rewind would write into the snapshot a second rewind restores
            self.restore(clone_state(state))
        else:
            step, monitor = self.restore(None)
        if monitor:
            self.monitor.load_state_dict(monitor, spikes=False)
        if counts is not None:
            self.policy.counts = counts
        return step

    # ---- learning-rate back-off (optimizer step hooks: any optimizer, any scheduler) ----------
    def _lower_lr(self, optimizer, args, kwargs) -> None:
        if self.backoff_left:
            self._saved_lrs = [g["lr"] for g in optimizer.param_groups]
            for g in optimizer.param_groups:
                g["lr"] = g["lr"] * self.lr_factor

    def _restore_lr(self, optimizer, args, kwargs) -> None:
        if self._saved_lrs is not None:
            for g, lr in zip(optimizer.param_groups, self._saved_lrs):
                g["lr"] = lr
            self._saved_lrs = None

    # ---- reporting and checkpoints -----------------------------------------------------------
    def summary(self) -> dict:
        return {"incidents": len(self.incidents), "rewinds": self.rewinds, "skipped_steps": self.skipped,
                "clipped_grad_spikes": self.clipped_spikes, "grad_spikes": self.grad_spikes,
                "drill": str(self.config.drill) if self.config.drill else None, "drill_fired": self.drills.fired,
                "incident_log": self.incidents}

    def state_dict(self) -> dict:
        return {"monitor": self.monitor.state_dict(), "incidents": self.incidents, "rewinds": self.rewinds,
                "skipped": self.skipped, "backoff_left": self.backoff_left, "drills": self.drills.state_dict(),
                "clipped_grad_spikes": self.clipped_spikes, "grad_spikes": self.grad_spikes}

    def load_state_dict(self, state: dict) -> None:
        """On resume. (A rewind restores only the window, through its own snapshot.)"""
        self.monitor.load_state_dict(state["monitor"])
        self.incidents, self.rewinds = list(state["incidents"]), int(state["rewinds"])
        self.skipped, self.backoff_left = [list(s) for s in state["skipped"]], int(state["backoff_left"])
        self.drills.load_state_dict(state["drills"])
        self.clipped_spikes = [int(s) for s in state.get("clipped_grad_spikes", [])]  # absent before it was counted
        self.grad_spikes = [int(s) for s in state.get("grad_spikes", [])]


def clone_state(state):
    """A copy of a state dict's tensors that later training does not change: in CPU memory
    for plain tensors, on their device for DTensors (sharded state stays sharded). CUDA
    tensors go to pinned memory without blocking the host: the copies are queued on the
    stream before the next step's kernels, so they see this state, and they overlap the
    work the host queues next (torch caches pinned blocks, so each snapshot reuses them)."""
    def copy(t):
        if not isinstance(t, torch.Tensor):
            return t
        if hasattr(t, "device_mesh"):
            return t.detach().clone()
        if t.is_cuda:
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return out.copy_(t.detach(), non_blocking=True)
        return t.detach().to("cpu", copy=True)

    return tree_map(copy, state)


def _num(x):
    return x if x is not None and math.isfinite(x) else (None if x is None else str(x))
