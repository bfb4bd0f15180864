"""AdamW with bfloat16 moments (fp8-blockwise's optimizer) against torch's fused AdamW with
FP32 moments, on the same FP32 parameters, side by side in one process: the step as the
trainer takes it (found_inf set: skipped or taken on the device), timed over --steps
steps with one wait at the end of each window.

    python benchmarks/optimizer_step.py --device cuda --flavor 1B
    python benchmarks/optimizer_step.py --device cpu --flavor debug   # a smoke run
"""

from __future__ import annotations

import argparse
import time

import torch

from mixprec.models.llama import build_model, model_args
from mixprec.optim import AdamW


def params_of(flavor: str, device: str) -> list[torch.Tensor]:
    args = model_args(flavor, 128256 if flavor in ("1B", "8B") else 256)
    model = build_model(args, device=device, storage_dtype=torch.float32, seed=0)
    params = [p for p in model.parameters()]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    return params


def timed(optimizer, steps: int, device: str) -> float:
    """Seconds per step, the best of three windows of `steps` steps."""
    found_inf = torch.zeros((), device=device)
    best = float("inf")
    for _ in range(3):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            optimizer.grad_scale, optimizer.found_inf = None, found_inf  # as Policy.step hands it over
            optimizer.step()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / steps)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="1B")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    params = params_of(args.flavor, args.device)
    n = sum(t.numel() for t in params)
    fused = torch.optim.AdamW(params, lr=1e-4, fused=True)
    ours = AdamW(params, lr=1e-4, moments_dtype=torch.bfloat16)
    for opt in (fused, ours):  # first steps: state, compiling
        timed(opt, 2, args.device)
    t_fused, t_ours = timed(fused, args.steps, args.device), timed(ours, args.steps, args.device)
    where = torch.cuda.get_device_name() if args.device == "cuda" else \
        f"cpu ({torch.backends.cpu.get_cpu_capability()})"
    print(f"{args.flavor} flavor, {n / 1e6:.1f}M FP32 parameters, {where}, torch {torch.__version__}")
    print(f"{'optimizer':<44} {'ms/step':>9} {'vs fused AdamW':>15}")
    print(f"{'torch.optim.AdamW(fused=True), FP32 moments':<44} {t_fused * 1e3:9.2f} {1.0:15.2f}")
    print(f"{'mixprec AdamW, bfloat16 moments':<44} {t_ours * 1e3:9.2f} {t_ours / t_fused:15.2f}")


if __name__ == "__main__":
    main()
