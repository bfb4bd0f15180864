"""AdamW's moments in 8 bits against FP32 moments: the final validation loss of each optimizer-state
format over several seeds on a real corpus (this Python's standard library, byte tokens), the
gap to bf16-mixed (FP32 moments beside FP32 weights) and to bf16-kahan (bfloat16 moments beside
compensated bfloat16 weights) seed by seed.

    python benchmarks/optimizer_state_accuracy.py --out runs/states --flavor small [--seeds 0,1,2]

Each run is `mixprec train --config configs/<flavor>.toml` in a process of its own (skipped when its
summary.json exists: a stopped benchmark goes on where it stopped); the table and a plot
(optimizer_state_accuracy.png) follow.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

# label: train arguments; the reference of each gap after the colon in REFERENCE
CONFIGS = {
    "bf16-mixed": ["--precision.preset", "bf16-mixed"],
    "bf16-mixed-8bit": ["--precision.preset", "bf16-mixed-8bit"],
    "bf16-mixed, fp8 moments": ["--precision.preset", "bf16-mixed", "--precision.optimizer_states", "fp8"],
    "bf16-kahan": ["--precision.preset", "bf16-kahan"],
    "bf16-kahan-8bit": ["--precision.preset", "bf16-kahan-8bit"],
    "bf16-kahan, fp8 moments": ["--precision.preset", "bf16-kahan", "--precision.optimizer_states", "fp8"],
}


def train(run: Path, flavor: str, args: list[str], seed: str, steps: int | None) -> float:
    if not (run / "summary.json").is_file():
        config = Path(__file__).resolve().parents[1] / "configs" / f"{flavor}.toml"
        more = ["--training.steps", str(steps), "--training.eval_interval", str(steps)] if steps else []
        subprocess.run([sys.executable, "-m", "mixprec", "train", "--config", str(config), *args, *more,
                        "--training.seed", seed, "--checkpoint.enable", "false", "--metrics.progress_bar", "false",
                        "--job.dump_folder", str(run)], check=True, stdout=subprocess.DEVNULL)
    return json.loads((run / "summary.json").read_text())["final_val_loss"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--flavor", default="small", help="debug or small (configs/<flavor>.toml)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=None, help="default: the config's")
    a = p.parse_args()
    seeds = a.seeds.split(",")
    losses = {}
    for label, args in CONFIGS.items():
        for seed in seeds:
            folder = Path(a.out) / a.flavor / label.replace(", ", "-").replace(" ", "-") / f"seed{seed}"
            losses[label, seed] = train(folder, a.flavor, args, seed, a.steps)
            print(f"{label:<26} seed {seed}: {losses[label, seed]:.4f}", flush=True)
    rows = {}
    print(f"\n{a.flavor} flavor, seeds {a.seeds}: final validation loss, and the gap seed by seed")
    print(f"{'optimizer states':<26} {'mean':>8} {'vs bf16-mixed: mean (range)':>30} {'vs bf16-kahan: mean (range)':>30}")
    for label in CONFIGS:
        gaps = {}
        for ref in ("bf16-mixed", "bf16-kahan"):
            per_seed = [100 * (losses[label, s] / losses[ref, s] - 1) for s in seeds]
            gaps[ref] = per_seed
        rows[label] = gaps
        cell = lambda g: f"{statistics.mean(g):+.2f}% ({min(g):+.2f} .. {max(g):+.2f})"
        print(f"{label:<26} {statistics.mean(losses[label, s] for s in seeds):8.4f} {cell(gaps['bf16-mixed']):>30} "
              f"{cell(gaps['bf16-kahan']):>30}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for i, label in enumerate(CONFIGS):
        ax.scatter([i] * len(seeds), rows[label]["bf16-mixed"], color="C0")
        ax.hlines(statistics.mean(rows[label]["bf16-mixed"]), i - 0.25, i + 0.25, color="C1")
    ax.axhspan(-0.5, 0.5, color="0.9", zorder=0)
    ax.set_xticks(range(len(CONFIGS)), list(CONFIGS), rotation=20, fontsize=7, ha="right")
    ax.set_ylabel("final val loss vs bf16-mixed (%)")
    ax.set_title(f"{a.flavor} flavor, seeds {a.seeds}: each seed (dots), the mean (bar), +-0.5% (band)", fontsize=8)
    fig.tight_layout()
    fig.savefig(Path(a.out) / f"optimizer_state_accuracy_{a.flavor}.png", dpi=120)
    print(f"plot: {Path(a.out) / f'optimizer_state_accuracy_{a.flavor}.png'}")


if __name__ == "__main__":
    main()
