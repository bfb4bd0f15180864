"""Step time of bf16-kahan and bf16-sr against bf16-true (and bf16-mixed), side by side
in one process, with the optimizer step's share timed apart.

One trainer per preset, same config; they take their steps in turns, so all see the same
machine load. Reported per preset: the median step time and its ratio to bf16-true, the
median optimizer step (Policy.step: clip, widen, step, round) and the training state in
bytes per parameter, counted on the real objects after a step (weights, their gradients
while they exist, optimizer state including any compensation).

    python benchmarks/bf16_updates.py [--flavor small] [--steps 30] [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from mixprec.config import load_config
from mixprec.train.trainer import Trainer

PRESETS = ("bf16-true", "bf16-kahan", "bf16-sr", "bf16-mixed")


def trainer(folder: str, flavor: str, steps: int, preset: str, device: str) -> Trainer:
    overrides = {"model.flavor": flavor, "training.steps": str(steps), "training.device": device,
                 "checkpoint.enable": "false", "job.dump_folder": folder, "stability.enable": "false",
                 "precision.preset": preset}
    return Trainer(load_config(None, overrides))


def state_bytes_per_param(t: Trainer) -> float:
    params = list(t.raw_model.parameters())
    weights = sum(p.numel() * p.element_size() for p in params)
    grads = weights  # every gradient takes its parameter's dtype in these presets
    states = sum(v.numel() * v.element_size() for s in t.optimizer.state.values() for k, v in s.items()
                 if torch.is_tensor(v) and k != "step")
    return (weights + grads + states) / sum(p.numel() for p in params)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="small")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of the medians")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--presets", default=",".join(PRESETS))
    args = parser.parse_args()
    presets = args.presets.split(",")
    step_times = {p: [] for p in presets}
    opt_times = {p: [] for p in presets}
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {p: trainer(f"{tmp}/{p}", args.flavor, args.steps, p, args.device) for p in presets}
        for name, t in trainers.items():  # time Policy.step inside the training step
            def timed(optimizer, max_norm=None, _step=t.policy.step, _times=opt_times[name], _t=t):
                t0 = time.perf_counter()
                applied = _step(optimizer, max_norm)
                if _t.device.type == "cuda":
                    torch.cuda.synchronize(_t.device)
                _times.append(time.perf_counter() - t0)
                return applied
            t.policy.step = timed
        for step in range(1, args.steps + 1):
            for name, t in trainers.items():
                t0 = time.perf_counter()
                t.train_step()
                if t.device.type == "cuda":
                    torch.cuda.synchronize(t.device)
                step_times[name].append(time.perf_counter() - t0)
                t.step = step
            if step % 10 == 0:
                print(f"step {step}/{args.steps}", flush=True)
        sizes = {name: state_bytes_per_param(t) for name, t in trainers.items()}
    median = {p: statistics.median(step_times[p][args.warmup:]) for p in presets}
    base = median.get("bf16-true", median[presets[0]])
    print(f"\n{args.flavor} flavor, {args.steps} steps in turns (medians after {args.warmup}), {args.device}")
    print(f"{'preset':<12} {'step ms':>9} {'vs bf16-true':>13} {'optimizer ms':>13} {'state B/param':>14}")
    for p in presets:
        print(f"{p:<12} {median[p] * 1e3:9.1f} {median[p] / base:13.3f} "
              f"{statistics.median(opt_times[p][args.warmup:]) * 1e3:13.1f} {sizes[p]:14.1f}")


if __name__ == "__main__":
    main()
