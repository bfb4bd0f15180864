"""The precision policy: a PrecisionSpec put to work. It owns the lifecycle (setup, autocast,
backward, step, state) and hands each concern to a part that keeps its own state: loss
scaling with its fallback, master weights, the update rule, module formats (FP8 and
per-module compute), matmul emulation and TF32. Nothing else in mixprec branches on a
precision name.

    policy = Policy.from_preset("bf16-mixed")
    model, optimizer = policy.setup(model, optimizer)
    with policy.autocast():
        loss = model(x, y)
    policy.backward(loss)
    result = policy.step(optimizer, max_norm=1.0)   # a StepResult; truthy when applied
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import replace

import torch

from mixprec.dtypes import dtype_name
from mixprec.optim.updates import BF16Updates
from mixprec.precision import describe as _describe
from mixprec.precision import optimizer_states
from mixprec.precision.conversion import ModuleFormats
from mixprec.precision.emulation import Emulation
from mixprec.precision.grad_norm import grad_norm
from mixprec.precision.layout import Layout, resolve
from mixprec.precision.loss_scaling import LossScaling, device_skip, fall_back, fallback_target, step_unless
from mixprec.precision.master import MasterWeights, cast_parameters
from mixprec.precision.presets import FP32, name_of, spec_of_preset
from mixprec.precision.scaling_config import LossScaleConfig
from mixprec.precision.spec import PrecisionSpec, Update, format_name, parse_format
from mixprec.precision.step import ReadSchedule, StepCounts, StepResult
from mixprec.precision.tf32 import set_tf32, tf32_active

logger = logging.getLogger(__name__)
__all__ = ["Policy", "StepResult"]


class Policy:
    """`spec` says what each tensor is in; the keywords are run settings. loss_scale: the
    scaler's settings for a spec with loss scaling; emulate_matmul: None decides at setup;
    tf32: FP32 matmuls on CUDA as TF32; fp8_exclude / fp8_emulate: FP8 layers' filter and
    GEMM route; update_seed: keys bf16-sr; read_every: steps between reads of what the steps
    did (`settle`; 0: only when the caller settles), the start of `reads`, the policy's
    ReadSchedule, which the trainer and the framework integrations set up as they need.
    Without a spec, the spec's fields may be given as keywords (Policy(param_dtype="bfloat16"))."""

    def __init__(self, spec: PrecisionSpec | None = None, *, loss_scale: LossScaleConfig | None = None,
                 emulate_matmul: bool | None = None, tf32: bool = False, fp8_exclude: tuple[str, ...] = (),
                 fp8_emulate: bool | None = None, update_seed: int = 0, read_every: int = 10, **fields):
        if spec is None:
            fields.setdefault("loss_scaling", loss_scale is not None)
            if fields.get("update") is None:
                fields.pop("update", None)
            spec = PrecisionSpec(**fields)
        elif fields:
            raise TypeError(f"Policy got both a spec and its fields {sorted(fields)}")
        self.spec = spec
        self.loss_scale = (loss_scale or LossScaleConfig()) if spec.loss_scaling else None
        self.tf32, self.fp8_exclude, self.fp8_emulate, self.update_seed = tf32, tuple(fp8_exclude), fp8_emulate, update_seed
        self.requested = self.name = name_of(spec)
        self.sharded = False  # set by fsdp_mixed_precision(): fully_shard does the casts
        self.narrow_gathers = ""  # set by apply_fsdp: which low-precision weights all-gather in their own format
        self.device_type: str | None = None
        self.layout: Layout | None = None
        self.emulation = Emulation(emulate_matmul)
        self.formats = self.scaling = self.masters = self.updates = None
        self.model = self.optimizer = None  # what setup was given: a fallback recasts them
        self.counts = StepCounts()
        self.reads = ReadSchedule(read_every)
        self._pending: list[StepResult] = []  # steps not read yet
        self._host_skip: str | None = None  # why this optimizer's steps read the skip on the host ("": they do not)
        self.fallback_step: int | None = None
        self.promoted: dict[str, dict] = {}  # FP8 layers taken out of FP8 during the run, with why
        _describe.warn_known_bad(self)

    @classmethod
    def from_preset(cls, name: str, *, labels: dict[str, str] | None = None, fp8_recipe: str = "",
                    fp8_options: dict | None = None, overrides=(), **settings) -> Policy:
        """A preset by name or alias. Keywords: the run settings of Policy(), plus `reduce_dtype`
        (a field a preset only defaults), `storage_dtype` / `param_dtype` (which must agree with
        the preset: an error naming both otherwise), `fp8_recipe` (a recipe on a preset without
        one) with `fp8_options` (its tunable fields), and `overrides` (per-module rules).
        `labels` names each field as the user wrote it (for messages)."""
        spec = spec_of_preset(name, labels or {}, fp8_recipe, fp8_options, overrides, settings)  # pops dtypes
        return cls(spec, **settings)

    # ---- what the policy promises -------------------------------------------------
    storage_dtype = property(lambda self: FP32 if self.sharded and self.spec.master_weights
                             else self.spec.storage_dtype,
                             doc="The parameters' dtype (under fully_shard the FP32 shards are the masters).")
    param_dtype = property(lambda self: self.spec.param_dtype, doc="Matmul compute.")
    reduce_dtype = property(lambda self: self.spec.reduce_dtype, doc="Gradient reduction across ranks.")
    master_weights = property(lambda self: self.spec.master_weights)
    fp8 = property(lambda self: self.spec.fp8, doc="The base mode's FP8 recipe, or None.")
    update = property(lambda self: None if self.spec.update is Update.NEAREST else self.spec.update.value)
    emulate_matmul = property(lambda self: self.emulation.active)
    optimizer_states = property(
        lambda self: optimizer_states.wanted(self.spec),
        doc="The moments the mode asks of the optimizer where torch's AdamW keeps others (fp8-blockwise: bfloat16; "
            "the 8-bit formats), or None.")
    fp8_conversion = property(lambda self: self.formats.main if self.formats is not None else None)

    @property
    def uses_autocast(self) -> bool:
        # A master-weights model mixes FP32 norms with low-precision weights: autocast
        # casts the FP32 activations for the matmuls. Under FSDP, fully_shard casts.
        return not self.sharded and (self.param_dtype != self.storage_dtype or self.master_weights)

    def fsdp_mixed_precision(self):
        """FSDP2's MixedPrecisionPolicy for this policy. From then on the policy leaves the
        casts to fully_shard and never autocasts on top of them (that would cast twice)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        self.spec.check_shardable()
        self.sharded = True
        if self.layout is not None and self.spec.master_weights:
            # The sharded FP32 parameters are the master weights: no second copy is needed,
            # and fp16-master computes exactly what fp16-mixed computes under FSDP.
            self.layout = replace(self.layout, modules={f: replace(m, storage=FP32)
                                                        for f, m in self.layout.modules.items()})
        compute = self.param_dtype if self.param_dtype != self.storage_dtype else None
        return MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=self.reduce_dtype)

    @property
    def tf32_active(self) -> bool:
        """Whether this run's FP32 matmuls run as TF32: on CUDA, by torch's process-wide setting."""
        return tf32_active(self.device_type)

    @property
    def matmul_dtype(self) -> str:
        """What the matmuls really compute in: param_dtype, or tf32 for FP32 matmuls as TF32."""
        return "tfloat32" if self.param_dtype == FP32 and self.tf32_active else dtype_name(self.param_dtype)

    def describe(self) -> dict[str, str]:
        """Which dtype each kind of tensor is kept in under this policy."""
        return _describe.describe(self)

    def __repr__(self) -> str:
        return _describe.policy_repr(self)

    # ---- hooks ----------------------------------------------------------------------
    def prepare_model(self, model: torch.nn.Module, device_type: str | None = None) -> Layout:
        """Resolve the spec against `model` into its per-module layout and apply it (FP8
        conversion, per-module compute) before anything wraps the model (compile,
        fully_shard). Runs once; setup calls it when nobody did. device_type: where the model
        will compute (default: its parameters' device; a model on the meta device names it)."""
        if self.layout is None:
            first = next(model.parameters(), None)
            self.device_type = device_type or (first.device.type if first is not None else "cpu")
            self.layout = resolve(self.spec, model, exclude=self.fp8_exclude, sharded=self.sharded)
            self.formats = ModuleFormats(self.layout, self.fp8_emulate)
            self.formats.apply(model, self.device_type)
        return self.layout

    def will_emulate(self, device_type: str) -> bool:
        """Whether setup on `device_type` emulates this policy's low-precision matmuls."""
        return self.emulation.will_emulate(device_type, self.spec.low_precision_dtypes)

    def setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
              convert_states: bool = False):
        """Cast the parameters in place (the same Parameter objects, so an optimizer built
        before keeps working; buffers are left alone), swap in FP32 master weights where
        the mode has them, put mixprec's AdamW in place of torch's where the mode promises
        other moments (logged; use the optimizer returned), and log which path handles mixed
        precision. convert_states: that AdamW converts a loaded state of another moment
        format instead of refusing it."""
        if optimizer is not None and optimizer.state:
            raise ValueError("Policy.setup needs an optimizer that has not stepped yet")
        if self.needs_optimizer and optimizer is None:
            raise ValueError(f"{self.name} changes how the optimizer updates the weights: pass it to Policy.setup")
        layout = self.prepare_model(model)
        first = next(model.parameters(), None)
        if first is not None:
            self.formats.probe(first.device.type)  # where the model computes now, outside any step
            if self.device_type == "meta":  # prepared on meta without a device_type: materialised since
                self.device_type = first.device.type
        optimizer = optimizer_states.put_in_place(self, model, optimizer, convert=convert_states)
        self.model, self.optimizer = model, optimizer
        _describe.warn_optimizer(self, optimizer)
        fp32_modules = {fqn for fqn, m in layout.modules.items() if m.storage == FP32}
        cast_parameters(model, self.storage_dtype, keep_fp32=lambda fqn, m: fqn in fp32_modules)
        if self.master_weights and not self.sharded:
            self.masters = MasterWeights(model, optimizer)
        if self.update and not getattr(optimizer, "compensated", False):  # else that AdamW compensates itself
            self.updates = BF16Updates(optimizer, self.update, seed=self.update_seed)  # logs its path
        if self.loss_scale is not None:
            self.scaling = LossScaling(self.loss_scale, next(model.parameters()).device, fallback_target(self))
        _describe.log_path(self)
        set_tf32(self.device_type, self.tf32)
        self.emulation.choose(self.device_type, self.spec.low_precision_dtypes)
        return model, optimizer

    def adopt(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """After setup(model) without one: the optimizer to step, mixprec's AdamW in place of
        torch's where the mode keeps other moments (logged)."""
        self.optimizer = optimizer_states.put_in_place(self, model, optimizer)
        return self.optimizer

    def autocast(self, device_type: str | None = None):
        """Context for the forward pass and the loss."""
        stack = contextlib.ExitStack()
        if self.uses_autocast:
            device_type = device_type or self.device_type or ("cuda" if torch.cuda.is_available() else "cpu")
            stack.enter_context(torch.autocast(device_type, dtype=self.param_dtype))
        stack.enter_context(self.emulation.context())
        return stack

    @property
    def needs_optimizer(self) -> bool:
        """Whether setup needs the optimizer: master weights and bf16 update rules step other
        tensors than the model's (or the model's in their own way)."""
        return bool(self.master_weights or self.update or self.spec.moments.quantized)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to backpropagate: times the loss scale where the mode scales."""
        return self.scaling.scale_loss(loss) if self.scaling is not None else loss

    def backward(self, loss: torch.Tensor) -> None:
        with self.emulation.context():
            self.scale_loss(loss).backward()

    def step(self, optimizer: torch.optim.Optimizer, max_norm: float | None = None, *,
             step: int | None = None) -> StepResult:
        """Unscale, clip to `max_norm` (when given) on the true gradients, step unless a
        gradient overflowed or the norm is not finite, update the loss scale, clear the
        gradients. Every decision is made on the device: the host reads nothing here (but
        for an optimizer that cannot skip on the device: logged at its first step). A skipped step
        changes no parameter, optimizer state or step count. What the step did is read at
        `settle()` (counts, log lines, the fallback), after the steps `reads` says are due,
        or when the caller reads a field of the StepResult (the caller's sync). step: the
        caller's number for this step (the trainer's, which a rewind takes back); default:
        the steps this policy has taken."""
        self.optimizer = optimizer
        if self.masters is not None:
            self.masters.grads_to_master()
        # 1.0 on the device where a gradient overflowed, else 0.0
        overflow = self.scaling.unscale(optimizer).clamp(max=1.0) if self.scaling is not None else None
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        total, groups = grad_norm(params)  # in the gradients' dtype: clipping divides by it as it is
        norm = total.float()  # the norm is the same on every rank, so is every decision below
        finite = torch.isfinite(norm)
        # Without a loss scaler nothing else guards the weights: an inf or NaN anywhere in
        # the gradients makes the global norm non-finite, and that step is skipped too.
        nonfinite = ~finite if overflow is None else ~finite & (overflow == 0)
        skip = (~finite).float() if overflow is None else torch.maximum((~finite).float(), overflow)
        if max_norm:
            # torch's clip: coefficient min(1, max_norm / (norm + 1e-6)) on the device; on a
            # skipped step the gradients it scales are dropped with the step
            for group in groups:
                torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
        clipped = (norm > max_norm) & (skip == 0) if max_norm else torch.zeros_like(finite)
        if self._host_skip is None:
            self._host_skip = device_skip(optimizer, self.updates) or ""
            if self._host_skip:
                logger.warning("precision: each step reads its skip decision on the host: %s", self._host_skip)
        step_unless(optimizer, skip, updates=self.updates, on_host=bool(self._host_skip))
        if self.masters is not None:
            self.masters.master_to_model()  # a skipped step left the masters as they were
        optimizer.zero_grad(set_to_none=True)
        if self.formats is not None:
            self.formats.after_step()
        scale = self.scaling.update(overflow) if self.scaling is not None else None
        values = torch.stack([1 - skip, torch.zeros_like(norm) if overflow is None else overflow,
                              nonfinite.float(), clipped.float(), norm,
                              torch.zeros_like(norm) if scale is None else scale.to(norm.device)])
        result = StepResult(values, self.name, scaled=scale is not None)
        self._pending.append(result)
        if self.reads.due(step if step is not None else self.counts.steps + len(self._pending)):
            self.settle()
        return result

    def settle(self) -> list[StepResult]:
        """Read what the steps since the last read did, in one device-to-host copy, and act
        on it in step order: the counts and their log lines, the loss scale's log, and the
        fallback (which happens here, at the read: a run that falls back after N
        overflows in a row does so at the first read after the N-th). Returns those steps'
        results, read."""
        pending, self._pending = self._pending, []
        unread = [r for r in pending if not r.is_read]
        if unread:
            for r, host in zip(unread, torch.stack([r.values for r in unread]).tolist()):
                r.read(host)
        for r in pending:
            self.counts.record(r.applied, r.overflow, r.nonfinite, r.grad_norm)
            if r.scaled and self.scaling is not None:
                reason = self.scaling.record(self.counts.steps, r.overflow, r.loss_scale, self.counts.overflows)
                if reason:
                    fall_back(self, self.scaling.fallback_to, reason)
                    r.precision, r.fallback = self.name, reason
        return pending

    # ---- repairs during a run -----------------------------------------------------------
    def narrow(self, fqn: str) -> bool:
        """Whether module `fqn` (a Linear layer or an experts module) computes in a format narrower than the
        base mode's (FP8, FP4)."""
        return self.layout is not None and (fqn in self.layout.fp8() or fqn in self.layout.experts())

    def promote(self, fqn: str, step: int, evidence: str) -> dict:
        """Take FP8 layer `fqn` out of FP8 for the rest of the run: its matmuls compute in
        the base mode's dtype from the next forward on (kept in summary.json and in
        checkpoints; the caller logs why). The stability guard's repair; `unpromote` undoes
        it. Returns the record: step, from, to, evidence."""
        to = dtype_name(self.param_dtype)
        old = self.formats.promote(self.model, fqn, f"promoted at step {step}: {evidence}")
        self._sync_layout(fqn)
        self.promoted[fqn] = {"step": step, "from": format_name(old), "to": to, "evidence": evidence}
        return self.promoted[fqn]

    def unpromote(self, fqn: str) -> None:
        record = self.promoted.pop(fqn)
        self.formats.revert(self.model, fqn, parse_format(record["from"], "promoted"), "back after a failed replay")
        self._sync_layout(fqn)
        logger.warning("[PROMOTE] %s stays in %s: computing it in %s did not help", fqn, record["from"], record["to"])

    def _sync_layout(self, fqn: str) -> None:
        if self.layout is not self.formats.layout:  # fully_shard's copy of the layout
            self.layout.modules[fqn] = replace(self.layout.modules[fqn], compute=self.formats.layout.modules[fqn].compute,
                                               why=self.formats.layout.modules[fqn].why)

    def back_off_loss_scale(self) -> tuple[float, float] | None:
        """Multiply the loss scale by loss_scale.backoff_factor (after a rewind); (before, after),
        or None without a scaler."""
        return self.scaling.back_off() if self.scaling is not None else None

    # ---- reporting and checkpointing ------------------------------------------------
    def summary(self) -> dict:
        """The run's precision figures, for summary.json (reads the steps not read yet)."""
        self.settle()
        return _describe.summary(self)

    def model_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The model's weights at full precision: master copies where the mode has them."""
        return self.masters.model_state_dict(model) if self.masters is not None else model.state_dict()

    def load_model_state_dict(self, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
        if self.masters is not None:
            self.masters.load_model_state_dict(model, state)
        else:
            model.load_state_dict(state)

    def state_dict(self) -> dict:
        self.settle()
        c, scaling = self.counts, self.scaling
        return {
            "precision": self.requested, "precision_final": self.name, "steps": c.steps,
            "skipped": c.skipped, "nonfinite": c.nonfinite, "fallback_step": self.fallback_step,
            "monitor": {"overflows": c.overflows, "consecutive": scaling.consecutive if scaling is not None else 0},
            "scaler": scaling.state_dict() if scaling is not None else None,
            "fp8": self.formats.state_dict() if self.formats is not None else None,
            "updates": self.updates.state_dict() if self.updates is not None else None,
            "promoted": dict(self.promoted),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore counters and the loss scale; re-apply a fallback the saved run took.
        Call after setup and before loading the model's and optimizer's state."""
        self.settle()
        if state.get("precision") != self.requested:
            logger.warning("precision: resuming a %s checkpoint under %s", state.get("precision"), self.requested)
        elif state.get("fallback_step") is not None and self.fallback_step is None:
            fall_back(self, state["precision_final"], None)
            logger.info("precision: the checkpoint had fallen back to %s at step %d; resuming in %s",
                        state["precision_final"], state["fallback_step"], self.name)
            self.fallback_step = state["fallback_step"]
        monitor = state.get("monitor", {})
        self.counts = StepCounts(int(state["steps"]), int(state["skipped"]), int(state.get("nonfinite", 0)),
                                 int(monitor.get("overflows", 0)))
        if self.scaling is not None:
            self.scaling.load_state_dict(state.get("scaler"), int(monitor.get("consecutive", 0)))
        if self.formats is not None and state.get("fp8"):
            self.formats.load_state_dict(state["fp8"])
        if self.updates is not None and state.get("updates") and state["updates"]["method"] == self.update:
            self.updates.load_state_dict(state["updates"])
        for fqn, record in (state.get("promoted") or {}).items():  # a rewind's older state never undoes one
            if fqn not in self.promoted and self.narrow(fqn):
                self.promote(fqn, record["step"], record["evidence"])
                logger.warning("[PROMOTE] %s computes in %s, not %s, as the checkpoint's run decided at step %d: %s",
                               fqn, record["to"], record["from"], record["step"], record["evidence"])
