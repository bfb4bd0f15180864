"""What re-planning during training (plan.interval) costs: the time of a training step with
the FP8 layers measured on its tensors against a plain step, side by side in one process,
and that extra time as a share of the steps between two measurements.

    python benchmarks/replan_overhead.py --config configs/small.toml --preset fp8-rowwise [--interval 100]
    python benchmarks/replan_overhead.py --config configs/small.toml --plan plan.toml

Run it alone on the machine: a timing taken beside another torch process is not a figure.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import time

import torch

from mixprec.config import load_config
from mixprec.plan.live import Replanner
from mixprec.train.trainer import Trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/small.toml")
    parser.add_argument("--preset", default="fp8-rowwise")
    parser.add_argument("--plan", default="", help="a plan file (its base preset) instead of --preset")
    parser.add_argument("--interval", type=int, default=100)
    parser.add_argument("--steps", type=int, default=6, help="timed steps of each kind, after 2 warm-up steps")
    args = parser.parse_args()
    overrides = {"training.device": "cpu" if not torch.cuda.is_available() else "cuda", "checkpoint.enable": "false",
                 "stability.enable": "false", "metrics.progress_bar": "false", "job.dump_folder": "/tmp/replan_bench"}
    overrides.update({"precision.plan": args.plan} if args.plan else {"precision.preset": args.preset})
    config = load_config(args.config, overrides)
    trainer = Trainer(config)
    replanner = Replanner(dataclasses.replace(config.plan, interval=1), trainer.policy, trainer.raw_model)

    def timed(watch: bool) -> float:
        t0 = time.perf_counter()
        with replanner.watch(1) if watch else contextlib.nullcontext():
            trainer.train_step()
        if trainer.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    for _ in range(2):
        timed(False)
    plain, watched = [], []
    for _ in range(args.steps):  # interleaved: drift in the machine's speed hits both alike
        plain.append(timed(False))
        watched.append(timed(True))
    p, w = statistics.median(plain), statistics.median(watched)
    layers = len(trainer.policy.layout.fp8())
    device = torch.cuda.get_device_name() if trainer.device.type == "cuda" else \
        f"cpu ({torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads)"
    print(f"{config.model.flavor} flavor, {args.plan or args.preset}, {layers} FP8 layers, {device}")
    print(f"plain step {p * 1e3:.0f} ms, measured step {w * 1e3:.0f} ms (+{(w - p) * 1e3:.0f} ms; the measurement "
          f"itself {replanner.seconds / replanner.measurements * 1e3:.0f} ms)")
    print(f"overhead at plan.interval {args.interval}: {(w - p) / (args.interval * p):.2%} of the step time")


if __name__ == "__main__":
    main()
