"""Validation loss of the microscaled recipes and their options over several seeds, against
bf16-mixed seed by seed: the NVFP4 ablation (which of stochastic rounding, the Hadamard
transform, 2-D weight blocks and 4-over-6 matter) and MXFP4 with and without a Hadamard
transform.

    python benchmarks/mx_ablation.py --config configs/debug.toml --steps 200 --seeds 0,1,2 --out runs/mx
    python benchmarks/mx_ablation.py ... --variants bf16-mixed,nvfp4,nvfp4-no-sr --plot docs/img/mx.png

Each (variant, seed) is one `mixprec train` run in OUT/VARIANT/seedS, one at a time; a run
folder whose summary.json exists is read, not run again, so an interrupted study resumes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

# label -> (preset, extra flags)
VARIANTS = {
    "bf16-mixed": ("bf16-mixed", ()),
    "mxfp8": ("mxfp8", ()),
    "mxfp8-floor": ("mxfp8", ("--fp8.scale_rounding", "floor")),
    "nvfp4": ("nvfp4", ()),
    "nvfp4-no-sr": ("nvfp4", ("--fp8.stochastic_gradients", "false")),
    "nvfp4-no-rht": ("nvfp4", ("--fp8.hadamard", "none")),
    "nvfp4-1d-weights": ("nvfp4", ("--fp8.weight_2d", "false")),
    "nvfp4-4over6": ("nvfp4", ("--fp8.four_over_six", "true")),
    "nvfp4-all-blocks": ("nvfp4", ("--fp8.keep_last_blocks", "0")),
    "mxfp4": ("mxfp4", ()),
    "mxfp4-rht-random": ("mxfp4", ("--fp8.hadamard", "random")),
    "mxfp4-rht-deterministic": ("mxfp4", ("--fp8.hadamard", "deterministic")),
}


def run(label: str, seed: int, args) -> dict:
    folder = Path(args.out) / label / f"seed{seed}"
    summary = folder / "summary.json"
    if not summary.is_file():
        preset, extra = VARIANTS[label]
        cmd = [sys.executable, "-m", "mixprec", "train", "--training.device", "cpu", "--precision.preset", preset,
               "--training.steps", str(args.steps), "--training.seed", str(seed), "--job.dump_folder", str(folder),
               "--metrics.progress_bar", "false", "--metrics.plot", "false", *extra]
        if args.config:
            cmd[4:4] = ["--config", args.config]
        t0 = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"{label} seed {seed} failed ({done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
        print(f"  {label} seed {seed}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return json.loads(summary.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--out", default="runs/mx_ablation")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--reference", default="bf16-mixed")
    parser.add_argument("--plot", help="draw each variant's difference per seed and its mean into this PNG")
    args = parser.parse_args()
    labels = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in labels + [args.reference] if v not in VARIANTS]
    if unknown:
        sys.exit(f"--variants: unknown {unknown[0]!r}; accepted: {', '.join(VARIANTS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.reference not in labels:
        labels.insert(0, args.reference)
    loss = {label: {s: run(label, s, args)["final_val_loss"] for s in seeds} for label in labels}
    ref = loss[args.reference]
    print(f"validation loss after {args.steps} steps, {args.config or 'the default config'}; difference against "
          f"{args.reference} seed by seed")
    print("| variant | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | vs " + args.reference
          + " (mean; per seed) |")
    print("|---" * (len(seeds) + 3) + "|")
    diffs = {}
    for label in labels:
        d = [100 * (loss[label][s] / ref[s] - 1) for s in seeds]
        diffs[label] = d
        per_seed = ", ".join(f"{x:+.2f}" for x in d)
        print(f"| {label} | " + " | ".join(f"{loss[label][s]:.4f}" for s in seeds)
              + f" | {statistics.mean(loss[label].values()):.4f} | "
              + ("-" if label == args.reference else f"{statistics.mean(d):+.2f}% ({per_seed})") + " |")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        shown = [label for label in labels if label != args.reference]
        fig, ax = plt.subplots(figsize=(1.0 + 0.9 * len(shown), 4))
        for i, label in enumerate(shown):
            ax.scatter([i] * len(seeds), diffs[label], color="tab:gray", s=14)
            ax.scatter([i], [statistics.mean(diffs[label])], color="tab:red", marker="_", s=400)
        ax.axhline(0, color="black", lw=0.8)
        ax.set_xticks(range(len(shown)), shown, rotation=40, ha="right")
        ax.set_ylabel(f"validation loss vs {args.reference} (%)")
        ax.set_title(f"{args.steps} steps, seeds {args.seeds}: each seed (gray), mean (red)")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
