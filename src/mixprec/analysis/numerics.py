"""`mixprec analyze`: the formats' limits, measured on real tensors.

- range: chosen values cast to each format: overflow, flush to zero, subnormal;
- accumulation: N additions of one value in each accumulator dtype against the exact sum;
- quantisation: the error of casting Normal(0, std) weights to each format;
- census: for each parameter of a real model after one backward, the share of gradient
  elements (times the loss scale) that would overflow, flush to zero or be subnormal in
  FP16, BF16, E4M3 and E5M2, with a histogram of log2 magnitudes against each range
  (the figure of Micikevicius et al. 2018).
"""

from __future__ import annotations

import math

import torch

from mixprec.analysis.formats import FORMATS

LOW = ("fp16", "bf16", "fp8_e4m3", "fp8_e5m2")


def classify(x: torch.Tensor, fmt: str) -> dict[str, float]:
    """Shares of nonzero elements of `x` that overflow, flush to zero, or land in subnormals."""
    f = FORMATS[fmt]
    mag = x.detach().double().abs().flatten()
    mag = mag[mag > 0]
    if mag.numel() == 0:
        return {"overflow": 0.0, "underflow": 0.0, "subnormal": 0.0}
    # round-to-nearest limits: above max + half an ulp overflows; below half the smallest subnormal flushes
    over = mag >= f.max * (1 + f.eps / 4)
    under = mag < f.underflow
    sub = (mag >= f.underflow) & (mag < f.smallest_normal)
    n = mag.numel()
    return {"overflow": over.sum().item() / n, "underflow": under.sum().item() / n, "subnormal": sub.sum().item() / n}


def range_table(values: list[float]) -> list[dict]:
    """Each value cast by torch to each format, and what happened to it."""
    rows = []
    for v in values:
        row = {"value": v}
        for name in LOW:
            got = torch.tensor(v, dtype=torch.float64).to(FORMATS[name].dtype).double().item()
            f = FORMATS[name]
            kind = ("overflow" if math.isinf(got) or math.isnan(got) or abs(v) > f.max * (1 + f.eps / 4)
                    else "zero" if got == 0 and v != 0 else "subnormal" if abs(got) < f.smallest_normal and got
                    else "exact" if got == v else "rounded")
            row[name] = {"stored": got, "kind": kind}
        rows.append(row)
    return rows


def accumulate(value: float, n: int, dtype: torch.dtype) -> float:
    """`value` added n times, left to right, into an accumulator of `dtype`."""
    acc = torch.zeros((), dtype=dtype)
    step = torch.tensor(value, dtype=dtype)
    for _ in range(n):
        acc += step
    return acc.item()


def accumulation_table(value: float, counts: list[int]) -> list[dict]:
    rows = []
    for n in counts:
        exact = torch.tensor(value, dtype=torch.float64).item() * n
        row = {"n": n, "exact": exact}
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
            got = accumulate(value, n, dtype)
            row[name] = {"sum": got, "relative_error": abs(got - exact) / abs(exact)}
        rows.append(row)
    return rows


def quantisation(std: float, numel: int = 1 << 20, seed: int = 0) -> dict[str, dict]:
    """Normal(0, std) weights cast to each format: relative RMS error, SQNR and flushed share."""
    w = torch.randn(numel, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * std
    out = {}
    for name in LOW:
        q = w.to(FORMATS[name].dtype).double()
        err = (q - w).norm() / w.norm()
        out[name] = {"relative_rms_error": err.item(), "sqnr_db": -20 * math.log10(err.item()) if err > 0 else math.inf,
                     **classify(w, name)}
    return out


def gradient_census(model: torch.nn.Module, loss_scale: float = 1.0) -> dict[str, dict]:
    """Per parameter with a gradient: the classify() shares of grad * loss_scale per format."""
    return {name: {fmt: classify(p.grad * loss_scale, fmt) for fmt in LOW}
            for name, p in model.named_parameters() if p.grad is not None}


def plot_census(model: torch.nn.Module, loss_scale: float, path) -> None:
    """Histogram of log2 |gradient| over all parameters, with each format's range."""
    from mixprec.reporting import pyplot

    plt = pyplot()
    grads = torch.cat([(p.grad.detach().double().abs() * loss_scale).flatten() for p in model.parameters()
                       if p.grad is not None])
    grads = grads[grads > 0]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.hist(torch.log2(grads).numpy(), bins=120, color="0.35")
    ax.set_yscale("log")
    colors = {"fp16": "tab:blue", "bf16": "tab:orange", "fp8_e4m3": "tab:green", "fp8_e5m2": "tab:red"}
    for name in LOW:
        f = FORMATS[name]
        lo, sub, hi = math.log2(f.smallest_subnormal), math.log2(f.smallest_normal), math.log2(f.max)
        if lo > -160:  # BF16 reaches 2^-133: drawn, but far left
            ax.axvline(lo, color=colors[name], ls=":", lw=1)
        ax.axvline(sub, color=colors[name], ls="--", lw=1)
        ax.axvline(hi, color=colors[name], ls="-", lw=1, label=f"{name}: subnormal / normal / max")
    ax.set_xlabel(f"log2 |gradient x loss scale {loss_scale:g}|")
    ax.set_ylabel("elements")
    ax.set_xlim(max(-70, math.log2(grads.min().item()) - 4), 20)
    ax.set_title("Gradient magnitudes of one step against each format's range")
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
