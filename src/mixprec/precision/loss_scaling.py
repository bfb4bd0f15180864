"""Dynamic loss scaling, in one place: the scale and its counters on the device, the skip of
an overflowing step, the host's record of what the scale did (its log lines, the overflows in
a row) and the fallback to another precision. Its settings are the [loss_scale] table
(`scaling_config.LossScaleConfig`, torch-free like every config table).

- `LossScaling` is the whole of it; a `Policy` holds one where its spec scales the loss.
- `LossScaler` is `torch.amp.GradScaler`'s API on top of it (same methods, errors and
  state_dict keys, PyTorch's own GradScaler tests pass against it): per-optimizer stages
  and nothing else.

The scale moves by GradScaler's fused kernels (`_amp_foreach_non_finite_check_and_unscale_`,
`_amp_update_scale_`): with min_scale=0 and max_scale=inf exactly GradScaler's trajectory;
with the defaults that trajectory clamped to [1, 2^24]. Added: the bounds, Megatron's
hysteresis (back off only on the N-th overflow since the last growth), FP16 gradients
unscaled in place (pure-FP16 training has no FP32 copy), and the fallback after
`fallback_after` overflows in a row or one at the minimum scale.

A step is skipped on the device: the optimizer is handed the decision as a tensor and leaves
every parameter, state and step count as it was when it is 1, without the host reading it
(GradScaler's protocol for fused optimizers). torch's fused Adam, AdamW and SGD
(`_step_supports_amp_scaling`) and mixprec's AdamW take `found_inf` into their kernels;
bf16-kahan and bf16-sr's kernels take it as an argument; any other optimizer reads it on the
host, one sync a step (`device_skip` says why, logged once).
"""

from __future__ import annotations

import enum
import logging
from collections import abc, defaultdict
from dataclasses import replace

import torch
import torch.distributed as dist

from mixprec.precision.emulation import has_fast_matmul
from mixprec.precision.master import cast_parameters
from mixprec.precision.presets import BF16, FP32, PRESETS
from mixprec.precision.scaling_config import LossScaleConfig

logger = logging.getLogger("mixprec.precision.policy")  # where these lines have always come from


class LossScaling:
    """The scale (a float32 tensor on `device`), its growth tracker and hysteresis, moved on
    the device; on the host, what the reads saw: the overflows in a row and the log."""

    def __init__(self, config: LossScaleConfig, device: torch.device | str = "cpu", fallback_to: str | None = None,
                 *, verbose: int = 10, summary_every: int = 100):
        self.config, self.fallback_to = config, fallback_to
        self.scale = torch.full((), config.init_scale, dtype=torch.float32, device=device)
        self.growth_tracker = torch.zeros((), dtype=torch.int32, device=device)
        self.hysteresis_left = torch.full((), config.hysteresis, dtype=torch.int32, device=device)
        self.consecutive = 0  # overflows in a row: fallback_after counts these
        self.verbose, self.summary_every = verbose, summary_every  # overflow lines one by one, then a summary
        self._last: float | None = None  # the scale after the last step read (None: the initial one)
        self._quiet, self._quiet_from = 0, None  # overflows not logged yet, since step

    # ---- on the device -----------------------------------------------------------------
    def scale_loss(self, outputs):
        """Multiply a tensor, or each tensor of an iterable (a list or tuple keeps its
        type; any other iterable gives a lazy map), by the scale."""
        if isinstance(outputs, torch.Tensor):
            return outputs * self.scale.to(outputs.device)
        if isinstance(outputs, abc.Iterable):
            scaled = map(self.scale_loss, outputs)
            return type(outputs)(scaled) if isinstance(outputs, (list, tuple)) else scaled
        raise ValueError("outputs must be a Tensor or an iterable of Tensors")

    def unscale(self, optimizer: torch.optim.Optimizer, check_only: bool = False) -> torch.Tensor:
        """Divide the optimizer's gradients by the scale in place (check_only: leave them);
        nonzero where any was inf/NaN, agreed across ranks."""
        # the reciprocal in FP64, as GradScaler: FP32 division can be inexact
        inv_scale = torch.ones((), device=self.scale.device) if check_only else \
            self.scale.double().reciprocal().float()
        found_inf = torch.zeros((), dtype=torch.float32, device=self.scale.device)
        groups = defaultdict(list)  # one fused call per (device, dtype)
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    if p.grad.is_sparse:
                        # duplicate indices are summed by coalesce(); in float16 the sum may
                        # overflow, so the coalesced values are the ones to check
                        if p.grad.dtype is torch.float16:
                            p.grad = p.grad.coalesce()
                        grad = p.grad._values()
                    else:
                        grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad  # FSDP2: the shard
                    groups[(grad.device, grad.dtype)].append(grad)
            for (device, _), grads in groups.items():
                found = torch.zeros((), dtype=torch.float32, device=device)
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv_scale.to(device))
                # a flag, 1 or 0, as GradScaler's: gradients of two dtypes found non-finite are one skip (a sum
                # of 2 counted a skipped step as -1 in an optimizer's step count)
                torch.maximum(found_inf, found.to(found_inf.device), out=found_inf)
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                # An overflow in any rank's shard skips the step on every rank, so the
                # scale and the parameters stay identical across ranks.
                dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
        return found_inf

    def update(self, found: torch.Tensor) -> torch.Tensor:
        """Move the scale after a step whose `found` (0 or 1, on the device) says whether it
        overflowed; the scale tensor, updated in place. No host read."""
        c = self.config
        if c.hysteresis == 1:
            torch._amp_update_scale_(self.scale, self.growth_tracker, found, c.growth_factor, c.backoff_factor,
                                     c.growth_interval)
        else:
            self._update_with_hysteresis(found > 0)
        return self.scale.clamp_(c.min_scale, c.max_scale)

    def _update_with_hysteresis(self, overflow: torch.Tensor) -> None:
        """Megatron's rule, in tensor ops: every overflow resets the growth count and uses up
        one unit of hysteresis; the scale backs off once none is left; hysteresis is
        restored when the scale grows."""
        c = self.config
        left = torch.where(overflow, self.hysteresis_left - 1, self.hysteresis_left)
        backoff = overflow & (left <= 0)
        tracker = torch.where(overflow, torch.zeros_like(self.growth_tracker), self.growth_tracker + 1)
        grown = self.scale * c.growth_factor
        grow = ~overflow & (tracker >= c.growth_interval) & torch.isfinite(grown)
        self.scale.copy_(torch.where(backoff, self.scale * c.backoff_factor, torch.where(grow, grown, self.scale)))
        self.growth_tracker.copy_(torch.where(tracker >= c.growth_interval, 0, tracker))
        self.hysteresis_left.copy_(torch.where(grow, c.hysteresis, left.clamp(min=0)))

    @property
    def value(self) -> float:
        """The scale, read on the host."""
        return self.scale.item()

    # ---- on the host, at a read ----------------------------------------------------------
    def record(self, step: int, overflow: bool, after: float, overflows: int) -> str | None:
        """What step `step` did to the scale, read on the host (`after`: the scale after it;
        `overflows`: the run's overflows so far, this one included): the overflows in a
        row, the log line, and the reason to fall back now, or None."""
        before = self._last if self._last is not None else self.config.init_scale
        self._last = after
        self.consecutive = self.consecutive + 1 if overflow else 0
        self._log(step, overflow, before, after, overflows)
        if not self.fallback_to:
            return None
        if overflow and before <= self.config.min_scale:
            return f"at the minimum loss scale {before:g}"
        if self.config.fallback_after and self.consecutive >= self.config.fallback_after:
            return f"after {self.consecutive} consecutive overflows"
        return None

    def _log(self, step: int, overflow: bool, before: float, after: float, overflows: int) -> None:
        """The first `verbose` overflows one by one, then one summary line per `summary_every`
        steps that had any; every growth of the scale."""
        if overflow:
            if overflows <= self.verbose:
                logger.warning("[OVERFLOW] step %d: loss scale %g -> %g (overflow %d/%d)",
                               step, before, after, overflows, step)
                if overflows == self.verbose:
                    logger.warning("[OVERFLOW] further overflows are summarised every %d steps", self.summary_every)
            else:
                self._quiet += 1
                self._quiet_from = self._quiet_from or step
        elif after > before:
            logger.info("[SCALE] loss scale %g -> %g after %d clean steps", before, after, self.config.growth_interval)
        if self._quiet and step % self.summary_every == 0:
            logger.warning("[OVERFLOW] steps %d-%d: %d overflows, loss scale now %g (overflow %d/%d)",
                           self._quiet_from, step, self._quiet, after, overflows, step)
            self._quiet, self._quiet_from = 0, None

    def back_off(self) -> tuple[float, float]:
        """Multiply the scale by backoff_factor (after a rewind): (before, after)."""
        before = self.value
        self.scale.fill_(max(self.config.min_scale, before * self.config.backoff_factor))
        self._last = self.value
        return before, self._last

    # ---- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """GradScaler's five keys, then mixprec's."""
        c = self.config
        # one read of the three device values (float64 holds the float32 scale and the int32 counts exactly)
        scale, tracker, left = torch.stack([self.scale.double(), self.growth_tracker.double(),
                                            self.hysteresis_left.double()]).tolist()
        return {"scale": scale, "growth_factor": c.growth_factor, "backoff_factor": c.backoff_factor,
                "growth_interval": c.growth_interval, "_growth_tracker": int(tracker), "min_scale": c.min_scale,
                "max_scale": c.max_scale, "hysteresis": c.hysteresis, "_hysteresis_left": int(left)}

    def load_state_dict(self, state: dict | None, consecutive: int = 0) -> None:
        """A state_dict of this class or of GradScaler (mixprec's extra keys keep this one's
        values; None keeps the scale as it is); `consecutive`: the overflows in a row the
        saved run had seen."""
        if state:
            c = self.config
            self.config = replace(
                c, init_scale=min(max(float(state["scale"]), state.get("min_scale", c.min_scale)),
                               state.get("max_scale", c.max_scale)),
                growth_factor=float(state["growth_factor"]), backoff_factor=float(state["backoff_factor"]),
                growth_interval=int(state["growth_interval"]), min_scale=state.get("min_scale", c.min_scale),
                max_scale=state.get("max_scale", c.max_scale), hysteresis=int(state.get("hysteresis", c.hysteresis)),
            )
            self.scale.fill_(self.config.init_scale)  # the saved scale, within this one's bounds
            self.growth_tracker.fill_(int(state["_growth_tracker"]))
            self.hysteresis_left.fill_(int(state.get("_hysteresis_left", self.config.hysteresis)))
        self.consecutive = consecutive
        self._last = self.value


# ---- the skip ------------------------------------------------------------------------------
def device_skip(optimizer: torch.optim.Optimizer, updates=None) -> str | None:
    """None when `optimizer` (with `updates`, a BF16Updates) skips a step on the device, else why not."""
    if updates is not None and not updates.fused:
        return f"bf16 updates around {type(optimizer).__name__} step float32 working copies"
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        return None
    kind = "foreach" if any(g.get("foreach") for g in optimizer.param_groups) else "for-loop"
    return (f"{type(optimizer).__name__} ({kind}) has no device-side skip; torch's fused=True kernels "
            "and mixprec's AdamW have one")


def step_unless(optimizer: torch.optim.Optimizer, skip: torch.Tensor, *args, updates=None, on_host: bool = False,
                grad_scale: torch.Tensor | None = None, **kwargs):
    """optimizer.step(*args, **kwargs) (through `updates` where given), or nothing where `skip`
    (a 0-dim float tensor, nonzero to skip) says so; the step's return value, or None. on_host:
    the optimizer cannot skip on the device (`device_skip` said why). grad_scale: for a
    fused kernel that still has to unscale the gradients (GradScaler's step without unscale_)."""
    stepper = updates if updates is not None else optimizer
    if on_host:
        return None if skip.item() else stepper.step(*args, **kwargs)  # the one host read of such a step
    optimizer.grad_scale, optimizer.found_inf = grad_scale, skip
    try:
        return stepper.step(*args, **kwargs)
    finally:
        del optimizer.grad_scale, optimizer.found_inf


# ---- the fallback ------------------------------------------------------------------------------
def fallback_target(policy) -> str | None:
    """The mode loss_scale.fallback_to names (auto: bf16-mixed where BF16 matmuls are fast,
    else fp32), or None where there is none."""
    target = policy.loss_scale.fallback_to
    if target == "auto":
        target = "bf16-mixed" if has_fast_matmul(policy.device_type, BF16) else "fp32"
    if target and policy.sharded:
        # fully_shard fixes its MixedPrecisionPolicy when it wraps the model: a switch
        # of precision mid-run would leave it all-gathering the old dtype.
        logger.warning("precision: no automatic fallback under fully_shard: overflowing steps are skipped "
                       "and the loss scale halves down to %g; to change precision, resume the last "
                       "checkpoint with another precision.preset", policy.loss_scale.min_scale)
        return None
    return target


def fall_back(policy, target: str, reason: str | None) -> None:
    """Swap the policy's spec for `target`'s, keeping the FP32 weights and optimizer state:
    the master-weights and loss-scaling parts go."""
    old = policy.name
    if policy.masters is not None:
        policy.masters.release()
        policy.masters = None
    cast_parameters(policy.model, FP32)
    for state in policy.optimizer.state.values() if policy.optimizer is not None else []:
        for key, t in state.items():  # FP16 states of a model without masters
            if torch.is_tensor(t) and t.is_floating_point() and key != "step":
                state[key] = t.float()
    policy.spec = replace(PRESETS[target], reduce_dtype=policy.reduce_dtype, overrides=policy.spec.overrides)
    policy.scaling, policy.loss_scale = None, None
    policy.name, policy.fallback_step = target, policy.counts.steps
    if reason is not None:
        logger.warning("[FALLBACK] step %d: %s -> %s %s", policy.counts.steps, old, policy.name, reason)
    policy.emulation.choose(policy.device_type, policy.spec.low_precision_dtypes)


# ---- GradScaler's API -----------------------------------------------------------------------------
class _Stage(enum.Enum):  # GradScaler's per-optimizer stages within one iteration
    READY = 0
    UNSCALED = 1
    STEPPED = 2


def _fresh_state() -> dict:
    return {"stage": _Stage.READY, "found_inf": None}


class LossScaler:
    """A drop-in for `torch.amp.GradScaler` on a `LossScaling`: GradScaler's constructor,
    methods, errors and state_dict, plus `config` (a LossScaleConfig: bounds, hysteresis)
    and bound/hysteresis keywords. `LossScaler("cpu", 1024.0)` means init_scale=1024, as for
    GradScaler."""

    def __init__(self, device: str | torch.device = "cpu", init_scale: float | None = None,
                 growth_factor: float | None = None, backoff_factor: float | None = None,
                 growth_interval: int | None = None, enabled: bool = True, *, config: LossScaleConfig | None = None,
                 **fields):
        given = dict(init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                     growth_interval=growth_interval, **fields)
        given = {k: v for k, v in given.items() if v is not None}
        self.scaling = LossScaling(replace(config, **given) if config is not None else LossScaleConfig(**given),
                                   device)
        self.device, self._enabled = device, enabled
        self._per_optimizer = defaultdict(_fresh_state)  # id(optimizer) -> {"stage", "found_inf"}

    config = property(lambda self: self.scaling.config,
                      lambda self, config: setattr(self.scaling, "config", config))

    def scale(self, outputs):
        return self.scaling.scale_loss(outputs) if self._enabled else outputs

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale in place and record non-finite ones."""
        if not self._enabled:
            return
        state = self._per_optimizer[id(optimizer)]
        if state["stage"] is _Stage.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] is _Stage.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        state["found_inf"] = self.scaling.unscale(optimizer)
        state["stage"] = _Stage.UNSCALED

    def step(self, optimizer: torch.optim.Optimizer, *args, **kwargs):
        """Unscale if not done yet; step unless a gradient was inf/NaN. Returns the
        optimizer's return value, or None when the step was skipped. An optimizer that
        declares `_step_supports_amp_scaling` (torch's fused Adam, AdamW, SGD) gets
        `grad_scale` and `found_inf` instead and unscales and skips inside its kernel."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        state = self._per_optimizer[id(optimizer)]
        if state["stage"] is _Stage.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        fused, grad_scale = getattr(optimizer, "_step_supports_amp_scaling", False), None
        if fused:
            if state["stage"] is _Stage.READY:  # check only; the kernel unscales
                state["found_inf"] = self.scaling.unscale(optimizer, check_only=True)
            grad_scale = (getattr(optimizer, "grad_scale", None) if state["stage"] is _Stage.UNSCALED
                          else self.scaling.scale * getattr(optimizer, "grad_scale", 1))
        elif state["stage"] is _Stage.READY:
            self.unscale_(optimizer)
        state["stage"] = _Stage.STEPPED
        return step_unless(optimizer, state["found_inf"], *args, on_host=not fused, grad_scale=grad_scale, **kwargs)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        if not self._enabled:
            return
        if new_scale is not None:
            self.scaling.scale.fill_(float(new_scale))
        else:
            self.scaling.update(self._found_inf_async())
        self._per_optimizer = defaultdict(_fresh_state)

    def _found_inf_async(self) -> torch.Tensor:
        """1.0 where a gradient recorded since the last update() was inf/NaN, else 0.0, on the
        scale's device: no host read (as GradScaler's _get_scale_async)."""
        founds = [s["found_inf"] for s in self._per_optimizer.values() if s["found_inf"] is not None]
        if not founds:
            raise AssertionError("No inf checks were recorded prior to update.")
        return torch.stack(founds).sum().clamp(max=1.0)

    def _get_scale_async(self) -> torch.Tensor:
        """The scale tensor itself, on its device (GradScaler's name): no host read."""
        return self.scaling.scale

    def get_scale(self) -> float:
        return self.scaling.value if self._enabled else 1.0

    def is_enabled(self) -> bool:
        return self._enabled

    def get_growth_factor(self) -> float:
        return self.config.growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self.config = replace(self.config, growth_factor=new_factor)

    def get_backoff_factor(self) -> float:
        return self.config.backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self.config = replace(self.config, backoff_factor=new_factor)

    def get_growth_interval(self) -> int:
        return self.config.growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self.config = replace(self.config, growth_interval=new_interval)

    def _get_growth_tracker(self) -> int:
        return int(self.scaling.growth_tracker.item()) if self._enabled else 0

    def __getstate__(self) -> dict:
        if self._enabled and any(s["stage"] is not _Stage.READY for s in self._per_optimizer.values()):
            raise AssertionError("A GradScaler instance may only be pickled at the beginning of an iteration, "
                                 "or at the end after scaler.update().")
        state = self.__dict__.copy()
        state["_per_optimizer"] = {}
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._per_optimizer = defaultdict(_fresh_state)

    @property
    def found_inf(self) -> bool:
        """Whether the gradients recorded since the last update() had an inf or NaN."""
        return any(s["found_inf"].item() for s in self._per_optimizer.values() if s["found_inf"] is not None)

    def state_dict(self) -> dict:
        return self.scaling.state_dict() if self._enabled else {}

    def load_state_dict(self, state: dict) -> None:
        """Accepts a GradScaler state_dict too (mixprec's extra keys keep this scaler's values)."""
        if not self._enabled:
            return
        if not state:
            raise RuntimeError("The source state dict is empty, possibly saved from a disabled scaler.")
        self.scaling.load_state_dict(state)
