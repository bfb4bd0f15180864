"""`mixprec demo fp8-accumulation`: why DeepSeek-V3 promotes FP8 partial sums to FP32.

DeepSeek-V3 (section 3.3.2) reports that the tensor cores of an H800 accumulate FP8
GEMMs in a register keeping about 14 bits, and that a K = 4096 GEMM then errs by up to 2%;
its fix adds each 128-product partial sum into an FP32 register. This emulates the three
schemes on the same FP8 operands (products of two e4m3 values are exact in FP64 and FP32).
The model of the tensor core: it sums one instruction's 32 products (an FP8 WGMMA's k) and
adds that sum into the accumulator, which keeps `bits` significant bits and truncates (the
hardware aligns the addends to the larger exponent and drops the shifted-out bits):

  limited     that accumulator over all of K;
  promoted    that accumulator over 128 products, then added into an FP32 register (DeepSeek-V3);
  float32     an FP32 accumulator over all of K.

Each is compared with the FP64 sum of the same products: relative error = |C - C64| / |C64|
over a (64 x 64) output, for K = 128 ... 16384 (prefixes of one K = 16384 run).
"""

from __future__ import annotations

import json

import torch

from mixprec.narrow.formats.recipe import E4M3
from mixprec.narrow.formats.scaling import quantize

K_VALUES = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def truncate(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x (FP64) with `bits` significant bits, rounded toward zero."""
    mantissa, exponent = torch.frexp(x)  # x = mantissa * 2^exponent, |mantissa| in [0.5, 1)
    return torch.ldexp(torch.trunc(mantissa * 2.0**bits) / 2.0**bits, exponent)


def accumulation_errors(bits: int = 14, interval: int = 128, group: int = 32, outputs: int = 64,
                        seed: int = 0) -> dict:
    """Relative errors of the three schemes at each K of K_VALUES."""
    gen = torch.Generator().manual_seed(seed)
    k_max = K_VALUES[-1]
    a = quantize(torch.randn(outputs, k_max, generator=gen), E4M3, (1, 0))[0].dequantize().double()
    b = quantize(torch.randn(k_max, outputs, generator=gen), E4M3, (0, 1))[0].dequantize().double()
    # each output's sum of one instruction's products, (outputs^2, K / group): FP64 sums of
    # 32 e4m3 x e4m3 products (16 significant bits each) are exact
    n_groups = k_max // group
    groups = torch.bmm(a.view(outputs, n_groups, group).transpose(0, 1), b.view(n_groups, group, outputs))
    groups = groups.reshape(n_groups, -1).t()
    exact = groups.cumsum(dim=1)  # FP64 prefix sums: the reference for every K
    limited = torch.zeros(groups.shape[0], dtype=torch.float64)
    partial = torch.zeros_like(limited)
    promoted = torch.zeros_like(limited, dtype=torch.float32)
    fp32 = torch.zeros_like(limited, dtype=torch.float32)
    errors = {"limited": [], "promoted": [], "float32": []}

    def rel(c: torch.Tensor, k: int) -> float:
        ref = exact[:, k // group - 1]
        return float((c.double() - ref).norm() / ref.norm())

    for g in range(groups.shape[1]):
        p, k = groups[:, g], (g + 1) * group  # products summed so far
        limited = truncate(limited + p, bits)
        partial = truncate(partial + p, bits)
        fp32 = fp32 + p.float()
        if k % interval == 0:
            promoted, partial = promoted + partial.float(), torch.zeros_like(partial)
        if k in K_VALUES:
            for name, c in (("limited", limited), ("promoted", promoted), ("float32", fp32)):
                errors[name].append(rel(c, k))
    return {"bits": bits, "interval": interval, "group": group, "K": list(K_VALUES), "relative_error": errors}


def plot(report: dict, path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    labels = {"limited": f"{report['bits']}-bit accumulator over all of K",
              "promoted": f"{report['bits']}-bit, promoted to FP32 every {report['interval']}",
              "float32": "FP32 accumulator"}
    for name, errs in report["relative_error"].items():
        ax.loglog(report["K"], errs, marker="o", label=labels[name])
    ax.set_xlabel("K (products per output)")
    ax.set_ylabel("relative error against FP64")
    ax.set_title("FP8 GEMM accumulation (e4m3 operands)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run(as_json: bool, plot_path: str | None = "fp8_accumulation.png") -> int:
    report = accumulation_errors()
    written = plot(report, plot_path) if plot_path else None
    if as_json:
        print(json.dumps({**report, "plot": written}, indent=2))
        return 0
    errs = report["relative_error"]
    print(f"Relative error of an FP8 GEMM's outputs against FP64 (e4m3 operands, {report['bits']}-bit accumulator "
          "truncating each addition):")
    print(f"  {'K':>6}  {'limited':>10}  {'promoted/128':>12}  {'float32':>10}")
    for i, k in enumerate(report["K"]):
        print(f"  {k:>6}  {errs['limited'][i]:>10.2e}  {errs['promoted'][i]:>12.2e}  {errs['float32'][i]:>10.2e}")
    print(f"plot: {written}" if written else "plot: not written (matplotlib is not installed: pip install matplotlib)")
    return 0
