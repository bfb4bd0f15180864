"""What one Linear layer's three GEMMs would lose in a format, on the tensors of a real step.

    y  = x  @ W^T   (forward)
    dx = dy @ W     (input gradient)
    dW = dy^T @ x   (weight gradient)

`Capture` keeps each layer's input x and the gradient dy arriving at its output in the
last micro-batch; `measure` runs the three GEMMs in a format and in FP32 on them and
returns each GEMM's SQNR against FP32, and the shares of each operand's nonzero values
that the format's scaled cast flushes to zero or saturates. FP8 formats run through the
FP8 Linear's own autograd function, on the emulation (FP32 sums of the exact FP8
products: the kernels' numerics, up to the order of the sums), so what is measured is
exactly what training in that format computes. `gemm_times` times the three GEMMs at the
layer's shapes on this device with the route training would take.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from mixprec.narrow.gemm.fp8 import route_on, scaled_mm
from mixprec.narrow.linear.fp8 import Plan, linear_class
from mixprec.narrow.formats.microscaling import E2M1, ELEMENT_MAX
from mixprec.narrow.formats.mx import MXRecipe
from mixprec.narrow.gemm.mx import mx_mm
from mixprec.narrow.formats.recipe import E4M3, FP8Recipe
from mixprec.narrow.formats.scaling import FP8_MAX, per_tile, quantize, sqnr

GEMMS = ("forward", "input_gradient", "weight_gradient")


class Capture:
    """Forward and backward hooks on the named Linear layers keeping, per layer, its last
    input (M, K) and the last gradient at its output (M, N), detached."""

    def __init__(self, model: nn.Module, names):
        self.x: dict[str, torch.Tensor] = {}
        self.dy: dict[str, torch.Tensor] = {}
        self._handles = []
        for name in names:
            module = model.get_submodule(name)
            self._handles += [module.register_forward_hook(self._keep(self.x, name, lambda args, out: args[0])),
                              module.register_full_backward_hook(self._keep(self.dy, name, lambda gin, gout: gout[0]))]

    @staticmethod
    def _keep(store, name, pick):
        def hook(module, a, b):
            t = pick(a, b)
            store[name] = t.detach().reshape(-1, t.shape[-1])
        return hook

    def __enter__(self) -> "Capture":
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()


def _shares(t: torch.Tensor, dtype: torch.dtype, tile, power_of_2: bool) -> tuple[float, float]:
    """(flushed, saturated): shares of t's nonzero values that the scaled cast to `dtype`
    turns into zero, and of all values it clamps to the format's largest value."""
    q, _ = quantize(t, dtype, tile, power_of_2=power_of_2)
    nonzero = t != 0
    flushed = (nonzero & (q.data.float() == 0)).sum().item() / max(1, nonzero.sum().item())
    scaled = per_tile(torch.div, t.float().abs(), q.scale_inv, q.tile)
    # the amax itself lands on the largest value: only what lies beyond it (past rounding) saturated
    return flushed, (scaled > FP8_MAX[dtype] * (1 + 1e-5)).float().mean().item()


def _mx_shares(recipe: MXRecipe, t: torch.Tensor, gradient: bool) -> tuple[float, float]:
    """_shares for a microscaled recipe's cast (to nearest): flushed to zero, and beyond the
    largest value its block's scale can hold."""
    q = recipe.quantize(t, gradient=gradient)
    nonzero = t != 0
    flushed = (nonzero & (q.dequantize() == 0)).sum().item() / max(1, nonzero.sum().item())
    R, C = t.shape
    top = ELEMENT_MAX[q.data.dtype if q.data.dtype != torch.uint8 else E2M1] * q.scales()[:R, :C]
    return flushed, (t.float().abs() > top * (1 + 1e-5)).float().mean().item()


def measure(x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor, fmt, compute_dtype: torch.dtype) -> dict:
    """Each GEMM's SQNR (dB) in `fmt` against FP32 on these tensors, and the shares of the
    input's, weight's and output gradient's values the cast flushes to zero or saturates."""
    x, w, dy = x.float(), weight.detach().float(), dy.float()
    want = (x @ w.t(), dy @ w, dy.t() @ x)
    if isinstance(fmt, FP8Recipe):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        plan = Plan(fmt, fmt.tiles, compute_dtype, (False, False, False))
        y = linear_class(fmt).matmul.apply(xr, wr, plan, None)
        y.backward(dy.to(y.dtype))
        got = (y, xr.grad, wr.grad)
    else:  # a 16-bit format: its operands rounded, summed in FP32, the output rounded
        xs, ws, gs = (v.to(fmt).float() for v in (x, w, dy))
        got = ((xs @ ws.t()).to(compute_dtype), (gs @ ws).to(compute_dtype), gs.t() @ xs)
    return figures(want, got, operand_shares(fmt, x, w, dy))


def figures(want, got, shares: dict[str, tuple[float, float]]) -> dict:
    """The three GEMMs' SQNRs (dB) of `got` against `want`, and the operands' lost shares."""
    out = {f"{g}_db": round(sqnr(ref, val.float()), 2) for g, ref, val in zip(GEMMS, want, got)}
    out["flushed"] = {role: s[0] for role, s in shares.items()}
    out["saturated"] = {role: s[1] for role, s in shares.items()}
    return out


def operand_shares(fmt, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> dict[str, tuple[float, float]]:
    """Per operand (input, weight (N, K), output gradient): the shares of its values `fmt`'s cast
    flushes to zero and saturates."""
    if isinstance(fmt, MXRecipe):
        roles = {"input": (x, False), "weight": (w, False), "output_gradient": (dy, True)}
        return {role: _mx_shares(fmt, v, gradient) for role, (v, gradient) in roles.items()}
    if isinstance(fmt, FP8Recipe):
        t, pow2 = fmt.tiles, fmt.power_of_2_scales
        roles = {"input": (x, E4M3, t.x), "weight": (w, E4M3, t.w), "output_gradient": (dy, fmt.grad_dtype, t.g)}
        return {role: _shares(v, dtype, tile, pow2) for role, (v, dtype, tile) in roles.items()}
    return {role: ((v != 0).logical_and(v.to(fmt) == 0).sum().item() / max(1, (v != 0).sum().item()),
                   (~torch.isfinite(v.to(fmt))).float().mean().item())
            for role, v in (("input", x), ("weight", w), ("output_gradient", dy))}


def _time(fn, repeats: int = 5) -> float:
    fn()  # warm-up: the first call pays for allocation
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gemm_times(m: int, k: int, n: int, fmt, compute_dtype: torch.dtype, device: torch.device,
               emulate_16bit: bool) -> tuple[float, str | None]:
    """(seconds for the three GEMMs of an (M, K) x (K, N) layer, None or why a GEMM is
    emulated) with the route training takes on `device`: torch's FP8 kernel where the
    probe found one, else the emulation; for a 16-bit format its GEMM, or the FP32 GEMM
    the emulation runs where the device has no fast one (`emulate_16bit`). The casts are
    not timed."""
    gen = torch.Generator().manual_seed(0)
    x, w, dy = (torch.randn(*s, generator=gen).to(device) for s in ((m, k), (n, k), (m, n)))
    if isinstance(fmt, MXRecipe):  # the emulation, the only route mixprec has for these
        why = next(iter(linear_class(fmt).routes(fmt, device.type, compute_dtype).values()))
        ops = [(fmt.quantize(a), fmt.quantize(b)) for a, b in ((x, w), (dy, w.t().contiguous()), (dy.t(), x.t()))]
        return _time(lambda: [mx_mm(a, b, compute_dtype) for a, b in ops]), why
    if not isinstance(fmt, FP8Recipe):
        dtype = torch.float32 if emulate_16bit else fmt
        x, w, dy = x.to(dtype), w.to(dtype), dy.to(dtype)
        seconds = _time(lambda: (x @ w.t(), dy @ w, dy.t() @ x))
        return seconds, (f"{fmt} GEMMs are emulated in float32 on this {device.type}" if emulate_16bit else None)
    emulated = None
    calls = []
    for (name, (a_tile, b_tile), (a_dtype, b_dtype, out)), (a, b) in zip(fmt.gemms(compute_dtype),
                                                                       ((x, w.t()), (dy, w), (dy.t(), x))):
        why = route_on(device.type, a_tile, b_tile, a_dtype, b_dtype, out)
        aq, _ = quantize(a.contiguous(), a_dtype, a_tile)
        bq, _ = quantize(b.contiguous(), b_dtype, b_tile)
        if why is not None:
            emulated = emulated or f"{name}: {why}"
        calls.append(lambda aq=aq, bq=bq, out=out, kernel=why is None: scaled_mm(aq, bq, out, kernel=kernel))
    return _time(lambda: [c() for c in calls]), emulated
