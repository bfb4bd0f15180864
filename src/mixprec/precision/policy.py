"""The precision policy: the user's words parsed once into one object whose hooks
the training loop calls. Nothing else in mixprec branches on a precision name.

    policy = Policy.from_preset("bf16-mixed")
    model, optimizer = policy.setup(model, optimizer)
    with policy.autocast():
        loss = model(x, y)
    policy.backward(loss)
    applied = policy.step(optimizer, max_norm=1.0)
"""

from __future__ import annotations

import contextlib
import logging
import math

import torch

from mixprec.errors import UserError
from mixprec.fp8.convert import DEFAULT_EXCLUDE, convert_to_fp8
from mixprec.fp8.recipe import FP8Recipe
from mixprec.optim.updates import METHODS as UPDATE_METHODS
from mixprec.optim.updates import BF16Updates
from mixprec.precision.describe import describe, warn_known_bad
from mixprec.precision.dtypes import dtype_name, parse_dtype
from mixprec.precision.emulation import EmulatedMatmul
from mixprec.precision.grad_norm import grad_norm
from mixprec.precision.loss_scaler import LossScaleConfig, LossScaler
from mixprec.precision.master import MasterWeights, cast_parameters, is_norm
from mixprec.precision.monitor import ScaleMonitor
from mixprec.precision.presets import BF16, FP16, FP32, FP8_BASES, PRESETS, resolve_preset_name
from mixprec.precision.tf32 import set_tf32, tf32_active

logger = logging.getLogger(__name__)

def has_fast_matmul(device_type: str, dtype: torch.dtype) -> bool:
    """Whether `dtype` matmuls have a native fast kernel on this device. A CPU without
    AVX512-BF16 or AMX emulates BF16 (measured on an AVX2 CPU: 16 GFLOP/s vs 140 in
    FP32); FP16 needs AMX-FP16."""
    if dtype == FP32:
        return True
    if device_type == "cuda":
        return torch.cuda.is_available() and (dtype == FP16 or torch.cuda.is_bf16_supported())
    if device_type == "cpu":
        if dtype == BF16:
            return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
        return torch.cpu._is_amx_fp16_supported()
    return True


class Policy:
    """Where each tensor lives, in which dtype, and the hooks that keep it there.

    storage_dtype: the model's parameters (and, without master weights, gradients and
        optimizer states).
    param_dtype: compute; torch.autocast does the cast where it differs from storage.
    reduce_dtype: gradient reduction across data-parallel ranks.
    master_weights: FP32 copies of the parameters live with the optimizer; norm layers
        stay FP32 in the model (Apex O2).
    loss_scale: dynamic loss scaling and fallback settings; None disables scaling.
    emulate_matmul: run BF16/FP16 matmuls as FP32 GEMMs on the rounded operands
        (mixprec.precision.emulation); None decides at setup: on without a native kernel.
    tf32: FP32 matmuls on CUDA run as TF32 (set process-wide at setup). Off, the policy
        leaves torch's setting alone and warns when something else turned TF32 on.
    fp8: an FP8 recipe (mixprec.fp8) for the Linear layers that `fp8_exclude` and the
        default filter leave (not the output layer); everything else computes as above.
    update: how a low-precision model without master weights takes its updates
        (mixprec.optim.updates): "kahan" (a compensation buffer per parameter) or
        "stochastic" (stochastic rounding to bfloat16, keyed by `update_seed`); None: rounded
        to nearest.
    """

    def __init__(self, param_dtype=FP32, reduce_dtype=FP32, storage_dtype=FP32, *, master_weights: bool = False,
                 loss_scale: LossScaleConfig | None = None, emulate_matmul: bool | None = None, tf32: bool = False,
                 fp8: FP8Recipe | None = None, fp8_exclude: tuple[str, ...] = DEFAULT_EXCLUDE,
                 fp8_emulate: bool | None = None, update: str | None = None, update_seed: int = 0):
        self.param_dtype = parse_dtype(param_dtype, "param_dtype")
        self.reduce_dtype = parse_dtype(reduce_dtype, "reduce_dtype")
        self.storage_dtype = parse_dtype(storage_dtype, "storage_dtype")
        if self.storage_dtype != FP32 and self.param_dtype != self.storage_dtype:
            raise UserError(
                f"param_dtype {dtype_name(self.param_dtype)} with storage_dtype {dtype_name(self.storage_dtype)}: "
                f"a {dtype_name(self.storage_dtype)} model computes in {dtype_name(self.storage_dtype)}; "
                "accepted: param_dtype equal to storage_dtype, or storage_dtype float32"
            )
        if master_weights and self.storage_dtype == FP32:
            raise UserError("master_weights with storage_dtype float32: the parameters are already float32; "
                            "accepted: storage_dtype float16 or bfloat16")
        self.master_weights = master_weights
        if update is not None:
            if update not in UPDATE_METHODS:
                raise UserError(f"update {update!r}: accepted {', '.join(UPDATE_METHODS)}")
            wanted = BF16 if update == "stochastic" else None
            if self.storage_dtype == FP32 or master_weights or (wanted and self.storage_dtype != wanted):
                raise UserError(f"{update} updates need a {dtype_name(wanted) if wanted else 'low-precision'} model "
                                f"without master weights (storage_dtype {dtype_name(self.storage_dtype)}"
                                f"{', master_weights' if master_weights else ''}); accepted: bf16-kahan, bf16-sr")
        self.update, self.update_seed, self._updates = update, update_seed, None
        self.loss_scale = loss_scale
        self.tf32 = tf32
        self.fp8, self.fp8_exclude, self.fp8_emulate, self._fp8 = fp8, tuple(fp8_exclude), fp8_emulate, None
        self.fallback_to: str | None = None  # chosen at setup from loss_scale.fallback_to
        self._emulate_requested = self.emulate_matmul = emulate_matmul
        self.requested = self.name = self._match_preset()
        if fp8 is not None and (loss_scale is not None or self.param_dtype == FP16):
            # a float16 mode may fall back to another precision mid-run; the FP8 layers' output dtype is fixed
            raise UserError(f"fp8 recipe {fp8.name!r} on {self.name.split('+')[0]}: FP8 recipes build on "
                            f"{', '.join(FP8_BASES)}")
        self.device_type: str | None = None
        self._model = self._optimizer = self._master = self._scaler = None
        self._steps = self._skipped = self._nonfinite = 0
        self._last_grad_norm: float | None = None
        self._last_overflow = self._last_clipped = False
        self._monitor = ScaleMonitor()
        self._fallback_step: int | None = None
        self.sharded = False  # set by fsdp_mixed_precision(): fully_shard does the casts
        warn_known_bad(self)

    @classmethod
    def from_preset(cls, name: str, *, labels: dict[str, str] | None = None, emulate_matmul: bool | None = None,
                    loss_scale: LossScaleConfig | None = None, tf32: bool = False, fp8_recipe: str = "",
                    fp8_options: dict | None = None, fp8_exclude: tuple[str, ...] = DEFAULT_EXCLUDE,
                    fp8_emulate: bool | None = None, update_seed: int = 0, **overrides) -> "Policy":
        """A preset by name or alias. `overrides` may change the fields a preset only
        defaults (reduce_dtype); one that contradicts the preset's own fields is an error
        naming both. `labels` names each override as the user wrote it (for messages).
        `fp8_recipe` adds an FP8 recipe to a preset without one; `fp8_options` are the
        recipe's tunable fields (amax_history_len, ...). `update_seed` keys bf16-sr's rounding."""
        labels = labels or {}
        preset_name = resolve_preset_name(name, labels.get("preset", "preset"))
        preset = PRESETS[preset_name]
        fields = {"storage_dtype": preset.storage_dtype, "param_dtype": preset.param_dtype, "reduce_dtype": FP32}
        for key, value in overrides.items():
            if key not in fields:
                raise TypeError(f"Policy.from_preset got an unexpected field {key!r}")
            label = labels.get(key, key)
            dtype = parse_dtype(value, label)
            if key != "reduce_dtype" and dtype != fields[key]:
                raise UserError(
                    f"{labels.get('preset', 'preset')} = {name!r} contradicts {label} = {dtype_name(dtype)!r}: "
                    f"{preset_name} has {key} {dtype_name(fields[key])}; drop one of the two"
                )
            fields[key] = dtype
        scaling = (loss_scale or LossScaleConfig()) if preset.loss_scaling else None
        if preset.fp8 and fp8_recipe and fp8_recipe != preset.fp8:
            raise UserError(f"{labels.get('preset', 'preset')} = {name!r} contradicts fp8.recipe = {fp8_recipe!r}: "
                            f"{preset_name} has the {preset.fp8} recipe; drop one of the two")
        recipe_name = preset.fp8 or fp8_recipe
        recipe = FP8Recipe.from_name(recipe_name).with_options(**(fp8_options or {})) if recipe_name else None
        return cls(**fields, master_weights=preset.master_weights, loss_scale=scaling, emulate_matmul=emulate_matmul,
                   tf32=tf32, fp8=recipe, fp8_exclude=fp8_exclude, fp8_emulate=fp8_emulate,
                   update=preset.update or None, update_seed=update_seed)

    def _match_preset(self) -> str:
        key = (self.storage_dtype, self.param_dtype, self.master_weights, self.loss_scale is not None, self.update or "")
        base = next((name for name, p in PRESETS.items() if not p.fp8
                     and (p.storage_dtype, p.param_dtype, p.master_weights, p.loss_scaling, p.update) == key), "custom")
        if self.fp8 is None:
            return base
        fp8_name = f"fp8-{self.fp8.name}"
        return fp8_name if base == "bf16-mixed" and fp8_name in PRESETS else f"{base}+{fp8_name}"

    # ---- what the policy promises -------------------------------------------------
    @property
    def uses_autocast(self) -> bool:
        # A master-weights model mixes FP32 norms with low-precision weights: autocast
        # casts the FP32 activations for the matmuls. Under FSDP, fully_shard casts.
        return not self.sharded and (self.param_dtype != self.storage_dtype or self.master_weights)

    def fsdp_mixed_precision(self):
        """FSDP2's MixedPrecisionPolicy for this policy. From then on the policy leaves the
        casts to fully_shard and never autocasts on top of them (that would cast twice)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        self.sharded = True
        if self.master_weights:
            # The sharded FP32 parameters are the master weights: the optimizer steps them,
            # fully_shard all-gathers them in param_dtype. No second copy is needed, and
            # fp16-master computes exactly what fp16-mixed computes under FSDP.
            self.storage_dtype = FP32
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

    @property
    def optimizer_moments_dtype(self) -> torch.dtype:
        """The dtype the mode keeps AdamW's moments in beside FP32 weights (bfloat16 under
        fp8-blockwise, as DeepSeek-V3; mixprec.optim.AdamW keeps them so)."""
        return self.fp8.moments_dtype if self.fp8 is not None and self.storage_dtype == FP32 else FP32

    def describe(self) -> dict[str, str]:
        """Which dtype each kind of tensor is kept in under this policy."""
        return describe(self)

    def __repr__(self) -> str:
        return (f"Policy({self.name}: storage_dtype={dtype_name(self.storage_dtype)}, "
                f"param_dtype={dtype_name(self.param_dtype)}, reduce_dtype={dtype_name(self.reduce_dtype)}"
                f"{', master_weights' if self.master_weights else ''}"
                f"{', loss scaling' if self.loss_scale is not None else ''}"
                f"{f', {self.update} updates' if self.update else ''}"
                f"{f', fp8 {self.fp8.name}' if self.fp8 is not None else ''})")

    # ---- hooks ----------------------------------------------------------------------
    def prepare_model(self, model: torch.nn.Module) -> None:
        """The model rewrites the mode needs before anything wraps the model (compile,
        fully_shard): the FP8 conversion. Runs once; setup calls it when nobody did."""
        if self.fp8 is not None and self._fp8 is None:
            self._fp8 = convert_to_fp8(model, self.fp8, compute_dtype=self.param_dtype, exclude=self.fp8_exclude,
                                       emulate=self.fp8_emulate)

    @property
    def fp8_conversion(self):
        """The mixprec.fp8.Conversion made at setup (layers, reasons, GEMM routes), or None."""
        return self._fp8

    def setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None):
        """Cast the parameters in place (the same Parameter objects, so an optimizer built
        before keeps working; buffers are left alone), swap in FP32 master weights where
        the mode has them, and log which path handles mixed precision."""
        if optimizer is not None and optimizer.state:
            raise ValueError("Policy.setup needs an optimizer that has not stepped yet")
        if (self.master_weights or self.update) and optimizer is None:
            raise ValueError(f"{self.name} changes how the optimizer updates the weights: pass it to Policy.setup")
        first = next(model.parameters(), None)
        self.device_type = first.device.type if first is not None else "cpu"
        self._model, self._optimizer = model, optimizer
        self.prepare_model(model)
        moments = self.optimizer_moments_dtype
        if moments != FP32 and optimizer is not None and getattr(optimizer, "moments_dtype", FP32) != moments:
            logger.warning("%s keeps AdamW moments in %s (DeepSeek-V3's memory layout); this %s keeps its own: "
                           "mixprec.optim.AdamW(..., moments_dtype=torch.%s) does it", self.name, dtype_name(moments),
                           type(optimizer).__name__, dtype_name(moments))
        cast_parameters(model, self.storage_dtype, keep_fp32=is_norm if self.master_weights else None)
        if self.master_weights and not self.sharded:
            self._master = MasterWeights(model, optimizer)
        if self.update:
            self._updates = BF16Updates(optimizer, self.update, seed=self.update_seed)  # logs its path
        tiny_eps = [g["eps"] for g in (optimizer.param_groups if optimizer is not None else []) if "eps" in g
                    and torch.tensor(g["eps"], dtype=FP16).item() == 0]
        if self.storage_dtype == FP16 and not self.master_weights and tiny_eps:
            # Adam divides by sqrt(v) + eps: a parameter whose gradient is exactly 0 (an
            # embedding row no token used) gets 0 / 0 = NaN in its first float16 update.
            logger.warning("%s: optimizer eps %g is 0 in float16, so a zero gradient gives a NaN update; "
                           "use eps >= 6e-8 (1e-4 is usual for float16 states)", self.name, tiny_eps[0])
        if self.loss_scale is not None:
            self._scaler = LossScaler(first.device if first is not None else "cpu", config=self.loss_scale)
            self.fallback_to = self.loss_scale.fallback_to
            if self.fallback_to == "auto":
                self.fallback_to = "bf16-mixed" if has_fast_matmul(self.device_type, BF16) else "fp32"
            if self.sharded:
                # fully_shard fixes its MixedPrecisionPolicy when it wraps the model: a switch
                # of precision mid-run would leave it all-gathering the old dtype.
                logger.warning("precision: no automatic fallback under fully_shard: overflowing steps are skipped "
                               "and the loss scale halves down to %g; to change precision, resume the last "
                               "checkpoint with another precision.preset", self.loss_scale.min_scale)
                self.fallback_to = None
        if self.sharded:
            logger.info("Mixed precision training is handled by fully_shard: %s parameters sharded in %s%s, "
                        "all-gathered in %s, gradients reduced in %s", self.name, dtype_name(self.storage_dtype),
                        " (they are the master weights)" if self.master_weights else "",
                        dtype_name(self.param_dtype), dtype_name(self.reduce_dtype))
        elif self.uses_autocast:
            logger.info("Mixed precision training is handled by AMP: torch.autocast(%s, %s) over %s parameters%s",
                        self.device_type, dtype_name(self.param_dtype), dtype_name(self.storage_dtype),
                        " with float32 master weights" if self.master_weights else "")
        else:
            logger.info("Mixed precision training is disabled: %s (%s)", self.name, PRESETS[self.name].summary
                        if self.name in PRESETS else "custom")
        if self._scaler is not None:
            logger.info("[MIXED PRECISION] training with %s, loss scale %g", self.name, self._scaler.get_scale())
        set_tf32(self.device_type, self.tf32)
        self._choose_emulation()
        return model, optimizer

    def will_emulate(self, device_type: str) -> bool:
        """Whether setup on `device_type` emulates this policy's matmuls."""
        if self.param_dtype == FP32:
            return False
        if self._emulate_requested is None:
            return not has_fast_matmul(device_type, self.param_dtype)
        return self._emulate_requested

    def _choose_emulation(self) -> None:
        self.emulate_matmul = self.will_emulate(self.device_type)
        if self.param_dtype == FP32:
            return
        native = has_fast_matmul(self.device_type, self.param_dtype)
        if self._emulate_requested is None:
            if self.emulate_matmul:
                logger.info(
                    "%s matmuls are emulated: float32 GEMMs on %s operands, %s results (the same numbers up to "
                    "summation order), because this %s has no native %s GEMM; precision.emulate_matmul = false "
                    "uses the native kernel", *[dtype_name(self.param_dtype)] * 3, self.device_type,
                    dtype_name(self.param_dtype))
        elif not self.emulate_matmul and not native:
            logger.warning("%s matmuls on this %s have no native kernel and are not emulated: expect them "
                           "5-100x slower than float32", dtype_name(self.param_dtype), self.device_type)

    def autocast(self, device_type: str | None = None):
        """Context for the forward pass and the loss."""
        stack = contextlib.ExitStack()
        if self.uses_autocast:
            device_type = device_type or self.device_type or ("cuda" if torch.cuda.is_available() else "cpu")
            stack.enter_context(torch.autocast(device_type, dtype=self.param_dtype))
        stack.enter_context(self._emulation())
        return stack

    def _emulation(self):
        if self.emulate_matmul:
            return EmulatedMatmul()
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        with self._emulation():
            (self._scaler.scale(loss) if self._scaler is not None else loss).backward()

    def step(self, optimizer: torch.optim.Optimizer, max_norm: float | None = None) -> bool:
        """Unscale, clip to `max_norm` (when given) on the true gradients, step unless a
        gradient overflowed, update the loss scale, clear the gradients. A skipped step
        changes no parameter, optimizer state or step count. Returns whether it was applied."""
        self._optimizer = optimizer
        if self._master is not None:
            self._master.grads_to_master()
        overflow = False
        if self._scaler is not None:
            self._scaler.unscale_(optimizer)
            overflow = self._scaler.found_inf
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        norm, groups = grad_norm(params)
        # the one host sync of a step; the norm is the same on every rank, so is the choice
        self._last_grad_norm = norm.float().item()
        # Without a loss scaler nothing else guards the weights: an inf or NaN anywhere in
        # the gradients makes the global norm non-finite, and that step is skipped too.
        nonfinite = not overflow and not math.isfinite(self._last_grad_norm)
        self._last_clipped = bool(max_norm) and not (overflow or nonfinite) and self._last_grad_norm > max_norm
        if not (overflow or nonfinite):
            if max_norm:
                for group in groups:
                    torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
            if self._updates is not None:
                self._updates.step()  # in chunks: FP32 working copies of part of the model at a time
            else:
                optimizer.step()
            if self._master is not None:
                self._master.master_to_model()
        optimizer.zero_grad(set_to_none=True)
        if self._fp8 is not None:
            self._fp8.after_step()
        self._steps += 1
        self._last_overflow = overflow
        self._skipped += overflow or nonfinite
        if nonfinite:
            self._nonfinite += 1
            if self._nonfinite <= 10 or self._nonfinite % 100 == 0:
                logger.warning("[NONFINITE] step %d: gradient norm %s: step skipped (weights, optimizer state and "
                               "learning-rate schedule untouched; %d such steps so far)", self._steps,
                               self._last_grad_norm, self._nonfinite)
        if self._scaler is not None:
            before = self._scaler.get_scale()
            self._scaler.update()
            after = self._scaler.get_scale()
            self._monitor.record(self._steps, overflow, before, after, self.loss_scale.growth_interval)
            at_minimum = overflow and before <= self.loss_scale.min_scale
            after_n = self.loss_scale.fallback_after
            if self.fallback_to and (at_minimum or (after_n and self._monitor.consecutive >= after_n)):
                reason = (f"at the minimum loss scale {before:g}" if at_minimum
                          else f"after {self._monitor.consecutive} consecutive overflows")
                self._fall_back(reason)
        return not (overflow or nonfinite)

    @property
    def last_overflow(self) -> bool:
        """The loss scaler skipped the last step for an overflow (its business, not an incident)."""
        return self._last_overflow

    @property
    def last_clipped(self) -> bool:
        """Clipping scaled the last step's gradients down (its norm was above max_norm)."""
        return self._last_clipped

    @property
    def last_grad_norm(self) -> float | None:
        """The last step's global gradient norm (already on the host)."""
        return self._last_grad_norm

    def back_off_loss_scale(self) -> tuple[float, float] | None:
        """Multiply the loss scale by loss_scale.backoff_factor (after a rewind); (before, after),
        or None without a scaler."""
        if self._scaler is None:
            return None
        before = self._scaler.get_scale()
        self._scaler.update(max(self.loss_scale.min_scale, before * self.loss_scale.backoff_factor))
        return before, self._scaler.get_scale()

    def _fall_back(self, reason: str | None) -> None:
        """Switch to `fallback_to`, keeping the FP32 weights and optimizer state."""
        old, target = self.name, PRESETS[self.fallback_to]
        if self._master is not None:
            self._master.release()
            self._master = None
        cast_parameters(self._model, FP32)
        optimizer_states = self._optimizer.state.values() if self._optimizer is not None else []
        for state in optimizer_states:  # FP16 states of a model without masters
            for key, t in state.items():
                if torch.is_tensor(t) and t.is_floating_point() and key != "step":
                    state[key] = t.float()
        self.storage_dtype, self.param_dtype = target.storage_dtype, target.param_dtype
        self.master_weights, self._scaler, self.loss_scale = False, None, None
        self.name, self._fallback_step = self.fallback_to, self._steps
        if reason is not None:
            logger.warning("[FALLBACK] step %d: %s -> %s %s", self._steps, old, self.name, reason)
        self._choose_emulation()

    # ---- monitoring and checkpointing -----------------------------------------------
    def stats(self) -> dict:
        return {
            "precision": self.requested,
            "precision_final": self.name,
            "param_dtype": dtype_name(self.param_dtype),
            "matmul_dtype": self.matmul_dtype,
            "storage_dtype": dtype_name(self.storage_dtype),
            "reduce_dtype": dtype_name(self.reduce_dtype),
            "autocast": self.uses_autocast,
            "master_weights": self.master_weights,
            "update": self.update,
            "steps": self._steps,
            "skipped_steps": self._skipped,
            "nonfinite_steps": self._nonfinite,
            "grad_norm": self._last_grad_norm,
            "loss_scale": self._scaler.get_scale() if self._scaler is not None else None,
            "overflow_count": self._monitor.overflows,
            "overflow_rate": self._monitor.overflows / self._steps if self._steps else 0.0,
            "fallback_triggered": self._fallback_step is not None,
            "fallback_step": self._fallback_step,
            "fp8_recipe": self.fp8.name if self.fp8 is not None else None,
            "fp8_layers": len(self._fp8.modules) if self._fp8 is not None else 0,
        }

    def model_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The model's weights at full precision: master copies where the mode has them."""
        state = model.state_dict()
        if self._master is not None:
            state.update({name: m.detach() for name, m in self._master.named_masters(model).items()})
        return state

    def load_model_state_dict(self, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
        model.load_state_dict(state)  # rounds into the model's dtypes
        if self._master is not None:
            with torch.no_grad():
                for name, m in self._master.named_masters(model).items():
                    m.copy_(state[name])

    def state_dict(self) -> dict:
        return {
            "precision": self.requested, "precision_final": self.name, "steps": self._steps,
            "skipped": self._skipped, "nonfinite": self._nonfinite, "fallback_step": self._fallback_step,
            "monitor": self._monitor.state_dict(),
            "scaler": self._scaler.state_dict() if self._scaler is not None else None,
            "fp8": self._fp8.state_dict() if self._fp8 is not None else None,
            "updates": self._updates.state_dict() if self._updates is not None else None,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore counters and the loss scale; re-apply a fallback the saved run took.
        Call after setup and before loading the model's and optimizer's state."""
        if state.get("precision") != self.requested:
            logger.warning("precision: resuming a %s checkpoint under %s", state.get("precision"), self.requested)
        elif state.get("fallback_step") is not None and self._fallback_step is None:
            self.fallback_to = state["precision_final"]
            self._fall_back(None)
            logger.info("precision: the checkpoint had fallen back to %s at step %d; resuming in %s",
                        state["precision_final"], state["fallback_step"], self.name)
            self._fallback_step = state["fallback_step"]
        self._steps, self._skipped = int(state["steps"]), int(state["skipped"])
        self._nonfinite = int(state.get("nonfinite", 0))
        self._monitor.load_state_dict(state.get("monitor", {}))
        if self._scaler is not None and state.get("scaler"):
            self._scaler.load_state_dict(state["scaler"])
        if self._fp8 is not None and state.get("fp8"):
            self._fp8.load_state_dict(state["fp8"])
        if self._updates is not None and state.get("updates") and state["updates"]["method"] == self.update:
            self._updates.load_state_dict(state["updates"])
