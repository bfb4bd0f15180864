"""mixprec's AdamW with bfloat16 moments (fp8-blockwise's optimizer) and with 8-bit moments
(fp8, 8bit: bf16-mixed-8bit's; 8bit also with 1 and with 8 parameters of one shape a compiled call,
the multi-tensor step's A/B) against torch's AdamW with FP32 moments (foreach and fused), on
the same FP32 parameters, side by side in one process: the step as the trainer takes it
(found_inf set: skipped or taken on the device; the embeddings and tensors under 4096
elements keep FP32 moments, as the trainer's), timed over --steps steps with one wait at the
end of each window.

    python benchmarks/optimizer_step.py --device cpu --flavor small
    python benchmarks/optimizer_step.py --device cuda --flavor 1B
"""

from __future__ import annotations

import argparse
import time

import torch

from mixprec.models.llama import build_model, model_args
from mixprec.optim import AdamW
from mixprec.precision.optimizer_states import embeddings_of


def params_of(flavor: str, device: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The flavor's parameters with gradients, and its embeddings."""
    args = model_args(flavor, 128256 if flavor in ("1B", "8B") else 256)
    model = build_model(args, device=device, storage_dtype=torch.float32, seed=0)
    params = [p for p in model.parameters()]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    return params, embeddings_of(model)


def timed(optimizer, steps: int, device: str) -> float:
    """Seconds per step, the best of three windows of `steps` steps."""
    found_inf = torch.zeros((), device=device)
    best = float("inf")
    for _ in range(3):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            if getattr(optimizer, "_step_supports_amp_scaling", False):  # foreach has no device-side skip
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
    params, embeddings = params_of(args.flavor, args.device)
    n = sum(t.numel() for t in params)
    optimizers = {
        "torch.optim.AdamW(foreach=True), FP32 moments": torch.optim.AdamW(params, lr=1e-4, foreach=True),
        "torch.optim.AdamW(fused=True), FP32 moments": torch.optim.AdamW(params, lr=1e-4, fused=True),
        "mixprec AdamW, bfloat16 moments": AdamW(params, lr=1e-4, moments_dtype=torch.bfloat16),
        **{f"mixprec AdamW, {fmt} moments": AdamW(params, lr=1e-4, states=fmt, embeddings=embeddings)
           for fmt in ("fp8", "8bit")},
        # the multi-tensor step's A/B: parameters of one shape in calls of 8, or a call each (PER_KERNEL's default
        # on this device is one of the two rows above)
        **{f"mixprec AdamW, 8bit moments, per_kernel {n}": AdamW(params, lr=1e-4, states="8bit",
                                                                  embeddings=embeddings, per_kernel=n)
           for n in (1, 8)},
    }
    for opt in optimizers.values():  # first steps: state, compiling
        timed(opt, 2, args.device)
    times = {name: timed(opt, args.steps, args.device) for name, opt in optimizers.items()}
    base = times["torch.optim.AdamW(foreach=True), FP32 moments"]
    where = torch.cuda.get_device_name() if args.device == "cuda" else \
        f"cpu ({torch.backends.cpu.get_cpu_capability()})"
    print(f"{args.flavor} flavor, {n / 1e6:.1f}M FP32 parameters, {where}, torch {torch.__version__}")
    print(f"{'optimizer':<48} {'ms/step':>9} {'vs foreach AdamW':>17} {'state bytes/param':>18}")
    for name, opt in optimizers.items():
        state = sum(t.nbytes for st in opt.state.values() for k, t in st.items() if torch.is_tensor(t) and k != "step")
        print(f"{name:<48} {times[name] * 1e3:9.2f} {times[name] / base:17.2f} {state / n:18.2f}")

if __name__ == "__main__":
    main()
