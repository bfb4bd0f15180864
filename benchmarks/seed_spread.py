"""Validation loss of each preset over several `mixprec compare` runs that differ only in
training.seed, against a reference preset seed by seed: is a difference between two
modes larger than what the seed alone moves?

    mixprec compare --presets bf16-mixed,bf16-kahan --training.seed 1 --job.dump_folder runs/seed1
    ...
    python benchmarks/seed_spread.py runs/seed0 runs/seed1 runs/seed2 [--reference bf16-mixed]

Runs of the same seed are merged (each preset's seed is read from its own config.toml), so
one seed's presets may come from several compare runs; a preset given twice for one seed is
refused.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tomllib
from pathlib import Path


def read_runs(folders: list[str]) -> dict[int, dict[str, float]]:
    """{seed: {preset: final validation loss}} over the compare run folders."""
    by_seed: dict[int, dict[str, float]] = {}
    for folder in folders:
        report = json.loads((Path(folder) / "compare.json").read_text())
        for row in report["presets"]:
            config = tomllib.loads((Path(folder) / row["preset"] / "config.toml").read_text())
            seed = config["training"]["seed"]
            losses = by_seed.setdefault(seed, {})
            if row["preset"] in losses:
                sys.exit(f"{folder}: preset {row['preset']} at seed {seed} is in more than one run; give it once")
            losses[row["preset"]] = row["final_val_loss"]
    return dict(sorted(by_seed.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", help="mixprec compare run folders (each holds compare.json)")
    parser.add_argument("--reference", default="bf16-mixed")
    args = parser.parse_args()
    by_seed = read_runs(args.folders)
    runs = list(by_seed.values())
    presets = [p for p in runs[0] if all(p in run for run in runs)]
    if args.reference not in presets:
        sys.exit(f"--reference {args.reference}: not in every seed; accepted: {', '.join(presets)}")
    print(f"{'preset':<16} " + " ".join(f"{'seed ' + str(s):>9}" for s in by_seed)
          + f" {'mean':>8}  vs {args.reference}: mean (per seed)")
    for p in presets:
        losses = [run[p] for run in runs]
        diffs = [run[p] / run[args.reference] - 1 for run in runs]
        print(f"{p:<16} " + " ".join(f"{x:9.4f}" for x in losses) + f" {statistics.mean(losses):8.4f}  "
              f"{statistics.mean(diffs):+.2%} (" + ", ".join(f"{d:+.2%}" for d in diffs) + ")")


if __name__ == "__main__":
    main()
