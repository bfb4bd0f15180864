"""mixprec as a Lightning precision plugin, for Fabric and for the Trainer:

    fabric = L.Fabric(accelerator="cpu", plugins=[mixprec.lightning.Precision("fp8-rowwise")])
    trainer = L.Trainer(plugins=[mixprec.lightning.Precision("fp16-mixed", max_norm=1.0)])

Every preset and Policy setting (`Precision(preset, **settings)` takes Policy.from_preset's
keywords: overrides, loss_scale, fp8_recipe, ...). The hooks map one to one onto the policy's:
convert_module (FP8/MX conversion and the parameter casts), forward_context (autocast or
none), backward (the scaled loss, under the matmul emulation where the CPU has no kernel),
optimizer_step (unscale, clip on the true gradients, skip a non-finite step on the device,
the loss scale), state_dict (the loss scaler, FP8 amax histories, promoted layers: the
Trainer keeps it in its checkpoints). A non-finite step is skipped, re-run under the locator
and reported by module name, and a narrow layer found first is promoted
(mixprec.stability.framework).

Refused, one line each: master-weight and bf16-update presets under Fabric (Fabric never
gives a precision plugin the optimizer before the first step, and those presets step other
tensors than the model's; the Trainer does, through `connect`); Lightning's own FSDP
strategy (its MixedPrecisionPolicy would cast over mixprec's: shard with
mixprec.distributed.apply_fsdp instead); clipping by value, and `fabric.clip_gradients`
(clipping happens inside the step, on unscaled gradients: give `max_norm` here or the
Trainer's gradient_clip_val).
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch

from mixprec.errors import UserError
from mixprec.precision import Policy
from mixprec.stability.framework import READ_EVERY, FrameworkSteps

try:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import Precision as _LightningPrecision
except ImportError:  # pragma: no cover - the message is the point
    raise ImportError("mixprec.lightning needs Lightning: pip install 'mixprec[lightning]' (the lightning "
                      "package, 2.4 or newer)") from None

# Lightning's name for the closest of its own precisions (what trainer.precision reports)
_LIGHTNING_NAMES = {"fp32": "32-true", "bf16-mixed": "bf16-mixed", "fp16-mixed": "16-mixed", "bf16-true": "bf16-true",
                    "fp16-true": "16-true"}


class Precision(_LightningPrecision):
    """A mixprec precision preset as Lightning's precision plugin (Fabric and Trainer)."""

    def __init__(self, preset: str = "bf16-mixed", *, max_norm: float | None = None, read_every: int | None = None,
                 device_type: str | None = None, **settings):
        """read_every: read what the steps did every this many steps (the step never waits for
        the device in between); default the Trainer's log_every_n_steps, under Fabric 10."""
        self.policy = Policy.from_preset(preset, **settings)
        self.precision = _LIGHTNING_NAMES.get(self.policy.name, "32-true")
        self.steps = FrameworkSteps(self.policy, max_norm=max_norm, read_every=read_every or READ_EVERY)
        self._read_every_given = read_every is not None
        self.device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
        self._clip: float | None = None  # the Trainer's gradient_clip_val, seen at each step
        self._last_input = None  # Fabric: the last forward's (args, kwargs), for the locator

    # ---- the model --------------------------------------------------------------------------
    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        if _sharded_by_lightning(module):
            raise UserError("mixprec.lightning.Precision with Lightning's FSDP strategy: its MixedPrecisionPolicy would "
                            "cast over mixprec's; accepted: a single-device or DDP strategy, or shard the model with "
                            "mixprec.distributed.apply_fsdp inside configure_model")
        if self.policy.needs_optimizer and not isinstance(module, pl.LightningModule):
            raise UserError(f"mixprec.lightning.Precision({self.policy.name!r}) under Fabric: this preset keeps master "
                            "weights or its own update rule, which follow the optimizer, and Fabric gives a precision "
                            "plugin no optimizer before the first step; accepted: L.Trainer, or mixprec's Policy "
                            "in your own loop")
        self.policy.prepare_model(module, self.device_type)
        self.steps.model = module
        if not self.policy.needs_optimizer:
            self.policy.setup(module)  # the casts; no optimizer needed
        return module

    def connect(self, model, optimizers, lr_schedulers):
        """The Trainer's: the model and its optimizers, before the first step."""
        trainer = getattr(_unwrap(model), "_trainer", None)
        if not self._read_every_given and getattr(trainer, "log_every_n_steps", 0):
            self.steps.read_every = int(trainer.log_every_n_steps)  # read where the Trainer logs
        if self.policy.needs_optimizer:
            if len(optimizers) != 1:
                raise UserError(f"mixprec.lightning.Precision({self.policy.name!r}) with {len(optimizers)} optimizers: "
                                "its master weights or update rule follow one optimizer; accepted: one")
            self.policy.setup(_unwrap(model), optimizers[0])
        return model, optimizers, lr_schedulers

    def forward_context(self) -> AbstractContextManager:
        return self.policy.autocast(self.device_type)

    # ---- backward and step ------------------------------------------------------------------
    def pre_backward(self, tensor: torch.Tensor, module):
        """The Trainer backpropagates what this returns: the scaled loss (Fabric ignores it: see backward)."""
        if not isinstance(module, pl.LightningModule):
            return tensor
        return self.policy.scale_loss(super().pre_backward(tensor, module))

    def post_backward(self, tensor: torch.Tensor, module):
        return super().post_backward(tensor, module) if isinstance(module, pl.LightningModule) else tensor

    def backward(self, tensor: torch.Tensor, model, *args, **kwargs) -> None:
        with self.policy.emulation.context():  # the backward's matmuls as the forward's (CPU emulation)
            if isinstance(model, pl.LightningModule):  # the Trainer: (tensor, model, optimizer, *args)
                model.backward(tensor, *args[1:], **kwargs)
            else:  # Fabric: (tensor, module, *args), the loss as the user gave it
                self.policy.scale_loss(tensor).backward(*args, **kwargs)

    def optimizer_step(self, optimizer, model=None, closure=None, **kwargs):
        """Fabric: (optimizer); the Trainer: (optimizer, model, closure). The closure runs the
        forward and backward; the policy's step follows (clipping to the Trainer's
        gradient_clip_val, else this plugin's max_norm)."""
        optimizer = getattr(optimizer, "optimizer", optimizer)  # a LightningOptimizer's torch optimizer
        if model is None:  # Fabric: optimizer.step() or optimizer.step(closure)
            if closure is not None:
                with torch.enable_grad():
                    closure()
            return self.steps.step(optimizer, rerun=closure or self._rerun_forward())
        self._clip = None
        result = closure()
        self._after_closure(model, optimizer)  # the user's hooks, and clip_gradients (recorded below)
        if model.automatic_optimization and result is None:
            return None  # training_step returned None: no backward, no step (as Lightning's own plugins)
        self.steps.step(optimizer, rerun=closure, max_norm=self._clip)
        return result

    def convert_input(self, data):
        """Fabric hands every forward's inputs here: the last ones are what the locator re-runs."""
        self._last_input = data
        return data

    def _rerun_forward(self):
        """Fabric without a closure: the last forward again (a forward finding; for the backward's, give the
        step a closure: optimizer.step(closure))."""
        if self._last_input is None or self.steps.model is None:
            return None
        (args, kwargs), model = self._last_input, self.steps.model  # Fabric converts (args, kwargs)

        def rerun():
            with self.forward_context():
                return model(*args, **kwargs)
        return rerun

    def clip_gradients(self, optimizer, clip_val=0.0, gradient_clip_algorithm=None) -> None:
        from lightning.pytorch.utilities import GradClipAlgorithmType

        if clip_val and gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            raise UserError("mixprec.lightning.Precision: gradient_clip_algorithm 'value' is not applied (the policy "
                            "clips the unscaled gradients by their norm inside the step); accepted: 'norm'")
        self._clip = float(clip_val) if clip_val else None

    def unscale_gradients(self, optimizer) -> None:
        raise UserError("fabric.clip_gradients with mixprec.lightning.Precision: the policy clips the unscaled "
                        "gradients inside the step; accepted: Precision(..., max_norm=1.0)")

    def teardown(self) -> None:
        """The end of the Trainer's fit: the steps not read yet are read (under Fabric, call
        plugin.steps.read() after the last step)."""
        self.steps.read()
        super().teardown()

    # ---- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return self.steps.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.steps.load_state_dict(state_dict)

    @property
    def incidents(self) -> list[dict]:
        """One record per non-finite step: step, finding (module, phase, op, dtype), action."""
        return self.steps.incidents


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "module", model)


def _sharded_by_lightning(module: torch.nn.Module) -> bool:
    trainer = getattr(module, "_trainer", None) if isinstance(module, pl.LightningModule) else None
    strategy = getattr(trainer, "strategy", None)
    return type(strategy).__name__ in ("FSDPStrategy", "ModelParallelStrategy", "DeepSpeedStrategy")
