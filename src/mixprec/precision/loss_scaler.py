"""Dynamic loss scaling: a drop-in for `torch.amp.GradScaler`, with bounds and hysteresis.

Same methods and state_dict keys as GradScaler, built on the same fused kernels
(`_amp_foreach_non_finite_check_and_unscale_`, `_amp_update_scale_`). With
min_scale=0 and max_scale=inf its scale follows GradScaler's exactly; with the
defaults it is GradScaler's trajectory clamped to [1, 2^24]. Additions:

- bounds: the scale never leaves [min_scale, max_scale];
- hysteresis (Megatron's): back off only on the N-th overflow since the last growth;
- FP16 gradients may be unscaled (pure-FP16 training has no FP32 copy to unscale).
"""

from __future__ import annotations

import enum
from collections import abc, defaultdict
from dataclasses import replace

import torch
import torch.distributed as dist

from mixprec.precision.scaling_config import LossScaleConfig


def _fresh_state() -> dict:
    return {"stage": _Stage.READY, "found_inf": None}


class _Stage(enum.Enum):  # GradScaler's per-optimizer stages within one iteration
    READY = 0
    UNSCALED = 1
    STEPPED = 2


class LossScaler:
    """GradScaler's constructor, methods, errors and state_dict, plus `config` (a
    LossScaleConfig: bounds, hysteresis, fallback) and bound/hysteresis keywords.
    `LossScaler("cpu", 1024.0)` means init_scale=1024, as for GradScaler."""

    def __init__(self, device: str | torch.device = "cpu", init_scale: float | None = None,
                 growth_factor: float | None = None, backoff_factor: float | None = None,
                 growth_interval: int | None = None, enabled: bool = True, *, config: LossScaleConfig | None = None,
                 **fields):
        given = dict(init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                     growth_interval=growth_interval, **fields)
        given = {k: v for k, v in given.items() if v is not None}
        self.config = replace(config, **given) if config is not None else LossScaleConfig(**given)
        self.device = device
        self._enabled = enabled
        c = self.config
        self._scale = torch.full((), c.init_scale, dtype=torch.float32, device=device)
        self._growth_tracker = torch.zeros((), dtype=torch.int32, device=device)
        self._hysteresis_left = torch.full((), c.hysteresis, dtype=torch.int32, device=device)
        self._per_optimizer = defaultdict(_fresh_state)  # id(optimizer) -> {"stage", "found_inf"}

    # ---- GradScaler's methods --------------------------------------------------------
    def scale(self, outputs):
        """Multiply a tensor, or each tensor of an iterable (a list or tuple keeps its
        type; any other iterable gives a lazy map), by the scale."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            return outputs * self._scale.to(outputs.device)
        if isinstance(outputs, abc.Iterable):
            scaled = map(self.scale, outputs)
            return type(outputs)(scaled) if isinstance(outputs, (list, tuple)) else scaled
        raise ValueError("outputs must be a Tensor or an iterable of Tensors")

    def _check_and_unscale(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor) -> torch.Tensor:
        """Multiply the optimizer's gradients by inv_scale in place (1: only check) and
        return 1.0 where any was inf/NaN, agreed across ranks."""
        found_inf = torch.zeros((), dtype=torch.float32, device=self._scale.device)
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
                found_inf += found.to(found_inf.device)
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                # An overflow in any rank's shard skips the step on every rank, so the
                # scale and the parameters stay identical across ranks.
                dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
        return found_inf

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale in place and record non-finite ones."""
        if not self._enabled:
            return
        state = self._per_optimizer[id(optimizer)]
        if state["stage"] is _Stage.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] is _Stage.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        # the reciprocal in FP64, as GradScaler: FP32 division can be inexact
        state["found_inf"] = self._check_and_unscale(optimizer, self._scale.double().reciprocal().float())
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
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            if state["stage"] is _Stage.READY:  # check only; the kernel unscales
                state["found_inf"] = self._check_and_unscale(optimizer, torch.ones((), device=self._scale.device))
            optimizer.grad_scale = (getattr(optimizer, "grad_scale", None) if state["stage"] is _Stage.UNSCALED
                                    else self._scale * getattr(optimizer, "grad_scale", 1))
            optimizer.found_inf = state["found_inf"]
            try:
                return optimizer.step(*args, **kwargs)
            finally:
                state["stage"] = _Stage.STEPPED
                del optimizer.grad_scale, optimizer.found_inf
        if state["stage"] is _Stage.READY:
            self.unscale_(optimizer)
        state["stage"] = _Stage.STEPPED
        if state["found_inf"].item():
            return None
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        if not self._enabled:
            return
        c = self.config
        if new_scale is not None:
            self._scale.fill_(float(new_scale))
        else:
            found = self._found_inf_async()
            if c.hysteresis == 1:
                torch._amp_update_scale_(self._scale, self._growth_tracker, found,
                                         c.growth_factor, c.backoff_factor, c.growth_interval)
            else:
                self._update_with_hysteresis(found > 0)
            self._scale.clamp_(c.min_scale, c.max_scale)
        self._per_optimizer = defaultdict(_fresh_state)

    def _update_with_hysteresis(self, overflow: torch.Tensor) -> None:
        """Megatron's rule, in tensor ops (no host sync): every overflow resets the growth
        count and uses up one unit of hysteresis; the scale backs off once none is left;
        hysteresis is restored when the scale grows."""
        c = self.config
        left = torch.where(overflow, self._hysteresis_left - 1, self._hysteresis_left)
        backoff = overflow & (left <= 0)
        tracker = torch.where(overflow, torch.zeros_like(self._growth_tracker), self._growth_tracker + 1)
        grown = self._scale * c.growth_factor
        grow = ~overflow & (tracker >= c.growth_interval) & torch.isfinite(grown)
        self._scale.copy_(torch.where(backoff, self._scale * c.backoff_factor, torch.where(grow, grown, self._scale)))
        self._growth_tracker.copy_(torch.where(tracker >= c.growth_interval, 0, tracker))
        self._hysteresis_left.copy_(torch.where(grow, c.hysteresis, left.clamp(min=0)))

    def _found_inf_async(self) -> torch.Tensor:
        """1.0 where a gradient recorded since the last update() was inf/NaN, else 0.0, on the
        scale's device: no host read (as GradScaler's _get_scale_async)."""
        founds = [s["found_inf"] for s in self._per_optimizer.values() if s["found_inf"] is not None]
        if not founds:
            raise AssertionError("No inf checks were recorded prior to update.")
        return torch.stack(founds).sum().clamp(max=1.0)

    def _get_scale_async(self) -> torch.Tensor:
        """The scale tensor itself, on its device (GradScaler's name): no host read."""
        return self._scale

    def get_scale(self) -> float:
        return self._scale.item() if self._enabled else 1.0

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
        return int(self._growth_tracker.item()) if self._enabled else 0

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
        """GradScaler's five keys, then mixprec's."""
        if not self._enabled:
            return {}
        c = self.config
        # one read of the three device values (float64 holds the float32 scale and the int32 counts exactly)
        scale, tracker, left = torch.stack([self._scale.double(), self._growth_tracker.double(),
                                            self._hysteresis_left.double()]).tolist()
        return {
            "scale": scale,
            "growth_factor": c.growth_factor,
            "backoff_factor": c.backoff_factor,
            "growth_interval": c.growth_interval,
            "_growth_tracker": int(tracker),
            "min_scale": c.min_scale,
            "max_scale": c.max_scale,
            "hysteresis": c.hysteresis,
            "_hysteresis_left": int(left),
        }

    def load_state_dict(self, state: dict) -> None:
        """Accepts a GradScaler state_dict too (mixprec's extra keys keep this scaler's values)."""
        if not self._enabled:
            return
        if not state:
            raise RuntimeError("The source state dict is empty, possibly saved from a disabled scaler.")
        c = self.config
        self.config = replace(
            c, init_scale=min(max(float(state["scale"]), state.get("min_scale", c.min_scale)),
                           state.get("max_scale", c.max_scale)),
            growth_factor=float(state["growth_factor"]), backoff_factor=float(state["backoff_factor"]),
            growth_interval=int(state["growth_interval"]), min_scale=state.get("min_scale", c.min_scale),
            max_scale=state.get("max_scale", c.max_scale), hysteresis=int(state.get("hysteresis", c.hysteresis)),
        )
        self._scale.fill_(self.config.init_scale)  # the saved scale, within this scaler's bounds
        self._growth_tracker.fill_(int(state["_growth_tracker"]))
        self._hysteresis_left.fill_(int(state.get("_hysteresis_left", self.config.hysteresis)))

