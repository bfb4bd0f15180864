"""AdamW with its two moments stored narrower than FP32: in bfloat16 beside FP32 master
weights (DeepSeek-V3: 4 bytes per parameter instead of 8), or in 8 bits (FP8 or the
block-wise dynamic code, mixprec.optim.state_formats: about 2 bytes per parameter).

Each parameter's moments are widened to FP32 (dequantized), updated with exactly
torch.optim.AdamW's arithmetic (single-tensor path: decoupled weight decay, lerp, bias
correction), and rounded back to nearest (re-quantized once). With moments in float32 the
widening is a no-op and the parameters match torch.optim.AdamW(foreach=False) bit for bit
(tests/optim/test_adamw.py). On a GPU, and on a CPU for quantized moments, the parameters step
together: one compiled graph for all of a group's parameters (FP32 in registers, each block
read once), one call a step rather than one a parameter. In 8 bits, tensors under the format's
min_size and (by default) embeddings keep FP32 moments; `compensated` steps low-precision
weights with a Kahan compensation (bf16-kahan's rule, mixprec.optim.updates) where the
moments are quantized.
"""

from __future__ import annotations

import logging

import torch

from mixprec.optim import fused_adamw
from mixprec.optim.saved_state import BLOCK, MOMENTS, in_formats
from mixprec.optim.state_formats import SCALE, StateFormat, code_on, dequantize, lookup_on, quantize, scale_shape
from mixprec.shards import local_shard, shaped_as

logger = logging.getLogger(__name__)

COMPENSATION = "kahan_compensation"  # as mixprec.optim.updates
# parameters of one shape one compiled call steps, by device type: on a GPU the step was its host work,
# ~140 us a call; on a CPU its arithmetic (the same time either way), and a graph of 8 parameters took
# 5x longer to compile than 8 calls of one (small flavor, 151 s against 31 s: Inductor's work grows with
# the graph, its kernels are not shared within it)
PER_KERNEL = {"cuda": 8, "cpu": 1}
COMPILE_MIN_NUMEL = 2**16  # CPU tensors smaller than this step eagerly by default (AdamW._compiles)
NOT_IMPLEMENTED = ("amsgrad", "capturable", "differentiable")  # torch.optim.AdamW's options refused here
FP32_MOMENTS = StateFormat("fp32")


class AdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's update with narrower moments. moments_dtype: dense moments
    (float32, bfloat16, float16); `states`, where given, a StateFormat (or its name) instead,
    8-bit ones included. `embeddings`: parameters the format treats as embeddings (FP32
    moments unless the format says otherwise). `compensated`: with quantized moments, every
    low-precision weight steps with a Kahan compensation (bf16-kahan-8bit). `convert`: a loaded state in
    another format is converted (else refused). `compile`: with quantized moments, each
    parameter's step is compiled (fused_adamw; None: but for small CPU tensors, and
    where it compiles, else eagerly, logged; False: the eager reference, torch.optim.AdamW's
    arithmetic to the bit). `per_kernel`: parameters of one shape one compiled multi-tensor call steps (None:
    PER_KERNEL's for the device; 1: one call a parameter; the same bits either way)."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, maximize: bool = False, moments_dtype: torch.dtype = torch.bfloat16,
                 states: StateFormat | str | None = None, embeddings=(), compensated: bool = False,
                 convert: bool = False, compile: bool | None = None, per_kernel: int | None = None):
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Invalid beta parameters: {betas}")
        if states is None and moments_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"moments_dtype {moments_dtype}: accepted float32, bfloat16, float16")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, maximize=maximize))
        self.states = StateFormat.of(states if states is not None else moments_dtype)
        if compensated and not self.states.quantized:
            raise ValueError("compensated updates with dense moments: mixprec.BF16Updates(optimizer, 'kahan') does "
                             "those; accepted here: fp8 or 8bit moments")
        self.moments_dtype = self.states.dtype  # a quantized format's codes
        self.compensated, self.convert, self.compile, self.per_kernel = compensated, convert, compile, per_kernel
        self._kernels, self._said_eager = {}, False
        self._embeddings = {id(p) for p in embeddings}
        self.kept_fp32 = {}  # id(parameter) -> why its moments stay FP32 in a quantized format
        for group in self.param_groups:
            self._keep_fp32(group)

    def _keep_fp32(self, group: dict) -> None:
        """The FP32-moment rules of a quantized format for a group's parameters (at construction, or when
        the group is added later: the same either way), and its devices' code tables, built and copied
        there now, at setup: not inside a step."""
        if not self.states.quantized:
            return
        for device in {local_shard(p).device for p in group["params"]}:
            for signed in (True, False):
                code_on(signed, device), lookup_on(signed, device)
        for p in group["params"]:
            last_sharded = any(getattr(pl, "dim", None) == p.dim() - 1 for pl in getattr(p, "placements", ()))
            why = ("sharded along its last dimension (the blocks')" if last_sharded else
                   self.states.keeps_fp32(p.numel(), id(p) in self._embeddings, p.dim()))
            if why:
                self.kept_fp32[id(p)] = why

    def add_param_group(self, param_group: dict) -> None:
        """torch's, refusing the options of torch.optim.AdamW this one does not implement (a group handed
        on from torch's AdamW carries them) rather than ignoring them, and a parameter listed twice (torch
        deprecates it; stepped twice, its result would depend on how the steps are batched)."""
        for option in NOT_IMPLEMENTED:
            if param_group.get(option):
                raise ValueError(f"mixprec.optim.AdamW: {option}=True is not implemented; accepted: {option}=False "
                                 f"(implemented: lr, betas, eps, weight_decay, maximize)")
        params = param_group["params"]
        if not isinstance(params, (torch.Tensor, set)):
            param_group["params"] = params = list(params)  # a generator read once, here
            if len({id(p) for p in params}) != len(params):
                raise ValueError("mixprec.optim.AdamW: a parameter group lists a tensor more than once; accepted: "
                                 "each parameter once")
        super().add_param_group(param_group)
        if hasattr(self, "states"):  # a group added after construction gets the rules of one given at it
            self._keep_fp32(self.param_groups[-1])

    def replaced(self, pairs) -> None:
        """Its records of parameters follow `pairs` of (old, new) parameter objects that another part put in
        its groups (MasterWeights swaps in FP32 masters): which keep FP32 moments, which are embeddings."""
        for old, new in pairs:
            if id(old) in self.kept_fp32:
                self.kept_fp32[id(new)] = self.kept_fp32.pop(id(old))
            if id(old) in self._embeddings:
                self._embeddings.discard(id(old))
                self._embeddings.add(id(new))

    def format_of(self, p: torch.Tensor) -> StateFormat:
        """The format parameter p's moments are kept in."""
        return FP32_MOMENTS if id(p) in self.kept_fp32 else self.states

    def _init_state(self, p: torch.Tensor, state: dict, device) -> None:
        fmt = self.format_of(p)
        state["step"] = torch.tensor(0.0, device=device)
        for key, signed in MOMENTS.items():
            if fmt.quantized:
                codes, scales = quantize(torch.zeros_like(local_shard(p), dtype=torch.float32), fmt.name, fmt.block_size,
                                         signed)
                state[key] = shaped_as(p, codes, p.shape)
                state[key + SCALE] = shaped_as(p, scales, scale_shape(p.shape, fmt.block_size))
                state[BLOCK] = fmt.block_size
            else:
                state[key] = torch.zeros_like(p, dtype=fmt.dtype)
        if self.compensated and p.dtype != torch.float32:
            state[COMPENSATION] = torch.zeros_like(p)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, keeping each saved state tensor's own dtype (torch.optim.Optimizer casts
        floating state to the parameter's dtype: a bfloat16 model's FP32 block scales would
        round). A parameter saved in another moment format is refused in one line, or
        converted (dequantized, then stored in this one) where `convert` is set."""
        params = [p for g in self.param_groups for p in g["params"]]
        saved = in_formats(params, state_dict["state"], self.format_of, self.convert)
        groups, dicts = self.param_groups, list(self.param_groups)
        super().load_state_dict({**state_dict, "state": saved})
        # torch's load puts new group dicts in place; a scheduler built on the optimizer this one replaced
        # (Policy.setup) holds the old ones: they take the loaded values and stay the groups
        for kept, loaded in zip(dicts, self.param_groups):
            kept.update(loaded)
        groups[:] = dicts
        self.param_groups = groups
        for index, entry in saved.items():
            p = params[index] if isinstance(index, int) and index < len(params) else None
            if p is None:
                continue
            state = self.state[p]
            for key, value in entry.items():
                if torch.is_tensor(value) and key != "step" and state[key].dtype != value.dtype:
                    state[key] = value.to(device=state[key].device)

    @torch.no_grad()
    def step(self, closure=None):
        """One step. With `self.found_inf` set (torch.amp.GradScaler's protocol, as torch's
        fused AdamW: a 0-dim float tensor on the parameters' device, 1 to skip), the step is
        taken or skipped on the device; `self.grad_scale`, when not None, unscales the
        gradients first."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = getattr(self, "found_inf", None)
        grad_scale = getattr(self, "grad_scale", None)
        inv_scale = grad_scale.double().reciprocal().float() if grad_scale is not None else None
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                state = self.state[p]
                if not state:
                    # on the CPU, as torch's: reading it costs no device sync (on the device
                    # where a skip is decided there: the count must see it)
                    device = p.device if found_inf is not None or self.states.quantized else "cpu"
                    self._init_state(p, state, device)
            grads = [p.grad if inv_scale is None else p.grad * inv_scale.to(p.grad.device) for p in params]
            if self.states.quantized:  # the skip decided on the device
                skip = found_inf if found_inf is not None else torch.zeros((), device=local_shard(params[0]).device) \
                    if params else None
                compiled = [self._compiles(p) for p in params]
                for p, grad, kernel in zip(params, grads, compiled):
                    if not kernel:
                        self._update_quantized(p, grad, self.state[p], group, skip)
                if any(compiled):
                    self._compiled_steps(group, *zip(*[(p, g) for p, g, k in zip(params, grads, compiled) if k]),
                                            skip)
            elif found_inf is None:
                for p, grad in zip(params, grads):
                    self._update(p, grad, self.state[p], group)
            elif params:
                self._steps_unless(group, params, grads, found_inf)
        return loss

    def _update(self, p, grad, state, group) -> None:
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        grad = -grad if group.get("maximize") else grad
        if state["step"].device.type != "cpu":  # stepped on the device before: keep reads off the device
            state["step"] = state["step"].cpu()
        state["step"] += 1
        step = state["step"].item()
        exp_avg, exp_avg_sq = state["exp_avg"].float(), state["exp_avg_sq"].float()
        p.mul_(1 - lr * wd)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1**step
        bias_correction2_sqrt = (1 - beta2**step) ** 0.5
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        p.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
        if self.moments_dtype != torch.float32:
            state["exp_avg"].copy_(exp_avg)  # rounds to nearest
            state["exp_avg_sq"].copy_(exp_avg_sq)

    def _steps_unless(self, group, params, grads, found_inf: torch.Tensor) -> None:
        """One step of `params` of `group` taken or skipped on the device (found_inf 1: nothing
        changes), the step counts and bias corrections there too. On a GPU the compiled kernels
        (fused_adamw.adamw_moments_: FP32 in registers, the moments read
        and written in their own dtype; all of them in one multi-tensor call); on a CPU _update_unless,
        the reference."""
        if params[0].device.type == "cpu":
            for p, grad in zip(params, grads):
                self._update_unless(p, grad, self.state[p], group, found_inf)
            return
        self._compiled_steps(group, params, grads, found_inf)

    def _update_unless(self, p, grad, state, group, found_inf: torch.Tensor) -> None:
        """_update's arithmetic with the step count and bias corrections on the device (the
        same float64 values: pow, true division), the results kept only where found_inf is 0.
        Bit-equal to _update on a CPU (tests/optim/test_adamw.py); costs one FP32 copy of
        the parameter and of each moment."""
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        grad = -grad if group.get("maximize") else grad
        skip = found_inf.to(p.device) != 0
        state["step"] = state["step"].to(p.device)
        state["step"] += 1 - skip.float()
        step_size, bias_correction2_sqrt = fused_adamw.bias_corrections(group, state["step"])
        exp_avg = state["exp_avg"].to(torch.float32, copy=True)
        exp_avg_sq = state["exp_avg_sq"].to(torch.float32, copy=True)
        w = p.mul(1 - lr * wd)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        w.add_(exp_avg * -step_size / denom)  # -(lr / bc1) == -lr / bc1 exactly: addcdiv's value
        p.copy_(torch.where(skip, p, w))
        state["exp_avg"].copy_(torch.where(skip, state["exp_avg"], exp_avg))  # rounds to nearest
        state["exp_avg_sq"].copy_(torch.where(skip, state["exp_avg_sq"], exp_avg_sq))

    def _compiles(self, p: torch.Tensor) -> bool:
        """Whether p steps by its compiled kernel: always where `compile` is true, never where false;
        by default everywhere but a CPU tensor under COMPILE_MIN_NUMEL elements, whose eager step
        costs less than compiling a kernel for its shape (seconds on a CPU), logged once."""
        if self.compile is not None:
            return self.compile
        small = p.device.type == "cpu" and local_shard(p).numel() < COMPILE_MIN_NUMEL
        if small and not self._said_eager:
            self._said_eager = True
            logger.info("optimizer: tensors under %d elements on the CPU step their quantized moments eagerly (the "
                        "same update: a kernel compiled per shape costs seconds, more than it saves them)",
                        COMPILE_MIN_NUMEL)
        return not small

    def _compiled_steps(self, group, params, grads, found_inf: torch.Tensor) -> None:
        """The parameters' steps as compiled multi-tensor kernels (fused_adamw's functions): one compiled
        graph for up to `per_kernel` parameters of one weight dtype, shape and kind:
        adamw_quantized_ where the moments are quantized, else adamw_moments_ (FP32 moments) or
        adamw_kahan_ (a compensated low-precision weight); the step counts and scalars on the device, no
        host read. Few calls, not one a parameter: the host's work (guards, wrappers, launches) was the
        step's cost on a GPU. A graph of every parameter took minutes to compile (PER_KERNEL); graphs of
        parameters alike are compiled once and called for each such group."""
        states = [self.state[p] for p in params]
        device = local_shard(params[0]).device
        skip = found_inf.to(device)
        tables = [f(signed, device) for f in (code_on, lookup_on) for signed in (True, False)]
        steps = fused_adamw.advanced_steps(states, [p.device for p in params], skip)
        step_sizes, roots, *rest = (local_shard(x) for x in fused_adamw.stacked_scalars(group, steps))
        # each parameter's two scalars a tensor of its own (views): indexed by a constant in the graph, each
        # kernel would be its own code, compiled apart from its identical neighbours
        own = list(zip(step_sizes.unbind(), roots.unbind()))
        calls: dict[torch.dtype, list] = {}  # weight dtype -> [((kind, static), tensors, the two scalars)]
        copies = []  # (tensor, the contiguous copy its kernel writes): copied back after
        for i, (p, grad, state) in enumerate(zip(params, grads, states)):
            held = [local_shard(p).detach(), local_shard(state[COMPENSATION]) if COMPENSATION in state else None,
                    local_shard(state["exp_avg"]), local_shard(state["exp_avg_sq"])]  # not a Parameter: compiled as static
            weight, c, m, v = work = [_as_rows(t) for t in held]
            copies += [(t, w) for t, w in zip(held, work) if w is not t]
            g, fmt, mine = local_shard(grad), self.format_of(p), calls.setdefault(weight.dtype, [])
            if fmt.quantized:
                scales = local_shard(state["exp_avg" + SCALE]), local_shard(state["exp_avg_sq" + SCALE])
                for cols, scale_cols, block in _row_parts(weight.shape[-1] if weight.dim() else 1, fmt.block_size):
                    cut = lambda t: t if t is None or t.dim() == 0 else t[..., cols]  # noqa: E731
                    mine.append((("quantized", (("fmt", fmt.name), ("block", block))),
                                 (cut(weight), cut(c), cut(g), cut(m), scales[0][..., scale_cols], cut(v),
                                  scales[1][..., scale_cols]), own[i]))
            elif c is not None:
                mine.append((("kahan", ()), (weight, c, g, m, v), own[i]))
            else:
                mine.append((("moments", ()), (weight, g, m, v), own[i]))
        for dtype, these in calls.items():
            alike: dict[tuple, list] = {}  # the parameters one kernel of static shapes serves: stepped together
            for call in these:
                shapes = tuple(None if t is None else tuple(t.shape) for t in call[1])
                alike.setdefault((call[0], shapes), []).append(call)
            for (kind, shapes), group_of in alike.items():
                size = self.per_kernel or PER_KERNEL.get(device.type, 1)
                for chunk in (group_of[k:k + size] for k in range(0, len(group_of), size)):
                    self._kernel(fused_adamw.stepper, dtype, (kind,) * len(chunk), shapes)(
                        [c[1] for c in chunk], [c[2] for c in chunk], tables, skip, *rest)
        for t, written in copies:
            t.copy_(written)

    def _kernel(self, fn, dtype: torch.dtype, structure: tuple, shapes: tuple):
        """fn(structure) compiled once per (structure, its tensors' shapes, weight dtype), with static
        shapes; where compiling fails (and `compile` is None), the same function eagerly, logged once."""
        key = (fn, dtype, structure, shapes)
        if key not in self._kernels:
            step = fn(structure, len(self._kernels))
            self._kernels[key] = fused_adamw.Compiled(step, fn.__name__, dtype, self.compile)
        return self._kernels[key]

    def _update_quantized(self, p, grad, state, group, found_inf: torch.Tensor) -> None:
        """_update_unless's arithmetic on the moments dequantized to FP32 (a parameter whose
        moments stay FP32 reads them as they are), re-quantized once after the update, for
        p's local shard (a DTensor's blocks are its own rows). A low-precision weight takes
        the FP32 result rounded to nearest, or, compensated, Kahan's rule."""
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        grad = -grad if group.get("maximize") else grad
        fmt = self.format_of(p)
        skip = found_inf.to(p.device) != 0
        state["step"] = state["step"].to(p.device)
        state["step"] += 1 - skip.float()
        step_size, bias_correction2_sqrt = fused_adamw.bias_corrections(group, state["step"])
        step_size, bias_correction2_sqrt = local_shard(step_size), local_shard(bias_correction2_sqrt)
        skip, weight, grad = local_shard(skip), local_shard(p), local_shard(grad).float()
        compensation = local_shard(state[COMPENSATION]) if COMPENSATION in state else None
        moments = {}
        for key, signed in MOMENTS.items():
            stored = local_shard(state[key])
            moments[key] = (dequantize(stored, local_shard(state[key + SCALE]), fmt.block_size, signed) if fmt.quantized
                            else stored.to(torch.float32, copy=True))
        exp_avg, exp_avg_sq = moments["exp_avg"], moments["exp_avg_sq"]
        w = weight.float() if compensation is None else weight.float() + compensation.float()
        w = w.mul(1 - lr * wd)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        w.add_(exp_avg * -step_size / denom)
        rounded = w.to(weight.dtype)  # to nearest; FP32 weights: w itself
        if compensation is not None:
            compensation.copy_(torch.where(skip, compensation, (w - rounded.float()).to(compensation.dtype)))
        weight.copy_(torch.where(skip, weight, rounded))
        for key, signed in MOMENTS.items():
            stored = local_shard(state[key])
            if not fmt.quantized:
                stored.copy_(torch.where(skip, stored, moments[key]))
                continue
            codes, scales = quantize(moments[key], fmt.name, fmt.block_size, signed)
            old_scales = local_shard(state[key + SCALE])
            bits = stored.view(torch.uint8)
            bits.copy_(torch.where(skip, bits, codes.view(torch.uint8)))
            old_scales.copy_(torch.where(skip, old_scales, scales))

    _step_supports_amp_scaling = True  # takes found_inf and grad_scale, as torch's fused AdamW


def _as_rows(t: torch.Tensor | None) -> torch.Tensor | None:
    """`t` where its leading dimensions view as rows (the kernels write through such views), else a
    contiguous copy for the caller to copy back: a permuted 3-D weight or a channels_last conv weight
    reshaped to rows is a copy, and an update written there would be lost."""
    if t is None or t.dim() < 3:  # 2-D: rows of any strides are a view already
        return t
    try:
        t.view(-1, t.shape[-1])
        return t
    except RuntimeError:
        return t.contiguous()


def _row_parts(n: int, block: int) -> list[tuple[slice, slice, int]]:
    """A row of n elements as (its columns, their scales' columns, block size): the whole blocks,
    then the short last one as a block of its own size (each a kernel with static blocks)."""
    whole = n - n % block
    parts = [(slice(0, whole), slice(0, whole // block), block)] if whole else []
    if n % block:
        parts.append((slice(whole, n), slice(whole // block, whole // block + 1), n - whole))
    return parts
