"""mixprec inside the Hugging Face Trainer: the user's Trainer code, one class name changed.

    trainer = mixprec.hf.Trainer(model=model, args=args, train_dataset=data, precision="fp8-rowwise")
    trainer.train()                                  # resume_from_checkpoint=True works as ever

What it does on top of transformers.Trainer, each through one of its hooks:
- the model's Linear layers converted to the preset's FP8/microscaled format before the
  optimizer is built (the output projection left out, as in mixprec's own runs), the
  parameters cast, master weights set up (`create_optimizer`);
- the forward and the loss under the policy's autocast (`compute_loss_context_manager`);
- the backward through the loss scaler (the accelerator's `backward`);
- the optimizer step through the policy: unscale, clip to `args.max_grad_norm` on the true
  gradients (the Trainer's own clipping is switched off in this Trainer's copy of the
  arguments: it would clip scaled gradients), a non-finite step skipped on the device, the
  loss scale updated; every `logging_steps` the steps are read, and a non-finite one is
  re-run under the locator, reported by module name, and a narrow layer found first promoted
  (mixprec.stability.framework);
- the policy's state (loss scale, FP8 amax histories, promoted layers) saved beside every
  checkpoint (mixprec_precision.pt) and restored by `train(resume_from_checkpoint=...)`;
- `audit(batches)`: mixprec.audit on batches of the Trainer's own dataloader.

Accelerate's own mixed precision (TrainingArguments fp16/bf16, ACCELERATE_MIXED_PRECISION)
must be off: it would autocast and scale on top of the policy (refused in one line).
"""

from __future__ import annotations

import copy
import itertools
import logging
import os

import torch

from mixprec.errors import UserError, unreadable
from mixprec.precision import Policy
from mixprec.stability.framework import FrameworkSteps

try:
    import transformers
except ImportError:  # pragma: no cover - the message is the point
    raise ImportError("mixprec.hf needs transformers and accelerate: pip install 'mixprec[hf]'") from None

logger = logging.getLogger(__name__)

STATE_FILE = "mixprec_precision.pt"  # in each checkpoint-N folder


def load_precision_state(path: str) -> dict:
    """The policy's state saved beside a checkpoint, read with pickle's code execution off
    (weights_only): a checkpoint folder from elsewhere runs no code. One line for a file that
    is not such a state."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        if not unreadable(e):
            raise
        reason = " ".join(str(e).split())[:160]
        raise UserError(f"{path}: not a mixprec precision state ({type(e).__name__}: {reason}); accepted: the "
                        f"{STATE_FILE} mixprec.hf.Trainer saves, which holds tensors and plain values only") from None


class Trainer(transformers.Trainer):
    """transformers.Trainer with a mixprec precision preset. precision: the preset;
    precision_settings: Policy.from_preset's keywords (overrides, loss_scale, fp8_recipe, ...);
    read_every: read the steps' results every this many steps (default: args.logging_steps)."""

    def __init__(self, model=None, args=None, *positional, precision: str = "bf16-mixed",
                 precision_settings: dict | None = None, read_every: int | None = None, **kwargs):
        if args is None:
            args = transformers.TrainingArguments(output_dir="trainer_output")
        accelerate_precision = _accelerate_mixed_precision(args)
        if accelerate_precision != "no":
            raise UserError(f"mixprec.hf.Trainer(precision={precision!r}) with Accelerate's mixed precision "
                            f"{accelerate_precision!r} (TrainingArguments fp16/bf16 or ACCELERATE_MIXED_PRECISION): both "
                            "would autocast and scale; accepted: fp16=False, bf16=False, and the mode as precision=")
        self.policy = Policy.from_preset(precision, **(precision_settings or {}))
        device_type = "cpu" if args.use_cpu or not torch.cuda.is_available() else "cuda"
        self.policy.prepare_model(model, device_type)
        args = copy.copy(args)  # the user's arguments stay as they were
        max_norm, args.max_grad_norm = args.max_grad_norm, 0.0
        every = read_every or (int(args.logging_steps) if args.logging_steps >= 1 else 1)
        self.mixprec = FrameworkSteps(self.policy, max_norm=max_norm, read_every=every)
        self.mixprec.model = model
        self._device_type, self._resume_from, self._current = device_type, None, None
        super().__init__(model, args, *positional, **kwargs)
        self.add_callback(_PrecisionState(self))

    # ---- the pieces of the loop -------------------------------------------------------------
    def create_optimizer(self, model=None):
        # transformers before 5.x passes no model (create_optimizer(self))
        optimizer = super().create_optimizer(model) if model is not None else super().create_optimizer()
        if isinstance(optimizer, PolicyOptimizer):
            return optimizer
        if self.policy.model is None:  # mixprec's AdamW in place of torch's where the mode keeps other moments
            _, optimizer = self.policy.setup(self.model, optimizer)
        if self._resume_from is not None:
            path = os.path.join(self._resume_from, STATE_FILE)
            if os.path.exists(path):
                self.mixprec.load_state_dict(load_precision_state(path))
            else:
                logger.warning("mixprec: %s has no %s: the precision state (loss scale, FP8 histories, promoted "
                               "layers) starts afresh", self._resume_from, STATE_FILE)
        self.optimizer = PolicyOptimizer(optimizer, self)
        return self.optimizer

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        self.accelerator.backward = self._backward

    def _backward(self, loss: torch.Tensor, **kwargs) -> None:
        self.policy.backward(loss)  # the Trainer divided by the accumulation steps already

    def compute_loss_context_manager(self):
        return self.policy.autocast(self._device_type)

    def training_step(self, model, inputs, num_items_in_batch=None):
        self._current = (model, inputs, num_items_in_batch)  # for the locator's re-run
        return super().training_step(model, inputs, num_items_in_batch)

    def _rerun_of(self, current):
        """This step's re-run for the locator: its own (last) micro-batch, whenever it is read."""
        model, inputs, items = current
        return lambda: super(Trainer, self).training_step(model, inputs, items)

    # ---- what the Trainer logs --------------------------------------------------------------
    def _get_grad_norm(self, model, grad_norm=None):
        """The Trainer's own norm would be of the scaled gradients, before the step: none is
        computed; the step's is logged (below)."""
        return None

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, *args, **kwargs):
        """The logged grad_norm is the one the policy clipped with: of the unscaled gradients
        (on the device until a log line reads it)."""
        last = self.mixprec.last
        if last is not None:
            grad_norm = last.on_device("grad_norm")
        return super()._maybe_log_save_evaluate(tr_loss, grad_norm, *args, **kwargs)

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        if resume_from_checkpoint is True:
            from transformers.trainer_utils import get_last_checkpoint

            self._resume_from = get_last_checkpoint(self.args.output_dir)
        elif isinstance(resume_from_checkpoint, str):
            self._resume_from = resume_from_checkpoint
        return super().train(resume_from_checkpoint, *args, **kwargs)

    # ---- the audit --------------------------------------------------------------------------
    def audit(self, batches: int = 2) -> dict:
        """mixprec.audit of one optimizer step on the first `batches` batches of the Trainer's
        train dataloader (two or more: accumulation is checked too); the model is trained one step."""
        from mixprec.analysis.audit import audit

        if not isinstance(self.optimizer, PolicyOptimizer):
            self.create_optimizer()
        data = [self._prepare_inputs(b) for b in itertools.islice(self.get_train_dataloader(), batches)]
        return audit(self.model, self.policy, self.optimizer.optimizer, data, max_norm=self.mixprec.max_norm)

    @property
    def incidents(self) -> list[dict]:
        return self.mixprec.incidents


class PolicyOptimizer(torch.optim.Optimizer):
    """The optimizer the Trainer steps: its step() is the policy's over the real optimizer
    (unscale, clip, skip on the device, loss scale); everything else is the real one's."""

    def __init__(self, optimizer: torch.optim.Optimizer, trainer: Trainer):
        self.optimizer, self._trainer = optimizer, trainer
        # torch.optim.Optimizer's own machinery (step hooks, the profiler's step wrapper): its
        # __init__ empties and refills param_groups and state, which here are the real
        # optimizer's; they are put back as they were, the same objects (schedulers hold them)
        groups, state = optimizer.param_groups, optimizer.state
        super().__init__(list(groups), optimizer.defaults)
        optimizer.param_groups, optimizer.state = groups, state

    param_groups = property(lambda self: self.optimizer.param_groups,
                            lambda self, v: setattr(self.optimizer, "param_groups", v))
    state = property(lambda self: self.optimizer.state, lambda self, v: setattr(self.optimizer, "state", v))
    defaults = property(lambda self: self.optimizer.defaults, lambda self, v: setattr(self.optimizer, "defaults", v))

    def step(self, closure=None):
        if closure is not None:
            with torch.enable_grad():
                closure()
        t = self._trainer
        return t.mixprec.step(self.optimizer, rerun=t._rerun_of(t._current) if t._current is not None else None)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, group) -> None:
        self.optimizer.add_param_group(group)

    def __repr__(self) -> str:
        return f"PolicyOptimizer({self._trainer.policy.name}, {self.optimizer!r})"


def _accelerate_mixed_precision(args) -> str:
    """What Accelerate will autocast in: TrainingArguments' fp16 or bf16, else its environment
    variable (TrainingArguments.mixed_precision holds the same from transformers 5 on)."""
    if args.fp16:
        return "fp16"
    if args.bf16:
        return "bf16"
    return os.environ.get("ACCELERATE_MIXED_PRECISION", "no")


class _PrecisionState(transformers.TrainerCallback):
    """The policy's state beside each checkpoint; the steps not read yet, read at the end."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer

    def on_train_end(self, args, state, control, **kwargs):
        self.trainer.mixprec.read()

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            torch.save(self.trainer.mixprec.state_dict(), os.path.join(folder, STATE_FILE))
