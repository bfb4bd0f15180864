"""Replay the stability guard's health check over finished runs' metrics.jsonl: how many
incidents (false positives, on clean runs) a window and threshold would raise, and the
largest z-scores seen. The check is a pure function of each step's loss and gradient
norm, so a replay decides exactly as the guard would have (until its first rewind).

    python benchmarks/stability_replay.py RUN/metrics.jsonl ... [--window 128] [--threshold 6]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mixprec.stability.config import StabilityConfig
from mixprec.stability.health import HealthMonitor
from mixprec.train.metrics import read_metrics


def replay(path: Path, config: StabilityConfig) -> dict:
    monitor = HealthMonitor(config.window, config.threshold, config.min_history)
    incidents, max_loss_z, max_norm_z, steps = [], float("-inf"), float("-inf"), 0
    for r in read_metrics(path):
        steps += 1
        health = monitor.check(r["step"], r["loss"], r.get("grad_norm"), overflow=bool(r.get("skipped")))
        max_loss_z = max(max_loss_z, health.loss_z if health.loss_z is not None else float("-inf"))
        max_norm_z = max(max_norm_z, health.grad_norm_z if health.grad_norm_z is not None else float("-inf"))
        if health.kind is not None:
            incidents.append(f"step {r['step']}: {health.reason}")
    return {"steps": steps, "incidents": incidents, "max_loss_z": max_loss_z, "max_grad_norm_z": max_norm_z}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("metrics", nargs="+", type=Path)
    parser.add_argument("--window", type=int, default=StabilityConfig.window)
    parser.add_argument("--threshold", type=float, default=StabilityConfig.threshold)
    args = parser.parse_args()
    config = StabilityConfig(window=args.window, threshold=args.threshold)
    print(f"window {config.window}, threshold {config.threshold:g} (checks from {config.min_history} steps of history)")
    print("| run | steps | incidents | max loss z | max grad-norm z |")
    print("|---|---|---|---|---|")
    for path in args.metrics:
        r = replay(path, config)
        print(f"| {path.parent.name} | {r['steps']} | {len(r['incidents'])} | {r['max_loss_z']:.1f} | "
              f"{r['max_grad_norm_z']:.1f} |")
        for line in r["incidents"]:
            print(f"|   {line} | | | | |")


if __name__ == "__main__":
    main()
