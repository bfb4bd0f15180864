"""SQNR of each FP8 recipe against the BF16 and FP32 references, on one Linear.

Cast round trips per tile layout and format, then each recipe's FP8 Linear (forward
output, input gradient, weight gradient) against the BF16 Linear (torchao's reference;
its bounds are 18 dB forward, 17 dB gradients) and against FP32.

    python benchmarks/fp8_sqnr.py [--device cpu|cuda] [--tokens 4096 --k 2048 --n 2048]
"""

from __future__ import annotations

import argparse
import copy

import torch
from torch import nn

from mixprec.narrow import E4M3, E5M2, RECIPES, convert_to_fp8, quantize, sqnr


def linear_case(recipe: str, tokens: int, k: int, n: int, device: str) -> dict[str, float]:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(k, n, bias=False)).to(device)
    fp8 = copy.deepcopy(ref)
    convert_to_fp8(fp8, RECIPES[recipe], compute_dtype=torch.bfloat16)
    x = torch.randn(tokens, k, device=device)
    grad = torch.randn(tokens, n, device=device)
    results = {}
    for name, model, autocast in (("fp32", ref, False), ("bf16", ref, True), ("fp8", fp8, True)):
        xi = x.clone().requires_grad_()
        model.zero_grad()
        with torch.autocast(device, torch.bfloat16, enabled=autocast):
            y = model(xi)
        y.backward(grad.to(y.dtype))
        results[name] = (y.detach().float(), xi.grad.float(), model[0].weight.grad.float().clone())
    out = {}
    for ref_name in ("bf16", "fp32"):
        for i, part in enumerate(("output", "input grad", "weight grad")):
            out[f"{part} vs {ref_name}"] = sqnr(results[ref_name][i], results["fp8"][i])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--k", type=int, default=512)
    p.add_argument("--n", type=int, default=1536)
    args = p.parse_args()
    x = torch.randn(args.tokens, args.k, device=args.device)
    print("cast round trip SQNR (dB), randn input:")
    for name, tile in (("tensorwise", (0, 0)), ("rowwise", (1, 0)), ("1x128", (1, 128)), ("128x128", (128, 128))):
        row = {fmt: sqnr(x, quantize(x, dtype, tile)[0].dequantize()) for fmt, dtype in (("e4m3", E4M3),
                                                                                         ("e5m2", E5M2))}
        print(f"  {name:<11} e4m3 {row['e4m3']:5.1f}   e5m2 {row['e5m2']:5.1f}")
    print(f"\nFP8 Linear {args.tokens}x{args.k} @ {args.k}x{args.n}, SQNR (dB) against the BF16 and the FP32 Linear:")
    header = None
    for recipe in RECIPES:
        row = linear_case(recipe, args.tokens, args.k, args.n, args.device)
        if header is None:
            header = list(row)
            print(f"  {'recipe':<11}" + "".join(f"{h:>22}" for h in header))
        print(f"  {recipe:<11}" + "".join(f"{row[h]:>22.1f}" for h in header))


if __name__ == "__main__":
    main()
