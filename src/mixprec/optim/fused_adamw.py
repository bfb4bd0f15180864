"""torch.optim.AdamW's update for one bfloat16 parameter as one kernel: FP32 arithmetic in
registers, bfloat16 in memory, and the result Kahan-compensated or stochastically rounded.

The generic path of mixprec.optim.updates widens the weight, gradient and moments to FP32
copies, runs the optimizer's own kernel and narrows them back: about 80 more bytes moved
per parameter than bf16-true's step, which on a memory-bound CPU costs 7% of a small-
flavor step. For torch.optim.AdamW these functions compute the same arithmetic (the
single-tensor path: decoupled weight decay, lerp, bias correction; FMA and order may
differ in the last bit) reading 10 bytes and writing 8 per parameter, compiled into one
kernel per parameter. adamw_quantized_ does the same for moments held in 8 bits
(mixprec.optim.state_formats): dequantized, updated and re-quantized inside the kernel.
`stepper` and `Compiled`: many parameters' kernels as one compiled call (mixprec.optim.AdamW).
"""

from __future__ import annotations

import logging

import torch

from mixprec.rounding import compile_options, compiled_nearest_unsafe, round_trip, stochastic_round_bf16

logger = logging.getLogger(__name__)


def _adamw(w, g, m, v, step_size, bias_correction2_sqrt, lr, beta1, beta2, eps, weight_decay, sign):
    """The new FP32 weight and moments from FP32 `w` and low-precision g, m, v."""
    grad = g.float() * sign
    w = w * (1 - lr * weight_decay)
    m32 = torch.lerp(m.float(), grad, 1 - beta1)
    v32 = v.float() * beta2 + (1 - beta2) * grad * grad
    denom = v32.sqrt() / bias_correction2_sqrt + eps
    return w - step_size * m32 / denom, m32, v32


def adamw_kahan_(p, c, g, m, v, skip, *scalars) -> None:
    """One AdamW step of weight p + compensation c, in place on p, c, m, v, unless `skip`
    (a 0-dim tensor on p's device) is nonzero: then all four keep their values. `scalars`:
    step_size (lr / bias correction 1), bias correction 2's root, lr, beta1, beta2, eps,
    weight decay, gradient sign."""
    w, m32, v32 = _adamw(p.float() + c.float(), g, m, v, *scalars)
    rounded = round_trip(w, p.dtype)  # compiled with rounding.compile_options(p.dtype)
    keep = skip != 0
    p.copy_(torch.where(keep, p.float(), rounded))  # exact: rounded is a value of p's dtype
    c.copy_(torch.where(keep, c.float(), w - rounded))  # exact in FP32: what the rounding dropped
    m.copy_(torch.where(keep, m.float(), m32))
    v.copy_(torch.where(keep, v.float(), v32))


def adamw_stochastic_(p, g, m, v, key, skip, *scalars) -> None:
    """One AdamW step of bfloat16 p, the weight stochastically rounded (keyed by `key`),
    unless `skip` is nonzero."""
    w, m32, v32 = _adamw(p.float(), g, m, v, *scalars)
    keep = skip != 0
    p.copy_(torch.where(keep, p, stochastic_round_bf16(w, key)))
    m.copy_(torch.where(keep, m.float(), m32))
    v.copy_(torch.where(keep, v.float(), v32))


def adamw_moments_(p, g, m, v, skip, *scalars) -> None:
    """One AdamW step of an FP32 parameter p whose moments m, v are stored narrower
    (bfloat16: DeepSeek-V3's), in place, unless `skip` is nonzero: FP32 in registers, the
    moments rounded to nearest on their way back to memory. `scalars` as adamw_kahan_'s."""
    w, m32, v32 = _adamw(p, g, m, v, *scalars)
    keep = skip != 0
    p.copy_(torch.where(keep, p, w))
    m.copy_(torch.where(keep, m.float(), m32))
    v.copy_(torch.where(keep, v.float(), v32))


def adamw_quantized_(p, c, g, m, m_scales, v, v_scales, m_code, v_code, m_table, v_table, skip, *scalars, fmt: str,
                     block: int) -> None:
    """One AdamW step of weight p (+ Kahan compensation c where not None) whose moments are
    block-quantized (mixprec.optim.state_formats: codes m, v and their FP32 block scales; the
    dynamic code's values and lookup tables, unused for fp8), in place, unless `skip` is
    nonzero: dequantized to FP32, the update in registers, re-quantized once. Every row holds
    whole blocks (a caller passes a row's short last block apart, as its own block size); every
    tensor is read and written as a (rows, blocks, block) view, so a compiled loop's inner
    dimension is a block (a view back to p's shape before the writes made Inductor recompute the
    update in a second, scalar loop)."""
    from mixprec.optim import state_formats as sf

    blocked = lambda t: t.reshape(-1, t.shape[-1] if t.dim() else 1).unflatten(-1, (-1, block))
    p3, g3, m3, v3 = (blocked(t) for t in (p, g, m, v))
    c3 = blocked(c) if c is not None else None
    ms3, vs3 = m_scales.reshape(*m3.shape[:2], 1), v_scales.reshape(*v3.shape[:2], 1)
    weight = p3.float() if c3 is None else p3.float() + c3.float()
    m32, v32 = sf.dequantize_blocks(m3, ms3, m_code), sf.dequantize_blocks(v3, vs3, v_code)
    w, m32, v32 = _adamw(weight, g3, m32, v32, *scalars)
    new = [sf.quantize_blocks(m32, fmt, True, m_table), sf.quantize_blocks(v32, fmt, False, v_table)]
    _store(p3, c3, m3, ms3, v3, vs3, w, new, skip)


def _store(p, c, m, m_scales, v, v_scales, w, new, skip) -> None:
    """The new weight (rounded to p's dtype, the rest into c) and moments, where skip is 0."""
    keep = skip != 0
    if p.dtype != torch.float32:
        rounded = round_trip(w, p.dtype)  # compiled with rounding.compile_options(p.dtype)
        if c is not None:
            c.copy_(torch.where(keep, c.float(), w - rounded))  # exact in FP32: what the rounding dropped
        w = rounded
    p.copy_(torch.where(keep, p.float(), w))
    for codes, scales, (new_codes, new_scales) in ((m, m_scales, new[0]), (v, v_scales, new[1])):
        # no bit view (Inductor's C++ kernels run those scalar) and no FP8 where (no type promotion for FP8):
        # FP8 codes chosen in FP32, which holds them exactly, and stored
        wide = torch.float32 if codes.dtype != torch.uint8 else codes.dtype
        codes.copy_(torch.where(keep, codes.to(wide), new_codes.to(wide)))
        scales.copy_(torch.where(keep, scales, new_scales))


def unsupported(optimizer: torch.optim.Optimizer) -> str | None:
    """Why these kernels cannot stand in for `optimizer`'s step, or None when they can."""
    if type(optimizer) is not torch.optim.AdamW:
        return f"{type(optimizer).__name__} is not torch.optim.AdamW"
    for group in optimizer.param_groups:
        for option in ("amsgrad", "differentiable", "capturable"):
            if group.get(option):
                return f"AdamW with {option}=True"
        if torch.is_tensor(group["lr"]) or any(torch.is_tensor(b) for b in group["betas"]):
            return "AdamW with tensor learning rate or betas"
    return None


def scalars(group: dict, steps: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """The kernels' scalars for parameters of `group` at their `steps` (1-based, a float
    tensor on their device), each as 0-dim float64 tensors, so a compiled kernel is not
    specialised on their values. The two that depend on the step are computed where the
    step count lives (no host read), with the arithmetic Python's floats would do (pow,
    correctly rounded division: equal to `lr / (1 - beta1**step)` and `(1 - beta2**step)
    ** 0.5` on a CPU, tests/optim/test_updates.py); the others are host constants."""
    step_size, bias_correction2_sqrt, *rest = stacked_scalars(group, steps)
    return [(a, b, *rest) for a, b in zip(step_size.unbind(), bias_correction2_sqrt.unbind())]


def device_steps(group: dict, states: list[dict], devices, skip: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """Each parameter's step count (its state["step"], moved beside it where it was loaded onto
    the CPU) advanced by 1 - skip on the device, so a skipped step is not counted, and the
    kernels' scalars at the new counts (`scalars`)."""
    return scalars(group, advanced_steps(states, devices, skip))


def advanced_steps(states: list[dict], devices, skip: torch.Tensor) -> torch.Tensor:
    """device_steps' counts advanced, stacked: (P,) floats on the device."""
    for state, device in zip(states, devices):
        if state["step"].device != device:
            state["step"] = state["step"].to(device)
    steps = [state["step"] for state in states]
    taken = 1 - (skip != 0).float()  # any nonzero found_inf is one skip
    torch._foreach_add_(steps, [taken] * len(steps))  # a list: the one-tensor overload reads it on the host
    return torch.stack(steps)


def stacked_scalars(group: dict, steps: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`scalars` for all of `steps` at once: step_size and bias correction 2's root as (P,) float64
    tensors (parameter i's are element i), the rest 0-dim: what a multi-tensor kernel takes."""
    return (*bias_corrections(group, steps),
            *(torch.tensor(x, dtype=torch.float64) for x in (group["lr"], *group["betas"], group["eps"],
                                                              group["weight_decay"],
                                                              -1.0 if group.get("maximize") else 1.0)))


def bias_corrections(group: dict, steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AdamW's `lr / (1 - beta1**step)` and `(1 - beta2**step) ** 0.5` for step counts on the
    device, in float64 there: pow and correctly rounded division, the values Python's floats
    give (bit-equal on a CPU)."""
    lr, (beta1, beta2) = group["lr"], group["betas"]
    steps = steps.double()
    # filled on the device: torch.tensor(x, device=...) copies from the host and makes it wait
    half, lr_t = (torch.full((), x, dtype=torch.float64, device=steps.device) for x in (0.5, lr))
    return lr_t / (1 - torch.pow(beta1, steps)), torch.pow(1 - torch.pow(beta2, steps), half)


# ---- multi-tensor calls (mixprec.optim.AdamW) --------------------------------------------------
KERNELS = {"quantized": adamw_quantized_, "kahan": adamw_kahan_,
           "moments": adamw_moments_}


def stepper(structure: tuple, number: int):
    """One function stepping a list of parameters: `structure` holds each call's (kind of KERNELS,
    keywords); its tensors, and its step size and bias correction 2's root, come in lists alike.
    Compiled with static shapes, so every block size and width is a constant of its loops (a block
    size the kernel divided by at run time cost an integer division per element, dynamic widths a
    scalar loop: 3x slower)."""

    def step(tensors, own, tables, skip, *rest):
        for (kind, static), args, (step_size, bias_correction2_sqrt) in zip(structure, tensors, own):
            scalars = (step_size, bias_correction2_sqrt, *rest)
            if kind == "quantized":
                KERNELS[kind](*args, *tables, skip, *scalars, **dict(static))
            else:
                KERNELS[kind](*args, skip, *scalars)

    # its own code object: Dynamo keeps compiled graphs (and counts them against its recompile limit)
    # per code object, so each group of parameters has its own
    step.__code__ = step.__code__.replace(co_name=f"adamw_step_{number}")
    return step


class Compiled:
    """A kernel compiled at its first call (torch.compile, static shapes, the rounding's options
    for the weight dtype), or run eagerly where that fails and compiling was not demanded (logged
    once)."""

    def __init__(self, fn, name: str, dtype: torch.dtype, demand: bool | None):
        self.fn, self.name, self.dtype, self.demand = fn, name, dtype, demand
        self.compiled = torch.compile(fn, dynamic=False, options=compile_options(dtype))
        self.failed, self.checked = False, False

    def __call__(self, *args):
        if not self.checked:  # bfloat16 weights round by Veltkamp's split: as BF16Updates, eager where unsafe
            self.checked = True
            device = args[2][0].device  # the tables'
            unsafe = compiled_nearest_unsafe(device) if self.dtype == torch.bfloat16 else None
            if unsafe and self.demand:
                raise RuntimeError(f"{self.name} cannot be compiled exactly here: {unsafe}")
            if unsafe:
                self.failed = True
                logger.warning("optimizer: %s on %s runs eagerly (the same arithmetic, slower): %s", self.name,
                               device.type, unsafe)
        if self.failed:
            return self.fn(*args)
        try:
            return self.compiled(*args)
        except Exception as e:  # no C++ compiler or Triton, an unsupported platform, ...
            if self.demand:
                raise
            self.failed = True
            logger.warning("optimizer: %s runs eagerly (the same arithmetic, slower): torch.compile failed: %s",
                           self.name, str(e).splitlines()[0] if str(e) else type(e).__name__)
            return self.fn(*args)
