"""What dynamic loss scaling costs per training step.

On the small flavor's real gradients (~32M parameters), times the scaler's own work
(scale the loss, unscale and inf-check every gradient with the fused kernel, read the
overflow flag, update the scale) and a whole fp16-mixed training step, and prints the
share. Also times whole steps with and without the scaler, interleaved.

    python benchmarks/scaler_overhead.py --steps 6
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mixprec import LossScaler, Policy, build_model, model_args


def step_time(policy: Policy, model, opt, x, y) -> float:
    start = time.perf_counter()
    with policy.autocast():
        loss = model(x, y)
    policy.backward(loss)
    policy.step(opt, max_norm=1.0)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="small")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    args = p.parse_args()
    torch.manual_seed(0)
    x = torch.randint(0, 256, (args.batch, args.seq_len))

    def fresh(policy):
        model = build_model(model_args(args.flavor, 256), device="cpu", storage_dtype=torch.float32, seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        return policy.setup(model, opt)

    scaled = Policy.from_preset("fp16-mixed")
    unscaled = Policy(param_dtype=torch.float16)  # fp16 autocast, no loss scaler
    runs = {"with scaler": (scaled, *fresh(scaled)), "without scaler": (unscaled, *fresh(unscaled))}
    times = {name: [] for name in runs}
    for i in range(args.steps + 1):  # interleaved; the first step of each is warm-up
        for name, (policy, model, opt) in runs.items():
            t = step_time(policy, model, opt, x, x)
            if i:
                times[name].append(t)
    full = {name: statistics.median(t) for name, t in times.items()}

    # The scaler's own work on real gradients.
    policy, model, opt = runs["with scaler"]
    with policy.autocast():
        loss = model(x, x)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    scaler = LossScaler("cpu")
    reps, own = 20, []
    for _ in range(reps):
        for p, g in zip(model.parameters(), grads):
            p.grad.copy_(g)
        start = time.perf_counter()
        scaler.scale(loss.detach())
        scaler.unscale_(opt)
        scaler.found_inf
        scaler.update()
        own.append(time.perf_counter() - start)
    scaler_s = statistics.median(own)
    n = sum(p.numel() for p in model.parameters())
    print(f"{args.flavor}: {n / 1e6:.1f}M parameters, batch {args.batch}x{args.seq_len}, "
          f"{torch.get_num_threads()} threads")
    print(f"fp16-mixed step, median of {args.steps}: {full['with scaler'] * 1e3:.0f} ms with the scaler, "
          f"{full['without scaler'] * 1e3:.0f} ms without ({full['with scaler'] / full['without scaler'] - 1:+.1%})")
    print(f"scaler work (scale, unscale_ + inf check, overflow read, update): {scaler_s * 1e3:.2f} ms "
          f"= {scaler_s / full['with scaler']:.2%} of a step")


if __name__ == "__main__":
    main()
