"""Replay the stability guard's health check over finished runs' metrics.jsonl: how many
incidents (false positives, on clean runs) a window and threshold would raise, and the
largest z-scores seen. The check is a pure function of each step's loss and gradient
norm (and whether clipping scaled the gradients down: the norm above the run's
training.max_norm, read from its config.toml), so a replay decides exactly as the guard
would have (until its first rewind).

    python benchmarks/stability_replay.py RUN/metrics.jsonl ... [--window 128] [--threshold 6]
"""

from __future__ import annotations

import argparse
import math
import tomllib
from pathlib import Path

from mixprec.config import Training
from mixprec.stability.config import StabilityConfig
from mixprec.stability.health import HealthMonitor
from mixprec.train.metrics import read_metrics


def max_norm(run: Path) -> float:
    """The run's training.max_norm (its config.toml), else the default."""
    config = run / "config.toml"
    table = tomllib.loads(config.read_text()).get("training", {}) if config.exists() else {}
    return float(table.get("max_norm", Training.max_norm))


def replay(path: Path, config: StabilityConfig) -> dict:
    monitor = HealthMonitor(config.window, config.threshold, config.min_history)
    incidents, warnings, max_loss_z, max_norm_z, steps = [], [], float("-inf"), float("-inf"), 0
    clip = max_norm(path.parent)
    for r in read_metrics(path):
        steps += 1
        norm, skipped = r.get("grad_norm"), bool(r.get("skipped"))
        clipped = bool(clip) and not skipped and norm is not None and math.isfinite(norm) and norm > clip
        health = monitor.check(r["step"], r["loss"], norm, overflow=skipped)
        max_loss_z = max(max_loss_z, health.loss_z if health.loss_z is not None else float("-inf"))
        max_norm_z = max(max_norm_z, health.grad_norm_z if health.grad_norm_z is not None else float("-inf"))
        if health.kind is not None:
            incidents.append(f"step {r['step']}: {health.reason}")
        if health.warning:
            warnings.append(f"step {r['step']} ({'clipped' if clipped else 'unclipped'}, a warning): {health.warning}")
    return {"steps": steps, "incidents": incidents, "warnings": warnings, "max_loss_z": max_loss_z,
            "max_grad_norm_z": max_norm_z}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("metrics", nargs="+", type=Path)
    parser.add_argument("--window", type=int, default=StabilityConfig.window)
    parser.add_argument("--threshold", type=float, default=StabilityConfig.threshold)
    args = parser.parse_args()
    config = StabilityConfig(window=args.window, threshold=args.threshold)
    print(f"window {config.window}, threshold {config.threshold:g} (checks from {config.min_history} steps of history)")
    print("| run | steps | incidents | clipped gradient spikes | max loss z | max grad-norm z |")
    print("|---|---|---|---|---|---|")
    for path in args.metrics:
        r = replay(path, config)
        print(f"| {path.parent.name} | {r['steps']} | {len(r['incidents'])} | {len(r['warnings'])} | "
              f"{r['max_loss_z']:.1f} | {r['max_grad_norm_z']:.1f} |")
        for line in r["incidents"] + r["warnings"]:
            print(f"|   {line} | | | | | |")


if __name__ == "__main__":
    main()
