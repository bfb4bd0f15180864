"""Validation loss of each preset over several `mixprec compare` runs that differ only in
training.seed, against a reference preset seed by seed: is a difference between two
modes larger than what the seed alone moves?

    mixprec compare --presets bf16-mixed,bf16-kahan --training.seed 1 --job.dump_folder runs/seed1
    ...
    python benchmarks/seed_spread.py runs/seed0 runs/seed1 runs/seed2 [--reference bf16-mixed]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", help="mixprec compare run folders (each holds compare.json)")
    parser.add_argument("--reference", default="bf16-mixed")
    args = parser.parse_args()
    runs = []
    for folder in args.folders:
        report = json.loads((Path(folder) / "compare.json").read_text())
        runs.append({r["preset"]: r["final_val_loss"] for r in report["presets"]})
    presets = [p for p in runs[0] if all(p in run for run in runs)]
    if args.reference not in presets:
        raise SystemExit(f"--reference {args.reference}: not in every run; accepted: {', '.join(presets)}")
    print(f"{'preset':<12} " + " ".join(f"{'seed run ' + str(i):>12}" for i in range(len(runs)))
          + f" {'mean':>8} {'vs ' + args.reference + ' (mean, min..max)':>36}")
    for p in presets:
        losses = [run[p] for run in runs]
        diffs = [run[p] / run[args.reference] - 1 for run in runs]
        print(f"{p:<12} " + " ".join(f"{x:12.4f}" for x in losses) + f" {statistics.mean(losses):8.4f} "
              f"{statistics.mean(diffs):+13.2%} ({min(diffs):+.2%}..{max(diffs):+.2%})")


if __name__ == "__main__":
    main()
