"""mixprec as Lightning precision plugins, one for Fabric and one for the Trainer (as
Lightning's own plugins come in pairs):

    fabric = L.Fabric(accelerator="cpu", plugins=[mixprec.lightning.FabricPrecision("fp8-rowwise")])
    trainer = L.Trainer(plugins=[mixprec.lightning.TrainerPrecision("fp16-mixed")], gradient_clip_val=1.0)

Every preset and Policy setting (both take Policy.from_preset's keywords: overrides,
loss_scale, fp8_recipe, ...). The hooks map one to one onto the policy's: convert_module
(FP8/MX conversion and the parameter casts), forward_context (autocast or none), backward
(the scaled loss, under the matmul emulation where the CPU has no kernel), optimizer_step
(unscale, clip on the true gradients, skip a non-finite step on the device, the loss scale),
state_dict (the loss scaler, FP8 amax histories, promoted layers: the Trainer keeps it in its
checkpoints). A non-finite step is skipped, re-run under the locator and reported by module
name, and a narrow layer found first is promoted (mixprec.stability.framework).

Refused, one line each: master-weight and bf16-update presets under Fabric (Fabric never
gives a precision plugin the optimizer before the first step, and those presets step other
tensors than the model's; the Trainer does, through `connect`); Lightning's own FSDP
strategy (its MixedPrecisionPolicy would cast over mixprec's: shard with
mixprec.distributed.apply_fsdp instead); clipping by value, and `fabric.clip_gradients`
(clipping happens inside the step, on unscaled gradients: give `max_norm` here or the
Trainer's gradient_clip_val); TrainerPrecision under Fabric (which takes any Lightning
precision plugin; the Trainer refuses FabricPrecision itself).
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch

from mixprec.errors import UserError
from mixprec.precision import Policy
from mixprec.stability.framework import READ_EVERY, FrameworkSteps

try:
    import lightning.pytorch as pl
    from lightning.fabric.plugins.precision import Precision as _FabricPrecision
    from lightning.pytorch.plugins.precision import Precision as _TrainerPrecision
except ImportError:  # pragma: no cover - the message is the point
    raise ImportError("mixprec.lightning needs Lightning: pip install 'mixprec[lightning]' (the lightning "
                      "package, 2.4 or newer)") from None

__all__ = ["FabricPrecision", "TrainerPrecision"]

# Lightning's name for the closest of its own precisions (what trainer.precision reports)
_LIGHTNING_NAMES = {"fp32": "32-true", "bf16-mixed": "bf16-mixed", "fp16-mixed": "16-mixed", "bf16-true": "bf16-true",
                    "fp16-true": "16-true"}


class _PolicyPlugin:
    """What both plugins share: the policy, its steps through mixprec.stability.framework, the
    forward's autocast, checkpoints."""

    def __init__(self, preset: str = "bf16-mixed", *, max_norm: float | None = None, read_every: int | None = None,
                 device_type: str | None = None, **settings):
        """read_every: read what the steps did every this many steps (the step never waits for
        the device in between); default 10 (mixprec train's metrics.log_freq), under the
        Trainer its log_every_n_steps."""
        self.policy = Policy.from_preset(preset, **settings)
        self.precision = _LIGHTNING_NAMES.get(self.policy.name, "32-true")
        self.steps = FrameworkSteps(self.policy, max_norm=max_norm, read_every=read_every or READ_EVERY)
        self._read_every_given = read_every is not None
        self.device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")

    def _prepare(self, module: torch.nn.Module) -> None:
        if _sharded_by_lightning(module):
            raise UserError(f"mixprec.lightning.{type(self).__name__} with Lightning's FSDP strategy: its "
                            "MixedPrecisionPolicy would cast over mixprec's; accepted: a single-device or DDP "
                            "strategy, or shard the model with mixprec.distributed.apply_fsdp inside configure_model")
        self.policy.prepare_model(module, self.device_type)
        self.steps.model = module

    def forward_context(self) -> AbstractContextManager:
        return self.policy.autocast(self.device_type)

    def state_dict(self) -> dict:
        return self.steps.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.steps.load_state_dict(state_dict)

    @property
    def incidents(self) -> list[dict]:
        """One record per non-finite step: step, finding (module, phase, op, dtype), action."""
        return self.steps.incidents


class FabricPrecision(_PolicyPlugin, _FabricPrecision):
    """A mixprec precision preset as Fabric's precision plugin. Fabric has no end of training
    to hook: call `plugin.steps.read()` after the last step (the steps not read yet)."""

    def __init__(self, preset: str = "bf16-mixed", **kwargs):
        super().__init__(preset, **kwargs)
        self._last_input = None  # the last forward's (args, kwargs), for the locator

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        if self.policy.needs_optimizer:
            raise UserError(f"mixprec.lightning.FabricPrecision({self.policy.name!r}): this preset keeps master "
                            "weights, its own update rule or its own optimizer states, which follow the optimizer, and "
                            "Fabric gives a precision "
                            "plugin no optimizer before the first step; accepted: L.Trainer with TrainerPrecision, "
                            "or mixprec's Policy in your own loop")
        self._prepare(module)
        self.policy.setup(module)  # the casts; no optimizer needed
        return module

    def convert_input(self, data):
        """Fabric hands every forward's inputs here: the last ones are what the locator re-runs."""
        self._last_input = data
        return data

    def backward(self, tensor: torch.Tensor, model, *args, **kwargs) -> None:
        with self.policy.emulation.context():  # the backward's matmuls as the forward's (CPU emulation)
            self.policy.scale_loss(tensor).backward(*args, **kwargs)

    def optimizer_step(self, optimizer, closure=None, **kwargs):
        """optimizer.step() or optimizer.step(closure): the policy's step, with this plugin's max_norm."""
        if closure is not None:
            with torch.enable_grad():
                closure()
        return self.steps.step(getattr(optimizer, "optimizer", optimizer), rerun=closure or self._rerun_forward())

    def _rerun_forward(self):
        """Without a closure: the last forward again (a forward finding; for the backward's, give the
        step a closure: optimizer.step(closure))."""
        if self._last_input is None or self.steps.model is None:
            return None
        (args, kwargs), model = self._last_input, self.steps.model  # Fabric converts (args, kwargs)

        def rerun():
            with self.forward_context():
                return model(*args, **kwargs)
        return rerun

    def unscale_gradients(self, optimizer) -> None:
        raise UserError("fabric.clip_gradients with mixprec.lightning.FabricPrecision: the policy clips the unscaled "
                        "gradients inside the step; accepted: FabricPrecision(..., max_norm=1.0)")


class TrainerPrecision(_PolicyPlugin, _TrainerPrecision):
    """A mixprec precision preset as the Lightning Trainer's precision plugin: clipping to the
    Trainer's gradient_clip_val (else this plugin's max_norm), reads at its log_every_n_steps."""

    def __init__(self, preset: str = "bf16-mixed", **kwargs):
        super().__init__(preset, **kwargs)
        self._clip: float | None = None  # the Trainer's gradient_clip_val, seen at each step

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        if not isinstance(module, pl.LightningModule):
            raise UserError("mixprec.lightning.TrainerPrecision under Fabric; accepted: "
                            "mixprec.lightning.FabricPrecision")
        self._prepare(module)
        if not self.policy.needs_optimizer:
            self.policy.setup(module)  # the casts; the optimizer comes in connect for the others
        return module

    def connect(self, model, optimizers, lr_schedulers):
        """The model and its optimizers, before the first step."""
        trainer = getattr(_unwrap(model), "_trainer", None)
        if not self._read_every_given and getattr(trainer, "log_every_n_steps", 0):
            self.steps.read_every = int(trainer.log_every_n_steps)  # read where the Trainer logs
        if self.policy.needs_optimizer:
            if len(optimizers) != 1:
                raise UserError(f"mixprec.lightning.TrainerPrecision({self.policy.name!r}) with {len(optimizers)} "
                                "optimizers: its master weights or update rule follow one optimizer; accepted: one")
            _, optimizer = self.policy.setup(_unwrap(model), optimizers[0])
            optimizers = [optimizer]  # mixprec's AdamW where the mode keeps other moments (the same group dicts)
        elif self.policy.optimizer_states is not None and len(optimizers) == 1:
            optimizers = [self.policy.adopt(_unwrap(model), optimizers[0])]
        return model, optimizers, lr_schedulers

    def pre_backward(self, tensor: torch.Tensor, module):
        """The Trainer backpropagates what this returns: the scaled loss."""
        return self.policy.scale_loss(super().pre_backward(tensor, module))

    def backward(self, tensor: torch.Tensor, model, optimizer, *args, **kwargs) -> None:
        with self.policy.emulation.context():  # the backward's matmuls as the forward's (CPU emulation)
            model.backward(tensor, *args, **kwargs)

    def optimizer_step(self, optimizer, model, closure, **kwargs):
        """Lightning's own step hook, handed the policy's step as the optimizer: the closure
        (forward, backward), then Lightning's on_before_optimizer_step hooks and clipping
        (recorded by clip_gradients), then the policy's step."""
        optimizer = getattr(optimizer, "optimizer", optimizer)  # a LightningOptimizer's torch optimizer
        self._clip = None

        def step(closure=None, **_):
            result = closure()  # Lightning's wrapped closure: the user's, then the hooks and clipping
            if model.automatic_optimization and result is None:
                return None  # training_step returned None: no backward, no step (as Lightning's own plugins)
            self.steps.step(optimizer, rerun=rerun, max_norm=self._clip)
            return result

        rerun = closure  # the user's closure alone: the locator's re-run calls no hooks
        return super().optimizer_step(_Steppable(optimizer, step), model, closure, **kwargs)

    def clip_gradients(self, optimizer, clip_val=0.0, gradient_clip_algorithm=None) -> None:
        from lightning.pytorch.utilities import GradClipAlgorithmType

        if clip_val and gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            raise UserError("mixprec.lightning.TrainerPrecision: gradient_clip_algorithm 'value' is not applied (the "
                            "policy clips the unscaled gradients by their norm inside the step); accepted: 'norm'")
        self._clip = float(clip_val) if clip_val else None

    def teardown(self) -> None:
        """The end of the fit: the steps not read yet are read."""
        self.steps.read()
        super().teardown()


class _Steppable:
    """The optimizer as Lightning's hooks see it (every attribute is the optimizer's) whose
    step(closure) is the policy's: what TrainerPrecision hands Lightning's optimizer_step."""

    def __init__(self, optimizer: torch.optim.Optimizer, step):
        self._optimizer, self.step = optimizer, step

    def __getattr__(self, name: str):
        return getattr(self._optimizer, name)


def __getattr__(name: str):
    if name == "Precision":  # the one class of earlier versions, for both loops
        raise AttributeError("mixprec.lightning.Precision is now two classes: FabricPrecision (L.Fabric) and "
                             "TrainerPrecision (L.Trainer)")
    raise AttributeError(f"module 'mixprec.lightning' has no attribute {name!r}")


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "module", model)


def _sharded_by_lightning(module: torch.nn.Module) -> bool:
    trainer = getattr(module, "_trainer", None) if isinstance(module, pl.LightningModule) else None
    strategy = getattr(trainer, "strategy", None)
    return type(strategy).__name__ in ("FSDPStrategy", "ModelParallelStrategy", "DeepSpeedStrategy")
